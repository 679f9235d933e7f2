"""Tensor parallelism inside a stage: which matrices of a block split by columns, which by rows.

Megatron's rule, applied with torch's tensor-parallel API (``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel`` on the stage's ``tp`` device mesh): attention's q, k
and v are split by output features (column-parallel: each tp rank computes ``n_heads / tp``
query heads and ``n_kv_heads / tp`` key/value heads, whole heads, so rotary embedding and
attention run on local heads), its output projection by input features (row-parallel: the
partial outputs are summed by one all-reduce); the MLP's gate and up column-parallel, its down
row-parallel (one all-reduce). The norms, the embedding and the head are replicated: every tp
rank holds them whole and computes the same values (no vocabulary-parallel head yet).

This module is the one home of that rule (:data:`COLUMN`, :data:`ROW`) and of what a model
needs for ``tp`` ranks to split it (:func:`tp_problem`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from nobubble.model.presets import ModelConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from nobubble.model.layers import Stage

COLUMN = ("attn.wq", "attn.wk", "attn.wv", "mlp.w_gate", "mlp.w_up")  # split by output features
ROW = ("attn.wo", "mlp.w_down")  # split by input features, summed by an all-reduce


def tp_problem(mc: ModelConfig, tp: int) -> str | None:
    """Why ``tp`` ranks cannot split model ``mc`` by :data:`COLUMN` / :data:`ROW`, naming the
    fix; or None."""
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
    place: the :data:`COLUMN` weights become DTensors sharded by rows of ``weight`` (output
    features), the :data:`ROW` ones by its columns (input features); the rest stays replicated.
    Every rank of ``mesh`` must hold the same stage with the same weights."""
    plan = {
        **{f"blocks.{i}.{name}": ColwiseParallel() for i in stage.blocks for name in COLUMN},
        **{f"blocks.{i}.{name}": RowwiseParallel() for i in stage.blocks for name in ROW},
    }
    parallelize_module(stage, mesh, plan)
