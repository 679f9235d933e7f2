"""Where in the schedule a process failed: a few columns of the grid ``nobubble schedule`` draws,
around the action it was at, marked, added to the error that ends the run.

The grid is the timing simulator's (forward 1, backward 2 per process, as ``nobubble schedule``
draws by default) of a few steps of the run's schedule around the action's step: the segment
itself when it is that short, else its first or last steps, or, in its middle, steps where the
schedule repeats itself, numbered as this run's. Its cost is bounded whatever the run's length.
"""

from __future__ import annotations

import dataclasses
import math

from nobubble.config import TrainConfig
from nobubble.layout import ParallelLayout
from nobubble.pipeline.comm import PeerFailure
from nobubble.pipeline.plan import in_run
from nobubble.schedules import Action, generate, lower, schedule_spec, simulate
from nobubble.schedules.render_text import MARK, render_excerpt
from nobubble.schedules.timing import SimResult, TimedAction, split_rank_times

MAX_FORWARDS = 20_000  # per picture: (model stages) x microbatches x steps simulated


def context_steps(cfg: TrainConfig) -> int:
    """Steps on either side of an action that the picture simulates: enough that, in the
    middle of a segment, the action's neighbourhood is past the schedule's warm-up (up to about
    (chunks + 1) x stages microbatches, which may span several steps) and before its cool-down,
    where the simulated times repeat from step to step."""
    return 1 + math.ceil(cfg.stages * (cfg.chunks + 1) / cfg.microbatches)


def _window(cfg: TrainConfig, step: int, start: int, stop: int) -> tuple[int, int]:
    """(steps to simulate, the first one's step in the run) for ``step`` of the segment
    [start, stop)."""
    margin = context_steps(cfg)
    steps = min(stop - start, 2 * margin + 1)
    if step - start < margin:
        return steps, start
    if stop - 1 - step < margin:
        return steps, stop - steps
    return steps, step - margin


def _simulated(cfg: TrainConfig, steps: int, first: int) -> SimResult:
    """``steps`` steps of the run's schedule, placed at step ``first`` of the run."""
    chunks = cfg.chunks if cfg.chunks > 1 else None
    actions = generate(cfg.schedule, cfg.stages, cfg.microbatches, steps, chunks)
    result = simulate(
        lower(actions), split_rank_times(1.0, actions), split_rank_times(2.0, actions)
    )
    delays = schedule_spec(cfg.schedule).delays(len(result.stage_weight_versions))
    timeline = [
        [
            TimedAction(in_run(t.action, first, delays, cfg.microbatches), t.start, t.end)
            for t in rank
        ]
        for rank in result.timeline
    ]
    return dataclasses.replace(result, timeline=timeline)


def schedule_around(
    cfg: TrainConfig, layout: ParallelLayout, action: Action, start: int, stop: int
) -> str:
    """The picture of ``action`` of this process (at ``layout``'s pipeline position) in the
    segment of steps [start, stop), with a line that names it."""
    steps, first = _window(cfg, action.step, start, stop)
    head = f"where {layout.name()} stopped: {action} (step {action.step + 1})"
    forwards = layout.model_stages * cfg.microbatches * steps
    if forwards > MAX_FORWARDS:
        return (
            f"{head}; the schedule around it is too large to draw here ({forwards:,} forwards "
            f"to simulate): nobubble schedule --schedule {cfg.schedule} --stages {cfg.stages} "
            f"--microbatches {cfg.microbatches} --steps 3 draws its shape"
        )
    result = _simulated(cfg, steps, first)
    timeline = result.timeline[layout.pp_rank]
    position = next((i for i, t in enumerate(timeline) if t.action == action), None)
    if position is None:  # not an action of the schedule: a bug, whose own error says more
        return f"{head}, an action the schedule does not have"
    excerpt = render_excerpt(result, layout.pp_rank, position)
    return (
        f"{head}, marked {MARK} in the schedule around it as `nobubble schedule` draws it "
        f"(forward 1, backward 2):\n{excerpt}"
    )


def add_schedule(error: Exception, picture: str) -> None:
    """Add ``picture`` to ``error``'s message, keeping its type and text: a peer failure's
    message (the one line a command prints) grows; any other error gets it as a note, which its
    traceback shows."""
    if isinstance(error, PeerFailure) and len(error.args) == 1:
        error.args = (f"{error.args[0]}\n{picture}",)
    else:
        error.add_note(picture)
