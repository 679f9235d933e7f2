"""How tensor parallelism splits a block's matrices (Megatron's rule): the one home of it.

A column-parallel matrix (attention's q, k, v; the MLP's gate and up) is split along its output
dimension: each of ``parts`` ranks holds a slab of its rows (``nn.Linear`` keeps a weight as
``(out, in)``), computes a slice of the output features, and needs no communication until the
row-parallel matrix after it (attention's output, the MLP's down), split along its input
dimension (a slab of columns), sums the partial outputs by one all-reduce. A shared expert's
SwiGLU splits as the dense MLP; the routed experts' 3-D tensors and the router are not split here
(expert parallelism holds whole experts).

Two readers: the ``tp`` runtime (:func:`parallelize_stage`, torch's ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel`` on the stage's ``tp`` device mesh; each tp rank then
computes ``n_heads / tp`` query heads and ``n_kv_heads / tp`` key/value heads, whole heads, so
rotary embedding and attention run on local heads; the norms, the embedding and the head stay
replicated: no vocabulary-parallel head yet), and Muon's blockwise emulation (``muon_blocks``,
:class:`nobubble.optim.muon.Muon`), whose blocks of k and v need not hold whole heads
(``n_kv_heads * head_dim / parts`` rows): a block may be a fraction of a head, which an
orthogonalization is free to be.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from nobubble.model.presets import ModelConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from nobubble.model.layers import Stage


class Split(StrEnum):
    COLUMN = "column"  # along the output dimension: dim 0 of an (out, in) weight
    ROW = "row"  # along the input dimension: dim 1


# the linear layers of a block that tensor parallelism splits, by their attribute name, and how
_RULES: dict[str, Split] = {
    "wq": Split.COLUMN,
    "wk": Split.COLUMN,
    "wv": Split.COLUMN,
    "wo": Split.ROW,
    "w_gate": Split.COLUMN,
    "w_up": Split.COLUMN,
    "w_down": Split.ROW,
}
_DIM: dict[Split, int] = {Split.COLUMN: 0, Split.ROW: 1}
_STYLE = {Split.COLUMN: ColwiseParallel, Split.ROW: RowwiseParallel}


def split_of(name: str) -> Split | None:
    """How tensor parallelism splits parameter ``name`` (a full name such as
    ``blocks.3.attn.wq.weight``), or None for one it does not split by this rule."""
    parts = name.split(".")
    if parts[0] != "blocks" or len(parts) < 3 or parts[-1] != "weight":
        return None
    return _RULES.get(parts[-2])


def split_dim(name: str) -> int:
    """The dimension of 2-D parameter ``name`` that tensor parallelism splits."""
    split = split_of(name)
    if split is None:
        known = ", ".join(f"{leaf}.weight" for leaf in sorted(_RULES))
        raise ValueError(
            f"{name} has no tensor-parallel split rule (nobubble/model/tensor_split.py knows "
            f"{known} inside blocks); add one, or use muon_blocks=1"
        )
    return _DIM[split]


def split_problem(name: str, shape: tuple[int, ...], parts: int) -> str | None:
    """Why matrix ``name`` of ``shape`` cannot be split into ``parts`` blocks, or None."""
    size = shape[split_dim(name)]
    if size % parts:
        return f"{name} {tuple(shape)} splits along a dimension of {size}, not divisible by {parts}"
    return None


def blocks(tensor: torch.Tensor, name: str, parts: int) -> tuple[torch.Tensor, ...]:
    """The ``parts`` equal blocks of ``tensor`` (parameter ``name`` or a tensor of its shape) that
    tensor parallelism's ranks would hold, in rank order: views, so writing to one writes the
    tensor."""
    problem = split_problem(name, tuple(tensor.shape), parts)
    if problem:
        raise ValueError(problem)
    return tensor.chunk(parts, dim=split_dim(name))


def tp_problem(mc: ModelConfig, tp: int) -> str | None:
    """Why ``tp`` ranks cannot split model ``mc`` by this rule (whole heads), naming the fix; or
    None."""
    if tp == 1:
        return None
    if mc.n_heads % tp or mc.n_kv_heads % tp or mc.d_ff % tp:
        fits = math.gcd(mc.n_heads, mc.n_kv_heads, mc.d_ff)
        return (
            f"tp={tp} splits the attention by whole heads and the MLP by d_ff, and the model's "
            f"{mc.n_heads} query heads, {mc.n_kv_heads} key/value heads and d_ff={mc.d_ff} do "
            f"not all split evenly; use a tp that divides {fits}"
        )
    if mc.moe_experts:
        return (
            f"tp={tp}: mixture-of-experts blocks (moe_experts={mc.moe_experts}) are not split "
            "over tensor-parallel ranks yet (expert parallelism, issue 40); set tp=1 or "
            "moe_experts=0"
        )
    return None


def parallelize_stage(stage: Stage, mesh: DeviceMesh) -> None:
    """Split every block of ``stage`` over the one-dimensional tensor-parallel ``mesh``, in
    place, by :func:`split_of`'s rule: the column-parallel weights become DTensors sharded by
    rows of ``weight`` (output features), the row-parallel ones by its columns (input features);
    the rest stays replicated. Every rank of ``mesh`` must hold the same stage with the same
    weights."""
    plan = {
        name: _STYLE[split]()
        for name, module in stage.named_modules()
        if isinstance(module, nn.Linear) and (split := split_of(f"{name}.weight")) is not None
    }
    parallelize_module(stage, mesh, plan)
