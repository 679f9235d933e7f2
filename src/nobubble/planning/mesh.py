"""Where a plan's GPUs sit: the mesh pp × dp × tp, and the splits inside a stage.

The order is torchtitan's and Megatron's: the pipeline outermost, then the data-parallel
replicas, tensor parallelism innermost, so that global rank ``(pp·dp_degree + dp)·tp_degree + tp``
(:func:`nobubble.layout.global_rank`, the order the pipeline runtime's layout uses)
puts a tensor-parallel group on consecutive GPUs, inside one node, where its all-reduces (one
after every attention and every MLP) run on the node's links. Expert parallelism borrows its
ranks from the data-parallel dimension (as torchtitan does): ``ep`` consecutive replicas of a
stage each hold 1/ep of every MoE block's experts and exchange tokens by all-to-all; an ep group
is ``ep`` ranks ``tp`` apart, so it sits inside one node when ``ep·tp`` divides the node's GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nobubble.model.presets import ModelConfig


@dataclass(frozen=True)
class Splits:
    """The splits inside a pipeline stage: ``tp`` ranks share each of its matrices (Megatron
    style, with sequence parallelism), ``ep`` data-parallel replicas share each MoE block's
    experts; ``gpus_per_node`` GPUs share a node's links."""

    tp: int = 1
    ep: int = 1
    gpus_per_node: int = 8

    def problem(self, dp: int, mc: ModelConfig) -> str | None:
        """Why these splits cannot run with ``dp`` replicas of model ``mc``, naming the fix; or
        None."""
        if self.tp > self.gpus_per_node or self.gpus_per_node % self.tp:
            return (
                f"--tp {self.tp} with --gpus-per-node {self.gpus_per_node}: a tensor-parallel "
                "group must sit inside one node (it all-reduces after every attention and MLP); "
                f"use a --tp that divides {self.gpus_per_node}"
            )
        if mc.n_heads % self.tp or mc.n_kv_heads % self.tp:
            return (
                f"--tp {self.tp}: the attention is split by heads, and {mc.n_heads} query and "
                f"{mc.n_kv_heads} key/value heads do not split evenly; use a --tp that divides "
                f"{math.gcd(mc.n_heads, mc.n_kv_heads)}"
            )
        if self.ep == 1:
            return None
        experts = mc.moe_experts
        if experts == 0:
            return f"--ep {self.ep} splits MoE experts and this model has none; use --ep 1"
        if dp % self.ep or experts % self.ep:
            return (
                f"--ep {self.ep}: expert parallelism borrows its ranks from the data-parallel "
                f"replicas and splits each MoE block's {experts} experts evenly, so it must "
                f"divide both --dp ({dp}) and {experts}; use an --ep that does, or a larger --dp"
            )
        return None

    @property
    def ep_in_node(self) -> bool:
        """Whether every expert-parallel group (``ep`` ranks, ``tp`` apart) sits inside one
        node; if not, its all-to-all runs on the link between nodes. A group starts at a
        multiple of ``ep·tp`` (ep divides dp), so it crosses no node's edge exactly when
        ``ep·tp`` divides the node's GPUs."""
        return self.gpus_per_node % (self.ep * self.tp) == 0


def gpus_problem(stages: int, dp: int, tp: int, gpus: int) -> str | None:
    """Why a plan of ``stages`` × ``dp`` × ``tp`` GPUs does not use ``gpus`` GPUs, naming the
    ``--dp`` that would; or None. ``--gpus`` checks the plan, it does not change it."""
    used = stages * dp * tp
    if used == gpus:
        return None
    per_replica = stages * tp
    fix = (
        f"use --dp {gpus // per_replica}"
        if gpus % per_replica == 0
        else f"--gpus must be a multiple of --stages x --tp = {per_replica}"
    )
    return (
        f"--gpus {gpus}: the plan uses --stages {stages} x --dp {dp} x --tp {tp} = {used} GPUs; "
        f"{fix}"
    )
