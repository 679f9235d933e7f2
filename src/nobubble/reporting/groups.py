"""Runs grouped over seeds, and each delayed group compared with its synchronous baseline.

A group is every run with the same settings but the seed. Groups that differ only in how the
pipeline runs (schedule, delay corrections, stages, microbatches, partition) are one
*comparison*: the synchronous group without a correction among them is the baseline of the
others, and the delay gap of a group is its mean final validation loss minus the baseline's. A
group with a correction is also compared with the same group without it: the share of that
plain run's gap the correction closes.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nobubble.config import SECTIONS, TrainConfig
from nobubble.config.fields import FREE
from nobubble.corrections.registry import chosen
from nobubble.reporting.runs import Run
from nobubble.schedules.registry import SCHEDULE_NAMES, SYNCHRONOUS_SCHEDULES

# The keys that choose a delay correction or set one's strength (dropped to find the plain run):
# the correction section. The keys of how the pipeline runs (dropped to find the synchronous
# baseline): those and the parallel section's, but what changes no result (p2p_timeout_s, ...).
CORRECTION_KEYS = tuple(f.name for f in dataclasses.fields(SECTIONS["correction"]))
PIPELINE_KEYS = tuple(
    f.name
    for section in ("parallel", "correction")
    for f in dataclasses.fields(SECTIONS[section])
    if f.metadata["resume"] != FREE
)
SCHEDULE_ORDER = SCHEDULE_NAMES  # sync first, then the pipeline schedules in the registry's order
# A gap smaller than this many standard errors is treated as seed noise.
CLEAR_GAP_SE = 2.0


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation over seeds (std is nan for a single seed)."""

    mean: float
    std: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        """An infinite (diverged) value makes the mean infinite and the std unknown."""
        if not all(map(math.isfinite, values)):
            return cls(math.inf, math.nan, len(values))
        std = statistics.stdev(values) if len(values) > 1 else math.nan
        return cls(statistics.fmean(values), std, len(values))

    @property
    def sem(self) -> float:
        """Standard error of the mean; 0 for a single seed (no noise estimate)."""
        return self.std / math.sqrt(self.n) if self.n > 1 else 0.0


@dataclass(frozen=True)
class Group:
    settings: dict[str, Any]  # without the seed
    runs: tuple[Run, ...]

    @property
    def optim(self) -> str:
        return self.settings["optim"]

    @property
    def corrections(self) -> tuple[str, ...]:
        """The delay corrections the group's runs use (``ef=true`` counts as ``ef``)."""
        return corrections_of(self.settings)

    @property
    def is_baseline(self) -> bool:
        return self.settings["schedule"] in SYNCHRONOUS_SCHEDULES and not self.corrections

    @property
    def setup(self) -> str:
        """``sync``, ``2bw``, ``2bw+EF``, ``2bw+nesterov``, ``pipedream+spike``... (how the
        pipeline runs)."""
        return "+".join([self.settings["schedule"], *(_label(c) for c in self.corrections)])

    @property
    def loss(self) -> Stat:
        return Stat.of([r.final_loss for r in self.runs])

    @property
    def bpb(self) -> Stat:
        return Stat.of([r.final_bpb for r in self.runs])

    @property
    def finished(self) -> tuple[Run, ...]:
        """The runs that did not diverge."""
        return tuple(r for r in self.runs if not r.diverged)

    @property
    def diverged(self) -> int:
        return len(self.runs) - len(self.finished)

    @property
    def curve(self) -> dict[int, float]:
        """Mean validation loss per evaluation step, over steps every seed was evaluated at."""
        losses: dict[int, list[float]] = {}
        for run in self.runs:
            for point in run.evals:
                losses.setdefault(point.step, []).append(point.val_loss)
        return {
            step: statistics.fmean(values)
            for step, values in sorted(losses.items())
            if len(values) == len(self.runs)
        }

    def without(self, *keys: str) -> dict[str, Any]:
        return {k: v for k, v in self.settings.items() if k not in keys}


def corrections_of(settings: dict[str, Any]) -> tuple[str, ...]:
    return chosen(TrainConfig(correction=settings["correction"], ef=settings["ef"]))


def _label(correction: str) -> str:
    return "EF" if correction == "ef" else correction


def group_runs(runs: Sequence[Run]) -> list[Group]:
    """Group over seeds, ordered by optimizer, schedule, corrections, then the other settings."""
    buckets: dict[str, list[Run]] = {}
    settings: dict[str, dict[str, Any]] = {}
    for run in runs:
        key_settings = {k: v for k, v in run.settings.items() if k != "seed"}
        key = repr(sorted(key_settings.items()))
        buckets.setdefault(key, []).append(run)
        settings[key] = key_settings
    groups = [
        Group(settings[key], tuple(sorted(rs, key=lambda r: r.settings["seed"])))
        for key, rs in buckets.items()
    ]
    return sorted(groups, key=_order)


def _order(group: Group) -> tuple:
    s = group.settings
    rank = SCHEDULE_ORDER.index(s["schedule"]) if s["schedule"] in SCHEDULE_ORDER else 99
    return (s["optim"], rank, group.corrections, s["stages"], repr(sorted(s.items())))


def varied_keys(groups: Sequence[Group], exclude: Sequence[str] = ()) -> list[str]:
    """Setting keys whose value is not the same in every group (in config order)."""
    if not groups:
        return []
    keys = groups[0].settings
    return [
        k for k in keys if k not in exclude and len({repr(g.settings.get(k)) for g in groups}) > 1
    ]


@dataclass(frozen=True)
class Comparison:
    """One group's row: its delay gap to the synchronous baseline and, for a group with a
    correction, the share of the plain delayed group's gap the correction closes."""

    group: Group
    baseline: Group | None
    gap: float | None  # mean final val loss minus the baseline's
    gap_se: float | None  # standard error of that difference
    closed: float | None = None  # (gap of 2bw - gap of 2bw+correction) / gap of 2bw
    closed_unclear: bool = False  # a correction whose plain run has no clear gap to close

    @property
    def gap_is_clear(self) -> bool:
        return self.gap is not None and self.gap > CLEAR_GAP_SE * (self.gap_se or 0.0)

    def gap_during_training(self, fractions: Sequence[float]) -> list[tuple[int, float]] | None:
        """(step, mean gap) at the evaluation nearest to each fraction of training.

        Only steps where both this group and its baseline were evaluated count; the first
        evaluation, before any update, is left out (the gap there is zero by construction).
        None without a baseline, or when a seed of either diverged (its gap is infinite).
        """
        if self.baseline is None or self.group.diverged or self.baseline.diverged:
            return None
        mine, base = self.group.curve, self.baseline.curve
        steps = [s for s in mine if s in base and s > 0]
        if not steps:
            return None
        last = steps[-1]
        picked = [min(steps, key=lambda s, f=f: (abs(s - f * last), s)) for f in fractions]
        return [(s, mine[s] - base[s]) for s in picked]


def find_baseline(group: Group, groups: Sequence[Group]) -> Group | None:
    """The synchronous group with the same non-pipeline settings (the same shape preferred)."""
    if group.is_baseline:
        return None
    key = group.without(*PIPELINE_KEYS)
    candidates = [g for g in groups if g.is_baseline and g.without(*PIPELINE_KEYS) == key]
    if len(candidates) > 1:
        shape = ("stages", "dp", "microbatches", "stage_layers")
        candidates = [
            g for g in candidates if all(g.settings[k] == group.settings[k] for k in shape)
        ]
    return candidates[0] if len(candidates) == 1 else None


def _with_gap(group: Group, groups: Sequence[Group]) -> Comparison:
    baseline = find_baseline(group, groups)
    if baseline is None:
        return Comparison(group, None, None, None)
    a, b = group.loss, baseline.loss
    return Comparison(group, baseline, a.mean - b.mean, math.hypot(a.sem, b.sem))


def _with_closed_share(row: Comparison, rows: Sequence[Comparison]) -> Comparison:
    """A correction's closed share needs the same group without any correction to have a clear
    (positive) gap."""
    if not row.group.corrections or row.gap is None:
        return row
    plain_settings = row.group.without(*CORRECTION_KEYS)
    plain = next(
        (
            r
            for r in rows
            if not r.group.corrections and r.group.without(*CORRECTION_KEYS) == plain_settings
        ),
        None,
    )
    if plain is None or plain.gap is None or not math.isfinite(plain.gap + row.gap):
        return row  # no share of a gap that is infinite (a diverged group) or unknown
    if not plain.gap_is_clear:
        return dataclasses.replace(row, closed_unclear=True)
    return dataclasses.replace(row, closed=(plain.gap - row.gap) / plain.gap)


def compare(groups: Sequence[Group]) -> list[Comparison]:
    """A row per group, in the groups' order."""
    rows = [_with_gap(group, groups) for group in groups]
    return [_with_closed_share(row, rows) for row in rows]
