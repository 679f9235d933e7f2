"""A STEP's update: applied at once, or, where its gradient is first all-reduced (data-parallel
replicas; the tied weight's two copies), deferred until an action needs the version it makes.

At its STEP a stage starts the all-reduces in the background; the rest of the update (clip,
optimizer step, statistics) waits until a compute action needs the new version or the stage's
next STEP comes, so under 2bw the all-reduce runs behind the next step's compute.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from nobubble.pipeline.held_stage import HeldStage
from nobubble.pipeline.replicas import PendingReduction
from nobubble.profiling import label
from nobubble.schedules import Action, ActionKind

Apply = Callable[[HeldStage, int, torch.Tensor], None]  # (stage, step, its sums): the update


@dataclass
class _PendingUpdate:
    """A STEP whose update waits for its all-reduces (data-parallel, tied or both)."""

    step: int
    sums: torch.Tensor  # HeldStage.step_sums (loss and routing), before any all-reduce
    replicas: PendingReduction | None
    tied: PendingReduction | None


class Updates:
    """The updates of one segment of this process's stages (``held``, by index), applied by
    ``apply`` once their gradients are complete."""

    def __init__(self, held: Mapping[int, HeldStage], apply: Apply) -> None:
        self.held, self.apply = held, apply
        self.pending: dict[int, _PendingUpdate] = {}  # by stage: STEPs awaiting all-reduces

    def start(self, held: HeldStage, step: int, sums: torch.Tensor) -> None:
        """The gradient of ``held``'s ``step`` is complete: average it over the replicas and sum
        the tied weight's with the other stage's (in the background), or apply the update now."""
        if held.reduction is None and held.tied is None:
            self.apply(held, step, sums)
            return
        # the same order of collectives on every rank: tied first (it spans both groups' ranks)
        tied_copy = [held.trained.params[held.tied_name]] if held.tied else []
        tied = held.tied.start(step, tied_copy, None) if held.tied else None
        replicas = None
        if held.reduction is not None:
            replicas = held.reduction.start(step, held.reduced, sums)
        self.pending[held.index] = _PendingUpdate(step, sums, replicas, tied)

    def finish_before(self, action: Action) -> None:
        """Finish pending updates before ``action`` where it needs the version they make (or is
        the next STEP of their stage, which reuses the gradients' place).

        A process's stages move to a new version together: a compute action on any of them that
        needs a newer version finishes every pending update. An interleaved process would
        otherwise keep its last stage's update (and so its step's statistics, which the first
        stage waits for) pending behind forwards that wait for the first stage.
        """
        if not (action.kind.is_compute or action.kind is ActionKind.STEP):
            return
        for stage, pending in list(self.pending.items()):
            next_step = action.kind is ActionKind.STEP and action.stage == stage
            if next_step or (action.kind.is_compute and action.version > pending.step):
                self.finish(stage)

    def finish_all(self) -> None:
        """Finish every pending update (the end of a segment), in the order they started."""
        for stage in list(self.pending):
            self.finish(stage)

    def finish(self, stage: int) -> None:
        pending, held = self.pending.pop(stage), self.held[stage]
        with label(f"STEP v{pending.step + 1} update"):
            sums = pending.sums
            if pending.replicas is not None:
                sums = held.reduction.finish(pending.replicas, held.reduced)
            if pending.tied is not None:
                held.tied.finish(pending.tied, [held.trained.params[held.tied_name]])
            self.apply(held, pending.step, sums)
