"""Where a simulated step settles into a pattern that repeats, so that longer steps need no
simulation.

In the middle of a long step every schedule runs the same few actions per microbatch on every
rank, and the simulator's times are a deterministic function of the times before them. Once the
start times of every action of ``period`` consecutive microbatches equal those of the
``period`` before them plus a shift (one per kind of action and stage, all equal but in GPipe,
whose backwards run at another pace than its forwards), and the actions that depend on them are
the same (the middle of the step), everything up to the step's cool-down repeats with those
shifts: a step of M + k·period microbatches grows by k times what one period adds, once M is
past where the pattern settled. The period is often not 1: with uneven stages and slow links a
pipeline of P stages can repeat every P, or every P-1, microbatches; so a pattern counts only
where it holds over the whole second half of the step's middle, ``repeats`` times at least.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nobubble.schedules.timing import SimResult


@dataclass(frozen=True)
class Steady:
    period: int  # microbatches after which the timeline repeats
    settled: int  # the first microbatch from which it does


def _starts(result: SimResult) -> list[list[float]]:
    """Per microbatch of a one-step timeline: the start of each of its compute actions, in one
    order (kind, stage) for all."""
    starts: dict[tuple[str, int], dict[int, float]] = {}
    for rank in result.timeline:
        for timed in rank:
            if timed.action.kind.is_compute:
                for a in timed.action.parts:  # an FB's halves start together
                    starts.setdefault((a.kind.value, a.stage), {})[a.microbatch] = timed.start
    count = 1 + max(max(by_microbatch) for by_microbatch in starts.values())
    # the kinds every microbatch runs at a stage (DualPipeV runs some backwards whole, some split)
    keys = sorted(key for key, by_microbatch in starts.items() if len(by_microbatch) == count)
    return [[starts[key][i] for key in keys] for i in range(count)]


def _settled(rows: list[list[float]], period: int, end: int, tol: float) -> int:
    """The first row from which every row before ``end`` is the row ``period`` before it plus
    the same shifts (one per action: GPipe's backwards move on at another pace than its
    forwards)."""
    shifts = [a - b for a, b in zip(rows[end - 1], rows[end - 1 - period], strict=True)]
    first = end
    while first - 1 - period >= 0:
        now, before = rows[first - 1], rows[first - 1 - period]
        if any(abs(a - b - d) > tol for a, b, d in zip(now, before, shifts, strict=True)):
            break
        first -= 1
    return first - period


def steady_state(result: SimResult, cool_down: int, repeats: int = 3) -> Steady | None:
    """The shortest period of a one-step timeline's microbatches and where it settles, holding
    over the second half of the microbatches before the last ``cool_down`` (whose actions the
    step's end reorders) and seen ``repeats`` times; None when the timeline shows none."""
    rows = _starts(result)
    end = len(rows) - cool_down
    tol = 1e-9 * max(result.makespan, math.ulp(1.0))
    for period in range(1, end // (2 * (repeats + 1)) + 1):
        settled = _settled(rows, period, end, tol)
        if settled <= end // 2:
            return Steady(period, settled)
    return None
