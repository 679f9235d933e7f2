"""The GPU check's table: a row per planned run (its parity with its reference, or what else it
is for; tokens/s, MFU per GPU used, peak memory), then a row per run the machine skipped;
written as ``OUT/table.json`` and printed as markdown."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nobubble.destinations import check_output_file
from nobubble.gpu_check.audit import audit_verdict
from nobubble.gpu_check.parity import finished, verdict
from nobubble.gpu_check.plan import REPEAT, planned
from nobubble.gpu_check.runs import (
    AUDIT,
    MODEL,
    REFERENCE,
    SMOKE,
    THROUGHPUT,
    TRAINING,
    CheckRun,
    audit_folder,
)
from nobubble.json_files import write_json_atomic
from nobubble.markdown import markdown_table

# the verdicts that fail the check ("not run": out of time)
FAILED = ("failed", "DIFFERS", "timed out", "SYNCS")
# the table's word for a run without a reference once it finished
FINISHED_AS = {REFERENCE: "reference", SMOKE: "connected", THROUGHPUT: "measured"}
HEADER = (
    *("run", "transport", "GPUs", "parity (vs reference)"),
    *("loss gap", "tokens/s", "MFU", "peak MB"),
)


def write_table(out: Path) -> list[dict[str, Any]]:
    """The table of ``out``'s plan, written into ``out/table.json``; its rows."""
    planned(out)  # a missing or damaged plan is said before the output is checked
    check_output_file(out / "table.json", "OUT")
    rows = table_rows(out)
    write_json_atomic(out / "table.json", {"settings": [*MODEL, *TRAINING], "rows": rows})
    return rows


def table_rows(out: Path) -> list[dict[str, Any]]:
    """A row per planned run: its parity (or what else it is for), tokens/s, MFU (per GPU it
    used) and peak memory (the largest of its processes'); then a row per skipped run."""
    runs, left_out = planned(out)
    parities = {
        name: json.loads((out / "parity" / f"{name}.json").read_text())
        for name in runs
        if (out / "parity" / f"{name}.json").is_file()
    }
    noise = parities.get(REPEAT.name, {}).get("max_loss_rel_gap")
    rows = []
    for run in runs.values():
        summary = finished(out / "runs" / run.name)
        gaps = parities.get(run.name)
        rows.append(
            {
                "run": run.name,
                "schedule": run.schedule,
                "stages": int(run.setting("stages", "1")),
                "dp": int(run.setting("dp", "1")),
                "transport": run.transport,
                "gpus": run.gpus,
                "reference": run.reference,
                "expect": run.expect if run.reference else None,
                "parity": status(out, run, summary, gaps, noise),
                "max_loss_rel_gap": gaps.get("max_loss_rel_gap") if gaps else None,
                "max_weight_gap": gaps.get("max_weight_gap") if gaps else None,
                **figures(summary, run.gpus),
            }
        )
    for skip in left_out:
        rows.append({"run": skip.name, "parity": f"skipped: {skip.why}", "reference": None})
    for r in rows:
        r["failed"] = r["parity"] in FAILED
    return rows


def status(
    out: Path, run: CheckRun, summary: dict[str, Any] | None, gaps: dict | None, noise: float | None
) -> str:
    """What became of ``run``: not run (the script's time ran out first), timed out (its
    stacks are in its log), its audit's verdict, its parity, or what it is for
    (:data:`FINISHED_AS`) once it finished."""
    if (out / "timeouts" / f"{run.name}.json").is_file():
        return "timed out"
    if not (out / "runs" / run.name).is_dir():
        return "not run"
    if run.kind == AUDIT:
        return audit_verdict(audit_folder(out, run)) if summary else "failed"
    if run.reference is None:
        return FINISHED_AS[run.kind] if summary else "failed"
    return verdict(None if gaps is None or "failed" in gaps else gaps, run.expect, noise)


def figures(summary: dict[str, Any] | None, gpus: int) -> dict[str, float | None]:
    """Tokens/s, MFU per GPU used (summary.json's divides by the processes, which share GPUs
    on gloo) and the largest peak memory of the run's processes."""
    if summary is None:
        return {"tokens_per_s": None, "mfu": None, "peak_mem_mb": None}
    peak = summary.get("peak_tflops")
    model = summary.get("model_tflops")
    stages = summary.get("stages") or [summary]
    return {
        "tokens_per_s": summary.get("tokens_per_s"),
        "mfu": model / (peak * gpus) if peak and model is not None else None,
        "peak_mem_mb": max(s.get("peak_mem_mb", 0.0) for s in stages),
    }


def render(rows: list[dict[str, Any]]) -> str:
    """The table as markdown."""

    def number(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    lines = []
    for r in rows:
        against = f"{r['parity']} (vs {r['reference']})" if r["reference"] else r["parity"]
        if r["parity"].startswith("skipped"):
            lines.append([r["run"], "-", "-", against, "-", "-", "-", "-"])
            continue
        lines.append(
            [
                r["run"],
                r["transport"],
                str(r["gpus"]),
                against,
                number(r["max_loss_rel_gap"], ".1e"),
                number(r["tokens_per_s"], ",.0f"),
                number(r["mfu"], ".1%"),
                number(r["peak_mem_mb"], ",.0f"),
            ]
        )
    return markdown_table(HEADER, lines)
