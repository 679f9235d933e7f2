"""A STEP's update: applied at once, or, where its gradient is first all-reduced (data-parallel
replicas; the tied weight's two copies), deferred until an action needs the version it makes.

At its STEP a stage starts the all-reduces in the background; the rest of the update (clip,
optimizer step, statistics) waits until a compute action needs the new version or the stage's
next STEP comes, so under 2bw the all-reduce runs behind the next step's compute. With sharded
state (``zero`` > 0) the update is a chain of collectives (:mod:`nobubble.pipeline.sharded_update`),
moved on between actions as its collectives complete (:meth:`Updates.advance`), and finished
alike where its version is needed.

Without all-reduces a STEP waits for nothing either: it queues the gradient's norms and copies
them, with the step's figures, to the host (:class:`~nobubble.pipeline.host.HostCopy`); the clip,
the optimizer step and the statistics follow where the version is needed, after waiting, if at
all, for that copy alone. The STEP action itself never reads a device value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from nobubble.optim.clipping import total_norm
from nobubble.pipeline.held_stage import HeldStage
from nobubble.pipeline.host import HostCopy
from nobubble.pipeline.replicas import PendingReduction
from nobubble.pipeline.sharded_update import ShardedStep
from nobubble.profiling import label
from nobubble.schedules import Action, ActionKind
from nobubble.stage_update import TrainedStage

# an update's outcome: (gradient norm, whether it went ahead, learning rate)
Outcome = tuple[float, bool, float]
# (stage, step, its sums, the gradient's norms where the stage holds a part of it) -> outcome
Update = Callable[[HeldStage, int, torch.Tensor, tuple[float, float | None] | None], Outcome]
# (stage, step, its sums read on the host, the outcome): the step's statistics, reported
Report = Callable[[HeldStage, int, list[float], Outcome], None]


@dataclass
class _PendingUpdate:
    """A STEP whose update waits for its all-reduces (data-parallel, tied or both), or, with
    neither, for its figures and gradient norms on their way to the host."""

    step: int
    sums: torch.Tensor  # HeldStage.step_sums (loss and routing), before any all-reduce
    replicas: PendingReduction | None
    tied: PendingReduction | None
    figures: HostCopy | None = None  # no all-reduce: the sums, then the norms


def gradient_norms(trained: TrainedStage) -> torch.Tensor:
    """The norms the clip of ``trained``'s complete gradient takes
    (:func:`nobubble.stage_update.clip_gradients`), on the device, float64: of the gradient but the
    tied copy's, then (where the stage holds one) of the tied copy's."""
    params = trained.params
    groups = [[p.grad for n, p in params.items() if n != trained.tied and p.grad is not None]]
    if trained.tied is not None:
        groups.append([g for g in [params[trained.tied].grad] if g is not None])
    norms = [total_norm(grads) for grads in groups]
    like = next(iter(params.values()))
    return torch.stack([n.to(like.device, torch.float64) for n in norms])


class Updates:
    """The updates of one segment of this process's stages (``held``, by index): ``update``
    applies one once its gradient is complete, ``report`` reports its statistics.

    ``gathers_statistics``: whether this process gathers every stage's statistics (the first
    stage), which waits for the other stages' reports: it reports a step only where it would
    without sharded state (where the version is needed), never between two actions, which must
    not wait for anything.
    """

    def __init__(
        self,
        held: Mapping[int, HeldStage],
        update: Update,
        report: Report,
        gathers_statistics: bool,
    ) -> None:
        self.held, self.update, self.report = held, update, report
        self.gathers_statistics = gathers_statistics
        # by stage: STEPs awaiting all-reduces, or (sharded state) their chains
        self.pending: dict[int, _PendingUpdate | ShardedStep] = {}
        self.outcomes: dict[int, Outcome] = {}  # by stage: chains' updates not yet reported

    def start(self, held: HeldStage, step: int, sums: torch.Tensor) -> None:
        """The gradient of ``held``'s ``step`` is complete: average it over the replicas and sum
        the tied weight's with the other stage's (in the background), or apply the update now."""
        if held.reduction is None and held.tied is None:
            figures = HostCopy(torch.cat([sums, gradient_norms(held.trained)]))
            self.pending[held.index] = _PendingUpdate(step, sums, None, None, figures)
            return
        # the same order of collectives on every rank: tied first (it spans both groups' ranks)
        tied_copy = [held.trained.params[held.tied_name]] if held.tied else []
        tied = held.tied.start(step, tied_copy, None) if held.tied else None
        if held.shards is not None:
            self.pending[held.index] = held.shards.start(step, sums, tied)
            return
        replicas = None
        if held.reduction is not None:
            replicas = held.reduction.start(step, held.reduced, sums)
        self.pending[held.index] = _PendingUpdate(step, sums, replicas, tied)

    def advance(self) -> None:
        """Move every sharded update's chain on as far as its collectives have completed,
        waiting for nothing (between two actions)."""
        for stage, pending in list(self.pending.items()):
            if not isinstance(pending, ShardedStep):
                continue
            if self._progress(stage, pending, block=False) and not self.gathers_statistics:
                self._reported(stage, pending)

    def _progress(self, stage: int, pending: ShardedStep, block: bool) -> bool:
        held = self.held[stage]

        def update(sums: torch.Tensor, norms: tuple[float, float | None]) -> None:
            self.outcomes[stage] = self.update(held, pending.step, sums, norms)

        return held.shards.progress(pending, update, block)

    def _reported(self, stage: int, pending: ShardedStep) -> None:
        del self.pending[stage]
        self.report(self.held[stage], pending.step, pending.read, self.outcomes.pop(stage))

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
        pending, held = self.pending[stage], self.held[stage]
        with label(f"STEP v{pending.step + 1} update"):
            if isinstance(pending, ShardedStep):
                self._progress(stage, pending, block=True)
                self._reported(stage, pending)
                return
            del self.pending[stage]
            if pending.figures is not None:
                self._apply_read(held, pending)
                return
            sums = pending.sums
            if pending.replicas is not None:
                sums = held.reduction.finish(pending.replicas, held.reduced)
            if pending.tied is not None:
                held.tied.finish(pending.tied, [held.trained.params[held.tied_name]])
            outcome = self.update(held, pending.step, sums, None)
            self.report(held, pending.step, HostCopy(sums).read(), outcome)

    def _apply_read(self, held: HeldStage, pending: _PendingUpdate) -> None:
        """The update of a STEP without all-reduces, from its figures and norms on the host."""
        values, count = pending.figures.read(), len(pending.sums)
        norms = (values[count], values[count + 1] if held.trained.tied is not None else None)
        outcome = self.update(held, pending.step, pending.sums, norms)
        self.report(held, pending.step, values[:count], outcome)
