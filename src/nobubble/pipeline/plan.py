"""What a pipeline process runs: its actions of the schedule IR for a segment of steps, made as
they are read (a few ahead of the one running, to post receives early), never a whole segment
up front: a segment of any length starts at once and holds flat memory.

Versions follow the schedule's delays (:mod:`nobubble.schedules.registry`) for the global step,
so a run cut into segments (for evaluations and checkpoints) computes exactly what an uncut run
computes; for a segment that starts the run the IR's own versions are checked against that rule
as each action is planned.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterator, Sequence

from nobubble.config import TrainConfig
from nobubble.layout import ParallelLayout
from nobubble.schedules import (
    Action,
    ActionKind,
    lower_rank,
    rank_actions,
    schedule_spec,
    until_step,
)
from nobubble.versions import gradient_version

RECV_AHEAD = 4  # post a receive this many actions before the action that consumes it


def in_run(action: Action, start: int, delays: Sequence[int], microbatches: int) -> Action:
    """``action`` of a schedule that starts at step 0, placed in a run at step ``start``: its
    global step and microbatch, and the version the delay rule gives (a STEP: the version it
    makes, step + 1; F, B and their messages: the delayed version); an F&B's halves alike."""
    step = action.step + start
    delay = delays[action.stage]
    version = step + 1 if action.kind is ActionKind.STEP else gradient_version(step, delay)
    microbatch = None if action.microbatch is None else action.microbatch + start * microbatches
    paired = None if action.paired is None else in_run(action.paired, start, delays, microbatches)
    return dataclasses.replace(
        action, step=step, microbatch=microbatch, version=version, paired=paired
    )


def segment_actions(
    cfg: TrainConfig, layout: ParallelLayout, start: int, stop: int
) -> Iterator[Action]:
    """The lowered actions of this process (``layout``'s pipeline position) for steps
    [start, stop), with global indices and versions, made as they are read: planning costs a
    step's actions at a time whatever ``stop`` is."""
    # a step is cfg.microbatches microbatches (pipedream: 1, which the config enforces)
    chunks = cfg.chunks
    planned = rank_actions(
        cfg.schedule,
        cfg.stages,
        cfg.microbatches,
        stop - start,
        layout.pp_rank,
        chunks if chunks > 1 else None,
    )
    rank_of = {stage: layout.rank_of(stage) for stage in range(layout.model_stages)}
    delays = schedule_spec(cfg.schedule).delays(layout.model_stages)
    for action in lower_rank(planned, rank_of, layout.model_stages - 1):
        placed = in_run(action, start, delays, cfg.microbatches)
        if start == 0 and placed.version != action.version:
            raise RuntimeError(
                f"schedule IR and delay rule disagree at stage {action.stage}: {action} should "
                f"use version {placed.version}; this is a bug in nobubble"
            )
        yield placed


class ActionWindow:
    """A segment's actions, steps [``start``, ``stop``), read a few ahead of the one running (to
    post receives early); ``stop`` moves earlier when the segment is stopped."""

    def __init__(self, cfg: TrainConfig, layout: ParallelLayout, start: int, stop: int) -> None:
        self.start, self.stop = start, stop
        self.actions = segment_actions(cfg, layout, start, stop)
        self.window: collections.deque[Action] = collections.deque()

    def ahead(self, count: int) -> list[Action]:
        """The next ``count`` actions (fewer at the end), the next one to run first."""
        while len(self.window) < count and (action := next(self.actions, None)) is not None:
            self.window.append(action)
        return list(itertools.islice(self.window, count))

    def peek(self) -> Action | None:
        """The next action to run, or None when the segment is done."""
        return next(iter(self.ahead(1)), None)

    def pop(self) -> None:
        self.window.popleft()

    def stop_at(self, step: int) -> None:
        """Run no action of ``step`` or later: what remains is the cool-down of a segment that
        ends at ``step`` (:func:`nobubble.schedules.until_step`)."""
        ahead = list(self.window)  # a copy: the chain reads it after the window is cleared
        self.actions = until_step(itertools.chain(ahead, self.actions), step)
        self.window.clear()
        self.stop = step
