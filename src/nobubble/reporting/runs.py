"""Reading run folders: config.json, summary.json, the eval lines of metrics.jsonl, and the
downstream scores of ``nobubble eval`` (``downstream/``) where there are any.

A run is reported when it finished (summary.json) or diverged: stopped by the non-finite policy,
or finished with a non-finite loss. A diverged run counts as an infinite final loss, as in a
sweep's ``best:`` values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nobubble.config import FIELDS, ConfigError, coerce
from nobubble.downstream.scores import Column, Score, latest_scores

# Settings that name, place or pace a run without changing what it computes: two runs that differ
# only in these are the same experiment (a sweep may rerun with another --jobs, i.e. threads).
NON_RESULT_KEYS = ("out", "name", "threads", "progress", "p2p_timeout_s", "p2p_routes")


class ReportError(ConfigError):
    """Run folders that cannot be reported on; the message says which and why."""


def result_settings(config: dict[str, Any]) -> dict[str, Any]:
    """Every setting that can change a run's result; keys missing from an older config.json take
    their current default, so adding a config key does not make old runs look different."""
    return {
        key: config.get(key, field.default)
        for key, field in FIELDS.items()
        if key not in NON_RESULT_KEYS
    }


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportError(f"cannot read {path}: {exc}") from None


def final_loss(summary: dict[str, Any], key: str = "final_val_loss") -> float:
    """The summary's final validation loss (or ``key``); a diverged run counts as +inf: one with
    a non-finite loss, or with no summary at all (see :func:`stopped_diverged`)."""
    loss = float(summary.get(key, math.nan))
    return loss if math.isfinite(loss) else math.inf


@dataclass(frozen=True)
class EvalPoint:
    step: int
    val_loss: float
    val_bpb: float
    train_time_s: float


@dataclass(frozen=True)
class Run:
    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]  # empty for a run the non-finite policy stopped
    evals: tuple[EvalPoint, ...]
    downstream: Mapping[Column, Score]  # scores from `nobubble eval` (none if never run)

    @property
    def settings(self) -> dict[str, Any]:
        return result_settings(self.config)

    @property
    def final_loss(self) -> float:
        return final_loss(self.summary)

    @property
    def final_bpb(self) -> float:
        return final_loss(self.summary, "final_val_bpb")

    @property
    def diverged(self) -> bool:
        return self.final_loss == math.inf


def read_metrics(metrics: Path) -> list[dict[str, Any]]:
    """The lines of metrics.jsonl (none if it is missing)."""
    if not metrics.exists():
        return []
    try:
        return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportError(f"cannot read {metrics}: {exc}") from None


def read_evals(metrics: Path) -> tuple[EvalPoint, ...]:
    points = [
        EvalPoint(
            step=record["step"],
            val_loss=record["val_loss"],
            val_bpb=record["val_bpb"],
            train_time_s=record.get("train_time_s", math.nan),
        )
        for record in read_metrics(metrics)
        if "val_loss" in record
    ]
    return tuple(sorted(points, key=lambda p: p.step))


def stopped_diverged(folder: Path) -> bool:
    """Whether training stopped on the non-finite policy (``nonfinite_patience``): the run has
    no summary and its last step line has a non-finite loss or a stage that skipped its update
    (a run cut short otherwise, even mid-line, ends with an ordinary line or none)."""
    if (folder / "summary.json").is_file():
        return False
    try:
        steps = [r for r in read_metrics(folder / "metrics.jsonl") if "train_loss" in r]
    except ReportError:  # a line cut short by a kill: not the policy's doing
        return False
    return bool(steps) and (
        not math.isfinite(steps[-1]["train_loss"]) or "skipped_stages" in steps[-1]
    )


def load_run(path: Path) -> Run:
    summary = path / "summary.json"
    return Run(
        path=path,
        config=read_json(path / "config.json"),
        summary=read_json(summary) if summary.is_file() else {},
        evals=read_evals(path / "metrics.jsonl"),
        downstream=latest_scores(path),
    )


def run_folders(path: Path) -> list[Path]:
    """``path`` itself if it is a run folder, else every run folder below it (not inside runs)."""
    if (path / "config.json").is_file():
        return [path]
    if not path.is_dir():
        return []
    found: list[Path] = []
    for child in sorted(p for p in path.iterdir() if p.is_dir()):
        found.extend(run_folders(child))
    return found


def discover(paths: list[Path]) -> tuple[list[Run], list[str]]:
    """Finished and diverged runs under ``paths``; a warning for each unfinished or duplicate one.

    A path that neither is a run folder nor holds one is an error (most likely a typo).
    """
    runs: list[Run] = []
    warnings: list[str] = []
    seen: dict[str, Path] = {}
    for path in paths:
        folders = run_folders(path)
        if not folders:
            raise ReportError(
                f"{path} is not a run folder (no config.json) and holds no run folders; "
                "pass folders written by `nobubble train` or `nobubble sweep`"
            )
        for folder in folders:
            if not (folder / "summary.json").is_file() and not stopped_diverged(folder):
                warnings.append(f"skipped {folder}: unfinished (no summary.json)")
                continue
            run = load_run(folder)
            identity = json.dumps(run.settings, sort_keys=True)
            if identity in seen:
                warnings.append(f"skipped {folder}: same settings and seed as {seen[identity]}")
                continue
            seen[identity] = folder
            runs.append(run)
    return runs, warnings


Filter = tuple[str, list[Any]]  # keep runs whose setting is one of these values


def parse_filter(text: str) -> Filter:
    """``KEY=V1,V2`` (values in config syntax) as a filter."""
    key, sep, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not values:
        raise ReportError(f"expected KEY=VALUE[,VALUE...], got {text!r} (e.g. optim=adamw,muon)")
    return key, [coerce(key, v) for v in values.split(",")]


def matches(run: Run, filters: list[Filter]) -> bool:
    return all(run.settings[key] in values for key, values in filters)
