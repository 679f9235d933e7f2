"""The statistics of a training step: what each STEP reports, and the first stage gathers.

Once every stage a process holds has applied its update of a step, the process sends the first
stage a row per held stage: (loss, gradient norm, skipped, its MoE routing sums), zero-padded to
one width for all. The first stage puts every process's rows in model-stage order and hands the
step's :class:`~nobubble.engine.StepStats` to the training loop. Rows are built, sent and read
as CPU tensors (the control plane's messages), from figures already on the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from nobubble.engine import StepStats
from nobubble.layout import ParallelLayout
from nobubble.model.moe import routing_size, unpack_routing
from nobubble.model.partition import StageSpec
from nobubble.model.presets import ModelConfig
from nobubble.pipeline.channels import Channel
from nobubble.pipeline.comm import HOST, Messenger
from nobubble.stage_update import combined_norm


class StepStatistics:
    """The rows of the steps this process has not finished yet; ``specs``: every model stage's
    partition (the MoE blocks of each), ``micro_per_step``: the microbatches a loss averages."""

    def __init__(
        self,
        layout: ParallelLayout,
        messenger: Messenger,
        mc: ModelConfig,
        specs: Sequence[StageSpec],
        micro_per_step: int,
    ) -> None:
        self.layout, self.messenger = layout, messenger
        self.mc, self.micro_per_step = mc, micro_per_step
        self.moe_blocks = [[i for i in s.blocks if mc.is_moe(i)] for s in specs]
        self.width = 3 + max(len(b) for b in self.moe_blocks) * routing_size(mc)
        self.rows: dict[int, dict[int, torch.Tensor]] = {}  # step -> held stage -> its row

    def add(
        self, stage: int, step: int, sums: list[float], norm: float, ok: bool, last: bool
    ) -> bool:
        """The row of held ``stage`` for ``step``: its update's gradient ``norm`` and whether it
        went ahead (``ok``), the loss (``last``: the stage that holds the head) and routing
        ``sums`` (read on the host already: :mod:`nobubble.pipeline.host`). Whether every stage
        this process holds has now reported ``step``."""
        loss = sums[0] / self.micro_per_step if last else math.nan
        row = torch.zeros(self.width, dtype=torch.float64)
        row[: 2 + len(sums)] = torch.tensor(
            [loss, norm, 0.0 if ok else 1.0, *sums[1:]], dtype=row.dtype
        )
        rows = self.rows.setdefault(step, {})
        rows[stage] = row
        return len(rows) == len(self.layout.stages)

    def report(self, step: int, lr: float, on_step: Callable[[StepStats], None]) -> None:
        """Send this process's rows of ``step`` to the first stage, or, there, gather everyone's
        and hand them to ``on_step``."""
        rows = self.rows.pop(step)
        mine = torch.stack([rows[stage] for stage in self.layout.stages])
        if self.layout.is_first_stage:
            on_step(self._gather(step, mine, lr))
        else:
            self.messenger.send(mine, 0, Channel.STATS, step)

    def _gather(self, step: int, mine: torch.Tensor, lr: float) -> StepStats:
        """The first stage: every stage's statistics of ``step``."""
        layout = self.layout
        by_rank = [mine]
        for peer in range(1, layout.pp):  # the process of model stage `peer` (chunk 0)
            by_rank.append(
                self.messenger.recv(
                    (layout.chunks, self.width),
                    torch.float64,
                    HOST,
                    peer,
                    Channel.STATS,
                    step,
                    f"the statistics of step {step}",
                )
            )
        # a model stage's row: its chunk's in its process's report, placed by the layout (stage
        # c·P + r on rank r in a loop; under V the last stage's is rank 0's second row)
        reports = [
            by_rank[layout.position_of(s)][layout.chunk_of(s)] for s in range(layout.model_stages)
        ]
        routing = {}
        for stage, row in enumerate(reports):
            routing.update(unpack_routing(row[3:], self.moe_blocks[stage], self.mc))
        figures = [row[:3].tolist() for row in reports]  # (loss, norm, skipped) per stage
        return StepStats(
            step=step,
            loss=figures[-1][0],
            grad_norm=combined_norm(norm for _, norm, _ in figures),
            lr=lr,
            routing=routing,
            skipped_stages=[s for s, (_, _, skipped) in enumerate(figures) if skipped],
        )
