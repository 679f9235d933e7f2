"""The pipelined evaluation: the validation batches forwarded through the stages at their newest
weights, one microbatch at a time through each process's stages in order, and the totals
gathered on the first stage of every replica. The totals are summed on the device and read once
per evaluation: no microbatch waits for the device."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from nobubble.config import TrainConfig
from nobubble.evaluation import EvalSums, microbatch_sums
from nobubble.layout import ParallelLayout
from nobubble.pipeline.channels import Channel
from nobubble.pipeline.comm import Messenger
from nobubble.pipeline.held_stage import HeldStage
from nobubble.pipeline.replicas import replica_rows
from nobubble.stage_options import autocast


class PipelinedEvaluation:
    """The evaluations of this process over a run: ``held``, its stages by index;
    ``hidden_shape``, what passes between stages; ``val_batches``, the batches of one
    evaluation. Each evaluation's messages are numbered on from the last one's."""

    def __init__(
        self,
        cfg: TrainConfig,
        layout: ParallelLayout,
        messenger: Messenger,
        device: torch.device,
        held: Mapping[int, HeldStage],
        hidden_shape: tuple[int, ...],
        val_batches: int,
    ) -> None:
        self.cfg, self.layout, self.messenger, self.device = cfg, layout, messenger, device
        self.held, self.hidden_shape, self.val_batches = held, hidden_shape, val_batches
        self.sequence = 0

    def run(self, batches: Sequence[torch.Tensor], token_bytes: torch.Tensor | None) -> EvalSums:
        """The validation totals of ``batches`` on the first stage (elsewhere: what this process
        summed, if anything). Run without autograd (the engine's ``evaluate``)."""
        sums: torch.Tensor | None = None  # the last stage's totals, on the device
        if token_bytes is not None:
            token_bytes = token_bytes.to(self.device)
        micro = [
            replica_rows(micro, self.layout)
            for batch in batches
            for micro in batch.to(self.device).chunk(self.cfg.microbatches)
        ]
        count = self.val_batches * self.cfg.microbatches
        for i in range(count):
            handed: torch.Tensor | None = None  # the output of the stage before, on this process
            for stage, held in self.held.items():
                out = self._forward(held, micro[i][:, :-1] if held.first else handed, i)
                if held.last:
                    terms = microbatch_sums(out, micro[i][:, 1:], token_bytes)
                    sums = terms if sums is None else sums + terms
                elif self.layout.holds(stage + 1):  # the bottom of the V
                    channel = Channel.EVAL_ACTIVATION
                    handed = self.messenger.hand_over(
                        out.float(), channel, self.device, torch.float32
                    )
                else:
                    chunk = self.layout.chunk_of(stage + 1)
                    sequence = self.sequence + i
                    self.messenger.send(
                        out.float(), stage + 1, Channel.EVAL_ACTIVATION, sequence, chunk=chunk
                    )
        self.sequence += count
        totals = self._gather_to_first_stage(sums)
        self.messenger.drain()
        return EvalSums() if totals is None else EvalSums.from_list(totals.tolist())

    def _forward(self, held: HeldStage, x: torch.Tensor | None, i: int) -> torch.Tensor:
        """Stage ``held``'s output of microbatch ``i``: from its input ``x`` (the first stage's
        tokens, or the output of the stage before handed over on this process), or from the
        previous stage's activation, received."""
        if x is None:
            x = self.messenger.recv(
                self.hidden_shape,
                torch.float32,
                self.device,
                held.index - 1,
                Channel.EVAL_ACTIVATION,
                self.sequence + i,
                f"evaluation activation {i}",
                chunk=self.layout.chunk_of(held.index),
            )
        with autocast(self.device, self.cfg.dtype):
            return held.module(x)

    def _gather_to_first_stage(self, sums: torch.Tensor | None) -> torch.Tensor | None:
        """The totals of every replica's share (``sums``: this process's, where it holds the
        last stage), on the first stage of every replica."""
        reduction = self.held[self.layout.stages[-1]].reduction
        if self.layout.is_last_stage and reduction:
            reduction.sum_now(sums, "the evaluation totals of the other replicas")
        if self.layout.same_process(0, self.layout.model_stages - 1):
            return sums  # the head's process is the first stage's (one stage; V's rank 0)
        if self.layout.is_last_stage:
            self.messenger.send(sums, 0, Channel.EVAL_SUMS, self.sequence)
        if self.layout.is_first_stage:
            return self.messenger.recv(
                (4,),
                torch.float64,
                self.device,
                self.layout.model_stages - 1,
                Channel.EVAL_SUMS,
                self.sequence,
                "evaluation totals",
            )
        return sums
