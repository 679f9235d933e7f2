"""One model stage a pipeline process holds: its slice of the model and everything per stage.

A process holds one stage, or several with an interleaved schedule (``chunks``; the layout says
which). Each held stage keeps what the one-process engine keeps per stage, a
:class:`nobubble.stage_update.TrainedStage` (weight versions, where its steps run, its optimizer and
delay correction, the order of its update), so both backends compute the same; besides it, its
module, the split of its backward (zero-bubble) and the all-reduces of its gradient
(data-parallel replicas; the tied weight's two copies).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from nobubble.config import TrainConfig
from nobubble.layout import ParallelLayout
from nobubble.model.layers import Stage
from nobubble.model.moe import pack_routing, unpack_routing
from nobubble.model.partition import TIED_WEIGHT, StageSpec, holds_tied_copy
from nobubble.model.presets import ModelConfig
from nobubble.model.tensor_split import parallelize_stage
from nobubble.pipeline.replicas import ReplicaReduction
from nobubble.pipeline.sharded_update import ShardedUpdate, StageGroups
from nobubble.pipeline.split_backward import SplitBackward
from nobubble.schedules.registry import schedule_spec
from nobubble.stage_options import apply_stage_options
from nobubble.stage_update import TrainedStage
from nobubble.zero_partition import ShardPlan


class HeldStage:
    """Model stage ``index`` (partitioned as ``spec``) on this process. ``replicas``: the process
    group of its data-parallel replicas (None without); ``tied``: the group of the first and last
    stages' processes (None unless the head is tied to the embedding over several stages);
    ``shard_groups``: with sharded state (``zero`` > 0), the groups of this model stage's
    replicas that its update's chain and its checkpoints run over
    (:mod:`nobubble.pipeline.sharded_update`); ``tp_mesh``: the mesh of the stage's
    tensor-parallel ranks, over which its blocks are split (:mod:`nobubble.model.tensor_split`;
    None without)."""

    def __init__(
        self,
        index: int,
        spec: StageSpec,
        cfg: TrainConfig,
        mc: ModelConfig,
        device: torch.device,
        layout: ParallelLayout,
        replicas: dist.ProcessGroup | None,
        tied: dist.ProcessGroup | None,
        split: bool,
        shard_groups: StageGroups | None = None,
        tp_mesh: DeviceMesh | None = None,
    ) -> None:
        self.index, self.spec, self.cfg, self.device = index, spec, cfg, device
        self.first, self.last = spec.has_embed, spec.has_head
        self.module = Stage(mc, spec, cfg.seed).to(device)
        if tp_mesh is not None:  # its blocks' matrices split over the stage's tp ranks
            parallelize_stage(self.module, tp_mesh)
        apply_stage_options(self.module, cfg, device)
        self.split = SplitBackward(self.module) if split else None  # zero-bubble I/W
        params = dict(self.module.named_parameters())
        delay = schedule_spec(cfg.schedule).delays(layout.model_stages)[index]
        # tied embeddings split over stages: this stage's copy, summed with the other's
        self.tied_name = TIED_WEIGHT if holds_tied_copy(mc, spec) else None
        trainable = {n: p for n, p in params.items() if p.requires_grad}
        plan = None
        self.shard_groups = shard_groups
        if shard_groups is not None:  # zero > 0: this replica updates its part
            plan = ShardPlan.of(
                trainable, cfg.optim, cfg.momentum, layout.dp, layout.replica, self.tied_name
            )
        self.trained = TrainedStage(
            index, params, delay, cfg, self.tied_name, self.first, shard=plan
        )
        name = layout.name(index)
        self.reduction = (
            ReplicaReduction(replicas, layout.dp, cfg.p2p_timeout_s, name)
            if layout.dp > 1
            else None
        )
        self.tied = (  # sum over first + last, mean over replicas: the dp divisor
            ReplicaReduction(
                tied,
                layout.dp,
                cfg.p2p_timeout_s,
                name,
                "the all-reduce of the tied weight with the other stages that hold a copy",
                "tied all-reduce",
            )
            if self.tied_name and tied is not None
            else None
        )
        # the dp bucket: what an optimizer steps, but the tied copy (reduced on its own)
        self.reduced = [p for n, p in trainable.items() if n != self.tied_name]
        self.shards = (
            ShardedUpdate(
                shard_groups.chain,
                plan,
                self.trained,
                [n for n in trainable if n != self.tied_name],
                self.tied,
                cfg.zero,
                cfg.p2p_timeout_s,
                name,
            )
            if plan is not None
            else None
        )
        self.mc, self.moe_blocks = mc, [i for i in spec.blocks if mc.is_moe(i)]

    def step_sums(self, loss: torch.Tensor | None) -> torch.Tensor:
        """What a STEP averages over the replicas besides the gradient, as one float64 vector:
        the step's loss sum (0 on a stage without the head), then its MoE routing sums."""
        first = loss.reshape(1) if loss is not None else torch.zeros(1, dtype=torch.float64)
        routing = pack_routing(self.module.take_routing())
        return torch.cat([first.to(self.device)] + ([] if routing is None else [routing]))

    def apply_step(
        self, step: int, sums: torch.Tensor, norms: tuple[float, float | None] | None = None
    ) -> tuple[float, bool, float]:
        """The rest of the STEP action, once the gradient is complete (and averaged over the
        replicas, with the ``sums`` of :meth:`step_sums`): the stage's update
        (:meth:`nobubble.stage_update.TrainedStage.apply`) with the step's routing; ``norms``: the
        gradient's norms where this replica holds a part of it (sharded state). Returns
        (gradient norm, whether the update went ahead in full, learning rate)."""
        routing = unpack_routing(sums[1:], self.moe_blocks, self.mc)
        return self.trained.apply(step, routing, self.mc.moe_bias_rate, norms)

    def param_mb(self) -> float:
        """The MiB of this process's parameters (of a tensor-parallel shard, its own part)."""
        held = [p.to_local() if isinstance(p, DTensor) else p for p in self.trained.params.values()]
        return sum(p.numel() * p.element_size() for p in held) / 2**20
