"""The campaign's results: one :class:`Record` per run, the counts (campaign.json) and the page
(campaign.md). Any run that lost anything, or could not be judged, makes the exit status 1."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nobubble.faults.draw import KINDS, RANK_KINDS, Trial
from nobubble.markdown import markdown_table
from nobubble.provenance import machine_in_words

EXACT = "exact"  # resumed to the end, its metrics and final weights bitwise its twin's
LOST = "lost"  # resumed, and something differs or is missing (said in ``lost``)
MISSED = "missed"  # the run ended before the fault's moment: nothing was injected
UNAVAILABLE = "not available here"  # the kind cannot be done on this machine (``note`` says why)
FAILED = "failed"  # the run could not be judged (its twin failed): a failure of the campaign
OUTCOMES = (EXACT, LOST, MISSED, UNAVAILABLE, FAILED)
COUNTED = ("drawn", "injected", *OUTCOMES)  # injected: exact or lost


@dataclass
class Record:
    """What happened to one run: the fault's step as injected (the newest step logged then),
    seconds from the fault to the first exit of another rank (``detect_s``, the rank kinds)
    and to the launch's end (``down_s``), how the faulted launch and each resume ended
    (:func:`nobubble.faults.campaign.ended`), and what the run lost against its twin."""

    trial: Trial
    outcome: str = FAILED
    note: str = ""
    injected_at: int | None = None
    detect_s: float | None = None
    down_s: float | None = None
    launches: list[dict[str, Any]] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"name": self.trial.name, **dataclasses.asdict(self)}


def _longest(records: Sequence[Record], key: str) -> dict[str, float]:
    """The largest ``key`` (detect_s, down_s) per rank kind, over the runs that measured it."""
    longest: dict[str, float] = {}
    for record in records:
        value = getattr(record, key)
        kind = record.trial.fault.kind
        if value is not None and kind in RANK_KINDS:
            longest[kind] = max(longest.get(kind, 0.0), value)
    return longest


def summarize(records: Sequence[Record], header: Mapping[str, Any]) -> dict[str, Any]:
    """campaign.json: ``header`` (command, code, machine, settings), the outcomes per fault
    kind and in all, the longest times to detect a dead peer, what every non-exact run lost,
    and every run's record."""
    by_kind = {kind: dict.fromkeys(COUNTED, 0) for kind in KINDS}
    for record in records:
        counts = by_kind[record.trial.fault.kind]
        counts["drawn"] += 1
        counts[record.outcome] += 1
        counts["injected"] += record.outcome in (EXACT, LOST)
    totals = {key: sum(counts[key] for counts in by_kind.values()) for key in COUNTED}
    return {
        **header,
        "totals": totals,
        "by_kind": by_kind,
        "longest_detect_s": _longest(records, "detect_s"),
        "longest_down_s": _longest(records, "down_s"),
        "not_exact": [
            {"name": r.trial.name, "outcome": r.outcome, "lost": r.lost, "note": r.note}
            for r in records
            if r.outcome in (LOST, FAILED)
        ],
        "tracebacks": [
            r.trial.name for r in records if any(launch["traceback"] for launch in r.launches)
        ],
        "unavailable": {r.trial.fault.kind: r.note for r in records if r.outcome == UNAVAILABLE},
        "runs": [r.as_json() for r in records],
    }


def failed(summary: Mapping[str, Any]) -> bool:
    """Whether a run lost anything or could not be judged."""
    return bool(summary["not_exact"])


def markdown(summary: Mapping[str, Any]) -> str:
    """campaign.md: the command, the code and machine, the table of outcomes per fault kind,
    the detection times, and every run that was not exact with what it lost."""
    totals = summary["totals"]
    lines = [
        "# Fault campaign",
        "",
        f"Command: `{summary['command']}`  ",
        f"Code: nobubble {summary['code']['nobubble']}, torch {summary['code']['torch']}  ",
        f"Machine: {machine_in_words(summary['machine'])}",
        "",
        f"**{totals['exact']} of {totals['injected']} faulted runs resumed exactly**; "
        f"{totals['lost']} lost something, {totals['failed']} could not be judged, "
        f"{totals['missed']} ended before their fault, {totals['not available here']} drew a "
        "fault not available here.",
        "",
        markdown_table(
            ["fault", *COUNTED],
            [
                [kind, *(str(counts[key]) for key in COUNTED)]
                for kind, counts in summary["by_kind"].items()
            ],
        ),
    ]
    lines.append("")
    timeout = summary["p2p_timeout_s"]
    for kind in RANK_KINDS:
        detect = summary["longest_detect_s"].get(kind)
        down = summary["longest_down_s"].get(kind)
        if detect is not None:
            lines.append(
                f"- {kind}: the longest time from the fault to the first exit of another rank "
                f"{detect:.1f} s, to the end of the launch {down:.1f} s (p2p_timeout_s={timeout:g})"
            )
    if summary["tracebacks"]:
        lines.append(
            "- a worker ended in a Python traceback, not a one-line error, in: "
            + ", ".join(summary["tracebacks"])
        )
    for kind, why in summary["unavailable"].items():
        lines.append(f"- {kind}: not available here ({why})")
    if summary["not_exact"]:
        lines += ["", "## Not exact", ""]
        for run in summary["not_exact"]:
            what = "; ".join(run["lost"]) or run["note"]
            lines.append(f"- **{run['name']}** ({run['outcome']}): {what}")
    return "\n".join(lines) + "\n"
