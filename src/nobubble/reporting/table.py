"""Markdown tables: final quality per group with its delay gap, downstream scores, time to
target, staleness beside the gap, and each correction against its control without a delay. A
share whose runs were not all made on one machine by one code version is marked, and left out
when the machines differ (:class:`Marks`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from nobubble.markdown import markdown_table
from nobubble.reporting.groups import (
    Comparison,
    Control,
    Group,
    Origins,
    Referenced,
    Stat,
    rank_correlation,
    varied_keys,
)
from nobubble.reporting.target import ReverseRow, TargetRow
from nobubble.runfolder.scores import Column
from nobubble.staleness import (
    APPLIED_COSINE,
    APPLIED_ERROR,
    COSINE,
    STEP_MEASURES,
    SYNC_STEP_COSINE,
    SYNC_STEP_ERROR,
)

# shown in their own columns ("setup" names the schedule and the corrections), not under "settings"
COLUMN_KEYS = ("optim", "schedule", "correction")


def fmt_value(value: Any) -> str:
    return "x".join(map(str, value)) if isinstance(value, list) else str(value)


def fmt_stat(stat: Stat, digits: int = 4) -> str:
    """``mean ± std`` over seeds (just the mean for a single seed)."""
    if math.isnan(stat.std):
        return f"{stat.mean:.{digits}f}"
    return f"{stat.mean:.{digits}f} ± {stat.std:.{digits}f}"


def settings_label(group: Group, keys: Sequence[str]) -> str:
    """``key=value`` for each of ``keys``; an unset key (None) is left out, and a dense model
    beside MoE ones reads ``dense``, not ``moe_experts=None moe_top_k=None ...``."""
    settings = group.settings
    dense = "moe_experts" in keys and settings.get("moe_experts") is None
    labels = [f"{k}={fmt_value(settings[k])}" for k in keys if settings.get(k) is not None]
    return " ".join(["dense", *labels] if dense else labels)


def fmt_final(group: Group) -> str:
    """The final validation loss over seeds; a diverged seed makes it infinite."""
    if math.isfinite(group.loss.mean):
        return fmt_stat(group.loss)
    return f"diverged ({group.diverged} of {len(group.runs)} seeds)"


def fmt_gap(row: Comparison) -> str:
    if row.group.is_baseline:
        return "baseline"
    if row.gap is None:
        return "—"
    if not math.isfinite(row.gap):
        return "diverged" if row.group.diverged else "baseline diverged"
    return fmt_difference(row.gap, row.gap_se)


def fmt_difference(value: float, se: float | None) -> str:
    """A difference of means, ± its standard error where there is one."""
    return f"{value:+.4f} ± {se:.4f}" if se else f"{value:+.4f}"


def fmt_share(share: float | None) -> str:
    return "—" if share is None else f"{100 * share:.0f}%"


class Marks:
    """The marks (†1, †2, ...) of one table's shares whose runs were not all made on one machine
    by one code version, one per distinct :class:`Origins`, and the note saying what each stands
    for. A share pooling more than one machine's runs is left out unless ``allow_mixed``: float
    rounding differs between CPUs, so the same run there is another measurement."""

    def __init__(self, allow_mixed: bool) -> None:
        self.allow_mixed = allow_mixed
        self.found: dict[Origins, int] = {}

    def share(self, share: float | None, origins: Origins | None) -> str:
        """``share`` as a percentage, marked (or left out) when its runs are mixed."""
        if share is None or origins is None:
            return fmt_share(share)
        mark = f"†{self.found.setdefault(origins, len(self.found) + 1)}"
        if self.withheld(origins):
            return f"— (other machine {mark})"
        return f"{fmt_share(share)} {mark}"

    def withheld(self, origins: Origins) -> bool:
        return origins.machines_differ and not self.allow_mixed

    def note(self) -> str | None:
        """What each mark stands for; None without any."""
        if not self.found:
            return None
        lines = [
            f"†{mark}: the group's runs: machine {_listed(o.machines)}; code {_listed(o.code)}. "
            f"The runs it is set against: machine {_listed(o.reference_machines)}; code "
            f"{_listed(o.reference_code)}."
            for o, mark in self.found.items()
        ]
        if any(self.withheld(o) for o in self.found):
            lines.append(
                "A share *other machine* pools runs of more than one machine (one that records "
                "none counts as another) and is left out: float rounding differs between CPUs, "
                "so the same run there is another measurement. `--allow-mixed-references` shows "
                "it, marked."
            )
        return "\n\n".join(lines)


def _listed(values: Sequence[str]) -> str:
    return " and ".join(values)


def with_note(table: str, marks: Marks) -> str:
    """``table`` followed by what its marks stand for."""
    note = marks.note()
    return table if note is None else f"{table}\n\n{note}"


def fmt_closed(row: Comparison, marks: Marks) -> str:
    if row.closed is not None:
        return marks.share(row.closed, row.closed_origins)
    return "— (no clear gap)" if row.closed_unclear else ""


def _who(group: Group, keys: Sequence[str]) -> list[str]:
    """The cells that say which group a row is; "settings" only when something else varies."""
    return [group.optim, group.setup] + ([settings_label(group, keys)] if keys else [])


def _who_header(keys: Sequence[str]) -> list[str]:
    return ["optimizer", "setup"] + (["settings"] if keys else [])


def quality_table(rows: Sequence[Comparison], allow_mixed: bool = False) -> str:
    keys = varied_keys([r.group for r in rows], exclude=COLUMN_KEYS)
    marks = Marks(allow_mixed)
    header = [*_who_header(keys), "seeds", "val loss", "val bpb", "gap vs sync", "gap closed"]
    body = [
        [
            *_who(r.group, keys),
            str(len(r.group.runs)),
            fmt_final(r.group),
            fmt_stat(r.group.bpb) if math.isfinite(r.group.bpb.mean) else "—",
            fmt_gap(r),
            fmt_closed(r, marks),
        ]
        for r in rows
    ]
    return with_note(markdown_table(header, body), marks)


def fmt_score(group: Group, column: Column) -> str:
    """Mean ± std over the seeds evaluated on ``column``; one seed's value with lm-eval's
    standard error."""
    scores = [run.downstream[column] for run in group.runs if column in run.downstream]
    if not scores:
        return "—"
    if len(scores) == 1:
        se = scores[0].stderr
        cell = f"{scores[0].value:.4f}" + ("" if se is None else f" (se {se:.4f})")
    else:
        cell = fmt_stat(Stat.of([s.value for s in scores]))
    missing = len(scores) < len(group.runs)
    return cell + (f" ({len(scores)}/{len(group.runs)} seeds)" if missing else "")


def downstream_table(rows: Sequence[Comparison]) -> str | None:
    """Benchmark scores beside the final validation loss; None when no run was evaluated."""
    columns = list(dict.fromkeys(c for r in rows for run in r.group.runs for c in run.downstream))
    if not columns:
        return None
    keys = varied_keys([r.group for r in rows], exclude=COLUMN_KEYS)
    header = [*_who_header(keys), "seeds", "val loss", "eval step", *(c.label for c in columns)]
    body = []
    for r in rows:
        steps = sorted({s.step for run in r.group.runs for s in run.downstream.values()})
        body.append(
            [
                *_who(r.group, keys),
                str(len(r.group.runs)),
                fmt_final(r.group),
                ", ".join(map(str, steps)) or "—",
                *(fmt_score(r.group, c) for c in columns),
            ]
        )
    return markdown_table(header, body)


GAP_FRACTIONS = (0.25, 0.5, 1.0)


def gap_during_training_table(rows: Sequence[Comparison]) -> str | None:
    """The delay gap at a quarter, half and all of training; None without delayed groups."""
    found = [(r, r.gap_during_training(GAP_FRACTIONS)) for r in rows]
    found = [(r, gaps) for r, gaps in found if gaps]
    if not found:
        return None
    keys = varied_keys([r.group for r, _ in found], exclude=COLUMN_KEYS)
    header = [*_who_header(keys), *(f"gap at {f:.0%} (step)" for f in GAP_FRACTIONS)]
    body = [
        [*_who(r.group, keys), *(f"{gap:+.4f} ({step})" for step, gap in gaps)] for r, gaps in found
    ]
    return markdown_table(header, body)


def target_table(rows: Sequence[TargetRow], all_groups: Sequence[Group]) -> str:
    keys = varied_keys(all_groups, exclude=COLUMN_KEYS)
    header = [*_who_header(keys), "target val loss", "time to target (s)", "reached", "speed-up"]
    body = [
        [
            *_who(r.group, keys),
            f"{r.target:.4f}",
            "not reached" if r.time is None else fmt_stat(r.time, digits=1),
            f"{r.reached}/{len(r.group.runs)}",
            "—" if r.speedup is None else f"{r.speedup:.2f}×",
        ]
        for r in rows
    ]
    return markdown_table(header, body)


def reverse_table(rows: Sequence[ReverseRow], all_groups: Sequence[Group]) -> str:
    keys = varied_keys(all_groups, exclude=COLUMN_KEYS)
    header = [
        *_who_header(keys),
        "its final val loss",
        "its time (s)",
        "baseline's time to it (s)",
        "reached",
        "speed-up",
    ]
    body = [
        [
            *_who(r.group, keys),
            f"{r.target:.4f}",
            fmt_stat(r.own_time, digits=1),
            "not reached" if r.baseline_time is None else fmt_stat(r.baseline_time, digits=1),
            f"{r.reached}/{len(r.baseline.runs)}",
            "—" if r.speedup is None else f"{r.speedup:.2f}×",
        ]
        for r in rows
    ]
    return markdown_table(header, body)


def _fmt_known(stat: Stat | None) -> str:
    return "—" if stat is None else fmt_stat(stat)


def staleness_table(rows: Sequence[Comparison]) -> str | None:
    """Each group's weight drift (mean over training, and at the end), gradient cosine and
    applied-step error and cosine beside its gap; None when no run recorded any."""
    found = [
        r
        for r in rows
        if r.group.drift is not None or any(r.group.measured(k) is not None for k in STEP_MEASURES)
    ]
    if not found:
        return None
    keys = varied_keys([r.group for r in found], exclude=COLUMN_KEYS)
    header = [
        *_who_header(keys),
        "seeds",
        "weight drift (mean)",
        "weight drift (end)",
        "gradient cosine",
        "applied-step error",
        "applied-step cosine",
        "sync-step error",
        "sync-step cosine",
        "gap vs sync",
    ]
    body = [
        [
            *_who(r.group, keys),
            str(len(r.group.runs)),
            _fmt_known(r.group.drift),
            _fmt_known(r.group.final_drift),
            *(_fmt_known(r.group.measured(k)) for k in STEP_MEASURES),
            fmt_gap(r),
        ]
        for r in found
    ]
    return markdown_table(header, body)


STALENESS_MEASURES: dict[str, Callable[[Group], Stat | None]] = {
    "mean weight drift": lambda group: group.drift,
    "gradient cosine": lambda group: group.measured(COSINE),
    "applied-step error": lambda group: group.measured(APPLIED_ERROR),
    "applied-step cosine": lambda group: group.measured(APPLIED_COSINE),
    "sync-step error": lambda group: group.measured(SYNC_STEP_ERROR),
    "sync-step cosine": lambda group: group.measured(SYNC_STEP_COSINE),
}


def staleness_gap_correlation(
    rows: Sequence[Comparison], measure: Callable[[Group], Stat | None]
) -> tuple[float, int] | None:
    """Spearman's correlation between a staleness measure of the groups (one of
    ``STALENESS_MEASURES``) and their gap vs sync, and how many groups it is over (those with
    both, finite); None for fewer than 3."""
    pairs = [
        (stat.mean, r.gap)
        for r in rows
        if (stat := measure(r.group)) is not None and r.gap is not None and math.isfinite(r.gap)
    ]
    rho = rank_correlation(pairs)
    return None if rho is None else (rho, len(pairs))


def references_table(found: Sequence[Referenced], allow_mixed: bool = False) -> str:
    """Each delayed group against the reference synchronous and delayed groups."""
    keys = varied_keys([r.row.group for r in found], exclude=COLUMN_KEYS)
    marks = Marks(allow_mixed)
    header = [
        *_who_header(keys),
        "seeds",
        "val loss",
        "reference sync",
        "gap vs it",
        "reference delayed gap",
        "gap closed",
    ]
    body = [
        [
            *_who(r.row.group, keys),
            str(len(r.row.group.runs)),
            fmt_final(r.row.group),
            fmt_stat(r.sync.group.loss),
            fmt_difference(r.gap, r.gap_se),
            fmt_gap(r.plain),
            marks.share(r.closed, r.closed_origins),
        ]
        for r in found
    ]
    return with_note(markdown_table(header, body), marks)


def controls_table(found: Sequence[Control], allow_mixed: bool = False) -> str | None:
    """Each correction's cost without a delay apart from the delay's cost with it; None without
    any control."""
    if not found:
        return None
    keys = varied_keys([c.row.group for c in found], exclude=COLUMN_KEYS)
    marks = Marks(allow_mixed)
    header = [
        *_who_header(keys),
        "control",
        "cost without delay",
        "gap vs sync",
        "delay's cost with it",
        "delay's cost without it",
        "of which removed",
    ]
    body = [
        [
            *_who(c.row.group, keys),
            c.control.group.setup,
            f"{c.cost:+.4f}",
            fmt_gap(c.row),
            f"{c.delay_cost:+.4f}",
            fmt_gap(c.plain),
            marks.share(c.removed, c.removed_origins),
        ]
        for c in found
    ]
    return with_note(markdown_table(header, body), marks)
