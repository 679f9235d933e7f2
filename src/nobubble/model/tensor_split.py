"""How tensor parallelism splits a block's matrices (Megatron's rule): the one home of it.

A column-parallel matrix (attention's q, k, v; the MLP's gate and up) is split along its output
dimension: each of ``parts`` ranks holds a slab of its rows (``nn.Linear`` keeps a weight as
``(out, in)``), computes a slice of the output features, and needs no communication until the
row-parallel matrix after it (attention's output, the MLP's down), split along its input
dimension (a slab of columns), sums the partial outputs. A shared expert's SwiGLU splits as the
dense MLP; the routed experts' 3-D tensors and the router are not split here (expert parallelism
holds whole experts).

Muon's blockwise emulation (``muon_blocks``, :class:`nobubble.optim.muon.Muon`) reads this rule,
and so will a tensor-parallel runtime. Blocks of k and v split by rows need not hold whole heads
(``n_kv_heads * head_dim / parts`` rows): a block may be a fraction of a head, which an
orthogonalization is free to be (a tensor-parallel runtime would split by heads).
"""

from __future__ import annotations

from enum import StrEnum

import torch


class Split(StrEnum):
    COLUMN = "column"  # along the output dimension: dim 0 of an (out, in) weight
    ROW = "row"  # along the input dimension: dim 1


# the last two parts of a block matrix's parameter name, and how tensor parallelism splits it
_RULES: dict[str, Split] = {
    "wq.weight": Split.COLUMN,
    "wk.weight": Split.COLUMN,
    "wv.weight": Split.COLUMN,
    "wo.weight": Split.ROW,
    "w_gate.weight": Split.COLUMN,
    "w_up.weight": Split.COLUMN,
    "w_down.weight": Split.ROW,
}
_DIM: dict[Split, int] = {Split.COLUMN: 0, Split.ROW: 1}


def split_of(name: str) -> Split | None:
    """How tensor parallelism splits parameter ``name`` (a full name such as
    ``blocks.3.attn.wq.weight``), or None for one it does not split by this rule."""
    if not name.startswith("blocks."):
        return None
    return _RULES.get(".".join(name.split(".")[-2:]))


def split_dim(name: str) -> int:
    """The dimension of 2-D parameter ``name`` that tensor parallelism splits."""
    split = split_of(name)
    if split is None:
        raise ValueError(
            f"{name} has no tensor-parallel split rule (nobubble/model/tensor_split.py knows "
            f"{', '.join(sorted(_RULES))} inside blocks); add one, or use muon_blocks=1"
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
