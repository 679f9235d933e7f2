"""Time to target: how long each run trains before it reaches its baseline's final quality.

The target is the synchronous baseline's mean final validation loss. A run's time to target is
the training time (``train_time_s``: evaluations excluded) at which its validation loss first
falls to the target, interpolated linearly between evaluation points. The baseline's own time is
its full training time, since it reaches that quality (on average) at its last step.

A delayed run that never reaches the target may still be worth its speed at the quality it does
reach: the reverse comparison times the baseline to the delayed group's own final loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from nobubble.reporting.groups import Comparison, Group, Stat
from nobubble.reporting.penalty import first_reach
from nobubble.reporting.runs import EvalPoint


@dataclass(frozen=True)
class TargetRow:
    group: Group
    target: float
    time: Stat | None  # over the runs that reached the target; None if none did
    reached: int
    speedup: float | None  # baseline time / this time


@dataclass(frozen=True)
class ReverseRow:
    """How long the baseline needs to reach a delayed group's final loss."""

    group: Group  # the delayed group
    baseline: Group
    target: float  # its mean final validation loss
    own_time: Stat  # its full training time
    baseline_time: Stat | None  # over the baseline runs that reached the target
    speedup: float | None  # baseline time / own time

    @property
    def reached(self) -> int:
        """Baseline runs that reached the target."""
        return self.baseline_time.n if self.baseline_time else 0


def time_to_reach(evals: Sequence[EvalPoint], target: float) -> float | None:
    """Interpolated training time at which the validation loss first reaches ``target``."""
    return first_reach([(point.train_time_s, point.val_loss) for point in evals], target)


def times_to_reach(group: Group, target: float) -> Stat | None:
    """Time to ``target`` over the group's runs that reach it; None if none does."""
    times = [t for run in group.runs if (t := time_to_reach(run.evals, target)) is not None]
    return Stat.of(times) if times else None


def _ratio(numerator: Stat | None, denominator: Stat | None) -> float | None:
    if numerator is None or denominator is None or denominator.mean <= 0:
        return None
    return numerator.mean / denominator.mean


def _row(group: Group, target: float, baseline_time: Stat | None) -> TargetRow:
    stat = times_to_reach(group, target)
    reached = stat.n if stat else 0
    return TargetRow(group, target, stat, reached, _ratio(baseline_time, stat))


def target_rows(rows: Sequence[Comparison]) -> list[TargetRow]:
    """For every baseline: its own row, then a row per group compared with it."""
    out: list[TargetRow] = []
    baselines: list[Group] = []
    for row in rows:
        baseline = row.baseline
        if baseline is None or not math.isfinite(baseline.loss.mean):  # diverged: no target
            continue
        if all(baseline is not b for b in baselines):
            baselines.append(baseline)
    for baseline in baselines:
        target = baseline.loss.mean
        own = _final_times(baseline)
        out.append(TargetRow(baseline, target, own, len(baseline.runs), 1.0))
        out += [_row(r.group, target, own) for r in rows if r.baseline is baseline]
    return out


def _final_times(group: Group) -> Stat:
    return Stat.of([run.evals[-1].train_time_s for run in group.runs])


def reverse_rows(rows: Sequence[Comparison]) -> list[ReverseRow]:
    """For every delayed group: its final loss, its time, and the baseline's time to that loss."""
    out = []
    for row in rows:
        if row.baseline is None or not math.isfinite(row.group.loss.mean + row.baseline.loss.mean):
            continue  # a diverged side
        target = row.group.loss.mean
        own = _final_times(row.group)
        base = times_to_reach(row.baseline, target)
        out.append(ReverseRow(row.group, row.baseline, target, own, base, _ratio(base, own)))
    return out
