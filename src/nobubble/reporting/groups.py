"""Runs grouped over seeds, and each delayed group compared with its synchronous baseline.

A group is every run with the same settings but the seed. Groups that differ only in how the
pipeline runs (schedule, delay corrections, stages, microbatches, partition) are one
*comparison*: the synchronous group without a correction among them is the baseline of the
others, and the delay gap of a group is its mean final validation loss minus the baseline's. A
group with a correction is also compared with the same group without it: the share of that
plain run's gap the correction closes, and, where the same correction ran under a synchronous
schedule too, with that control: what the correction costs without a delay, apart from what it
does to the delay (:func:`controls`). A group's staleness (drift, cosines, applied-step error:
:mod:`nobubble.staleness`) is set beside its gap (:func:`rank_correlation`). A share knows the
machines and code versions of the runs it pools (:func:`origins`): the same run differs between
CPUs, so a share whose references were made elsewhere is not the same measurement.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from nobubble.config import SECTIONS, TrainConfig
from nobubble.config.fields import FREE
from nobubble.corrections.registry import chosen
from nobubble.reporting.runs import RecordedRun
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
PARALLEL_KEYS = tuple(k for k in PIPELINE_KEYS if k not in CORRECTION_KEYS)
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
    def of_known(cls, values: Sequence[float | None]) -> Stat | None:
        """Over the values that are known (a run that measured it); None if none is."""
        known = [v for v in values if v is not None]
        return cls.of(known) if known else None

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
    runs: tuple[RecordedRun, ...]

    @property
    def optim(self) -> str:
        return self.settings["optim"]

    @property
    def corrections(self) -> tuple[str, ...]:
        """The delay corrections the group's runs use, in the registry's order."""
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
    def finished(self) -> tuple[RecordedRun, ...]:
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

    @property
    def drift(self) -> Stat | None:
        """Each run's weight drift averaged over its evaluations after the first update, over
        the runs that recorded one (None: none did, e.g. a synchronous group)."""
        return Stat.of_known(
            [_mean([p.weight_drift for p in r.evals if p.step]) for r in self.runs]
        )

    @property
    def final_drift(self) -> Stat | None:
        """The weight drift at each run's last evaluation that recorded one."""
        last = [
            next((p.weight_drift for p in reversed(r.evals) if p.weight_drift is not None), None)
            for r in self.runs
        ]
        return Stat.of_known(last)

    def measured(self, key: str) -> Stat | None:
        """Each run's measure ``key`` taken every N steps (:data:`nobubble.staleness.STEP_MEASURES`:
        the gradient cosine, the applied-step error and cosine) averaged over its measurements."""
        return Stat.of_known([_mean([v for _, v in r.measured.get(key, ())]) for r in self.runs])

    def without(self, *keys: str) -> dict[str, Any]:
        return {k: v for k, v in self.settings.items() if k not in keys}


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def corrections_of(settings: dict[str, Any]) -> tuple[str, ...]:
    return chosen(TrainConfig(correction=settings["correction"]))


def _label(correction: str) -> str:
    return "EF" if correction == "ef" else correction


def group_runs(runs: Sequence[RecordedRun]) -> list[Group]:
    """Group over seeds, ordered by optimizer, schedule, corrections, then the other settings."""
    buckets: dict[str, list[RecordedRun]] = {}
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
class Origins:
    """The machines and code versions (:attr:`RecordedRun.machine`, :attr:`RecordedRun.code`) of
    a share's own group and of the groups it is set against, each in the order first met."""

    machines: tuple[str, ...]
    reference_machines: tuple[str, ...]
    code: tuple[str, ...]
    reference_code: tuple[str, ...]

    @property
    def machines_differ(self) -> bool:
        """More than one machine among them (a run that records none counts as another)."""
        return len({*self.machines, *self.reference_machines}) > 1

    @property
    def code_differs(self) -> bool:
        return len({*self.code, *self.reference_code}) > 1


def origins(group: Group, references: Sequence[Group]) -> Origins | None:
    """Where ``group``'s runs and those of ``references`` were made; None when all on one
    machine by one code version (or when none of them records either)."""
    theirs = [run for other in references for run in other.runs]
    found = Origins(
        _distinct(run.machine for run in group.runs),
        _distinct(run.machine for run in theirs),
        _distinct(run.code for run in group.runs),
        _distinct(run.code for run in theirs),
    )
    return found if found.machines_differ or found.code_differs else None


def _distinct(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(values))


def _groups(found: Iterable[Group | None]) -> tuple[Group, ...]:
    """The distinct groups among ``found`` (a row without a baseline has None)."""
    return tuple({id(g): g for g in found if g is not None}.values())


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
    references: tuple[Group, ...] = ()  # the groups ``closed`` sets this one against

    @property
    def closed_origins(self) -> Origins | None:
        """Where the runs of ``closed`` were made, if not all on one machine by one code."""
        return origins(self.group, self.references) if self.closed is not None else None

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
    references = (row.baseline, plain.group, plain.baseline)
    return dataclasses.replace(
        row, closed=(plain.gap - row.gap) / plain.gap, references=_groups(references)
    )


def compare(groups: Sequence[Group]) -> list[Comparison]:
    """A row per group, in the groups' order."""
    rows = [_with_gap(group, groups) for group in groups]
    return [_with_closed_share(row, rows) for row in rows]


@dataclass(frozen=True)
class Control:
    """A delayed group with a correction beside the same correction without a delay (its
    control) and the same delayed group without a correction: the correction's cost without any
    delay, apart from what it does to the delay's cost."""

    row: Comparison  # the delayed group with the correction
    control: Comparison  # the same correction under a synchronous schedule
    plain: Comparison  # the delayed group without a correction

    @property
    def cost(self) -> float:
        """What the correction costs without a delay: its control minus the baseline."""
        return self.control.gap

    @property
    def delay_cost(self) -> float:
        """What the delay costs with the correction: the group minus its control."""
        return self.row.group.loss.mean - self.control.group.loss.mean

    @property
    def removed(self) -> float | None:
        """The share of the plain delay's cost the correction removes, its own cost aside."""
        if self.plain.gap is None or not self.plain.gap_is_clear:
            return None
        return 1 - self.delay_cost / self.plain.gap

    @property
    def removed_origins(self) -> Origins | None:
        """Where the runs of ``removed`` were made, if not all on one machine by one code."""
        references = (self.control.group, self.plain.group, self.plain.baseline)
        return origins(self.row.group, _groups(references))


def controls(rows: Sequence[Comparison]) -> list[Control]:
    """Each delayed group with a correction whose control (the same settings under a synchronous
    schedule) and plain delayed group are among ``rows``, all with finite gaps."""
    found = []
    for row in rows:
        group = row.group
        if not group.corrections or group.settings["schedule"] in SYNCHRONOUS_SCHEDULES:
            continue
        same = group.corrections  # however they were spelled (ef+predict or predict+ef)
        spelling = (*PARALLEL_KEYS, "correction")
        settings = group.settings
        control = _find(rows, settings, lambda g, same=same: g.corrections == same, spelling)
        plain = _find(rows, settings, lambda g: not g.corrections, CORRECTION_KEYS, delayed=True)
        gaps = [r.gap for r in (row, control, plain) if r is not None]
        if len(gaps) == 3 and all(g is not None and math.isfinite(g) for g in gaps):
            found.append(Control(row, control, plain))
    return found


@dataclass(frozen=True)
class Referenced:
    """A delayed group whose settings differ from reference values (an optimizer's default
    momentum, the learning rate tuned without a delay) set against the synchronous and the
    plain delayed groups at the reference values: how much of the delay gap a user would
    otherwise have had does the change close?"""

    row: Comparison  # the delayed group
    sync: Comparison  # the synchronous group at the reference values
    plain: Comparison  # the delayed group at the reference values, without a correction

    @property
    def gap(self) -> float:
        """The group's final loss minus the reference synchronous group's."""
        return self.row.group.loss.mean - self.sync.group.loss.mean

    @property
    def gap_se(self) -> float:
        return math.hypot(self.row.group.loss.sem, self.sync.group.loss.sem)

    @property
    def closed(self) -> float | None:
        """The share of the reference delayed group's gap closed (None if it has no clear gap)."""
        if self.plain.gap is None or not self.plain.gap_is_clear:
            return None
        return (self.plain.gap - self.gap) / self.plain.gap

    @property
    def closed_origins(self) -> Origins | None:
        """Where the runs of ``closed`` were made, if not all on one machine by one code."""
        references = (self.sync.group, self.plain.group, self.plain.baseline)
        return origins(self.row.group, _groups(references))


def against_references(rows: Sequence[Comparison], reference: dict[str, Any]) -> list[Referenced]:
    """Each delayed group with a setting of ``reference`` away from its value, beside the
    synchronous and the plain delayed groups that have every value of ``reference`` and
    otherwise its settings (corrections aside), all with finite losses."""
    found = []
    for row in rows:
        settings = row.group.settings
        moved = {k: v for k, v in reference.items() if settings.get(k, v) != v}
        if settings["schedule"] in SYNCHRONOUS_SCHEDULES or not moved:
            continue
        at_reference = {**settings, **moved}
        sync = _find(rows, at_reference, lambda g: g.is_baseline, PIPELINE_KEYS)
        plain = _find(rows, at_reference, lambda g: not g.corrections, CORRECTION_KEYS, True)
        if sync is None or plain is None or plain.gap is None:
            continue
        losses = (row.group.loss.mean, sync.group.loss.mean, plain.gap)
        if all(math.isfinite(x) for x in losses):
            found.append(Referenced(row, sync, plain))
    return found


def _find(
    rows: Sequence[Comparison],
    settings: dict[str, Any],
    wanted: Callable[[Group], bool],
    keys: Sequence[str],
    delayed: bool = False,
) -> Comparison | None:
    """The row whose group has ``settings`` but for ``keys``, passes ``wanted``, and runs a
    synchronous schedule (``delayed``: the schedule of ``settings``)."""
    key = {k: v for k, v in settings.items() if k not in keys}
    for row in rows:
        other = row.group
        same_schedule = (
            other.settings["schedule"] == settings["schedule"]
            if delayed
            else other.settings["schedule"] in SYNCHRONOUS_SCHEDULES
        )
        if same_schedule and wanted(other) and other.without(*keys) == key:
            return row
    return None


def rank_correlation(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Spearman's rank correlation of (x, y) pairs (ties share their mean rank); None for fewer
    than 3 pairs or a constant column."""
    if len(pairs) < 3:
        return None
    xs, ys = _ranks([x for x, _ in pairs]), _ranks([y for _, y in pairs])
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sx = math.sqrt(sum((x - mx) ** 2 for x in xs))
    sy = math.sqrt(sum((y - my) ** 2 for y in ys))
    if sx == 0 or sy == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / (sx * sy)


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks
