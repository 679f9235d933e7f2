"""Reading run folders: config.json, summary.json, the eval lines of metrics.jsonl (with the
weight drift, and the gradient cosines and applied-step errors where measured:
:mod:`nobubble.staleness`), and the downstream scores of ``nobubble eval`` (``downstream/``)
where there are any.

A run is reported when its summary.json says it finished or diverged: stopped by the non-finite
policy, or finished with a non-finite loss. A diverged run counts as an infinite final loss, as
in a sweep's ``best:`` values. A run without a summary, or stopped early otherwise (a signal, an
error), is unfinished.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from nobubble.config import (
    FIELDS,
    OLD_EF,
    ConfigError,
    TrainConfig,
    as_bool,
    coerce,
    from_saved,
    names_in,
)
from nobubble.device import device_type
from nobubble.provenance import machine_in_words
from nobubble.runfolder.folder import FINISHED, NON_FINITE, RunFolder
from nobubble.runfolder.reading import (
    damaged_config,
    is_run_folder,
    read_metrics,
    read_summary,
    saved_config,
    stop_of,
)
from nobubble.runfolder.scores import Column, Score, latest_scores
from nobubble.schedules.registry import SCHEDULES
from nobubble.settings_read import never_read
from nobubble.stage_options import auto_dtype
from nobubble.staleness import DRIFT, STEP_MEASURES

# Settings that name, place or pace a run without changing what it computes: two runs that differ
# only in these are the same experiment (a sweep may rerun with another --jobs, i.e. threads).
# staleness_every and applied_error_every only measure (the same steps, with or without them:
# tests/test_staleness.py, tests/test_applied_error.py);
# emulate_nccl and p2p_warmup only change how messages travel (bitwise the same run:
# tests/test_emulated_nccl.py); group_timeout_s, like p2p_timeout_s, only when a stuck run gives up.
NON_RESULT_KEYS = (
    "out",
    "name",
    "threads",
    "progress",
    "p2p_timeout_s",
    "group_timeout_s",
    "p2p_warmup",
    "p2p_routes",
    "staleness_every",
    "applied_error_every",
    "emulate_nccl",
)


NOT_RECORDED = "not recorded"  # a run's machine or code, in the summary of an older version


class ReportError(ConfigError):
    """Run folders that cannot be reported on; the message says which and why."""


def result_settings(config: dict[str, Any]) -> dict[str, Any]:
    """Every setting that can change a run's result; keys missing from an older config.json mean
    what they meant when it was saved (:func:`nobubble.config.from_saved`), so adding a config
    key or changing a default does not make old runs look different; a setting the run never
    reads (:func:`nobubble.settings_read.never_read`: ``zero`` at dp=1) is as if left out, its
    default; and ``chunks`` left to the schedule (``null``, as earlier versions saved it) is the
    schedule's."""
    saved = _schedule_chunks(from_saved(config))
    if saved["dtype"] == "auto":  # saved before auto was resolved: it trains as it would here
        saved["dtype"] = auto_dtype(device_type(saved["device"]))
    settings = {key: saved[key] for key in FIELDS if key not in NON_RESULT_KEYS}
    # not build_config: a check added since the run was trained must not hide it from reports
    for key in never_read(TrainConfig(**{key: saved[key] for key in FIELDS})):
        if key in settings:
            settings[key] = FIELDS[key].default
    return _schedule_chunks(settings)


def _schedule_chunks(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with ``chunks`` left to the schedule (``null``) as the schedule's."""
    if settings["chunks"] is None and settings["schedule"] in SCHEDULES:
        return {**settings, "chunks": SCHEDULES[settings["schedule"]].default_chunks}
    return settings


def final_loss(summary: dict[str, Any], key: str = "final_val_loss") -> float:
    """The summary's final validation loss (or ``key``); a diverged run counts as +inf: one the
    non-finite policy stopped, or one with a non-finite (or no) final loss."""
    loss = summary.get(key)
    if stop_of(summary) == NON_FINITE or not isinstance(loss, int | float):
        return math.inf
    return float(loss) if math.isfinite(loss) else math.inf


@dataclass(frozen=True)
class EvalPoint:
    step: int
    val_loss: float
    val_bpb: float
    train_time_s: float
    weight_drift: float | None = None  # the mean over the model stages with a delay


@dataclass(frozen=True)
class RecordedRun:
    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    evals: tuple[EvalPoint, ...]
    downstream: Mapping[Column, Score]  # scores from `nobubble eval` (none if never run)
    # the measures taken every N steps (STEP_MEASURES): key -> (step, mean over the stages)
    measured: Mapping[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)

    @cached_property
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

    @property
    def machine(self) -> str:
        """The machine its summary.json records (:func:`nobubble.provenance.machine`), in words;
        ``NOT_RECORDED`` for a run of a version that did not record it."""
        found = self.summary.get("machine")
        return machine_in_words(found) if isinstance(found, dict) else NOT_RECORDED

    @property
    def code(self) -> str:
        """The code version its summary.json records: nobubble's commit and torch's version;
        ``NOT_RECORDED`` for a run of a version that did not record it."""
        found = self.summary.get("code")
        if not isinstance(found, dict):
            return NOT_RECORDED
        commit = found.get("nobubble") or "(not a checkout)"
        return f"nobubble {commit} (torch {found.get('torch')})"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def stage_mean(values: Any) -> float | None:
    """The mean of a per-model-stage list's numbers (None: a stage without a delay); None if
    it holds none, or is not such a list."""
    if not isinstance(values, list):
        return None
    numbers = [v for v in values if _number(v) and math.isfinite(v)]
    return sum(numbers) / len(numbers) if numbers else None


@dataclass(frozen=True)
class Metrics:
    evals: tuple[EvalPoint, ...]  # by step
    measured: dict[str, tuple[tuple[int, float], ...]]  # by key, then step
    damaged: int  # lines skipped


def eval_metrics(folder: Path) -> Metrics:
    """The evaluations and the measures taken every N steps that the metrics.jsonl of
    ``folder`` records, and how many of its lines are damaged (skipped)."""
    lines = read_metrics(folder, "move it out of the run folder to report the run")
    damaged = lines.damaged
    points, measured = [], {key: [] for key in STEP_MEASURES}
    for record in lines.records:
        for key, values in measured.items():
            mean = stage_mean(record.get(key))
            if mean is not None and _number(record.get("step")):
                values.append((record["step"], mean))
        if "val_loss" not in record:
            continue
        fields = (record.get("step"), record["val_loss"], record.get("val_bpb"))
        if not all(map(_number, fields)):
            damaged += 1
            continue
        seconds = record.get("train_time_s", math.nan)
        seconds = seconds if _number(seconds) else math.nan
        points.append(EvalPoint(*fields, seconds, stage_mean(record.get(DRIFT))))
    by_step = {key: tuple(sorted(values)) for key, values in measured.items()}
    return Metrics(tuple(sorted(points, key=lambda p: p.step)), by_step, damaged)


def load_run(path: Path, summary: dict[str, Any]) -> tuple[RecordedRun, str | None]:
    """The run in ``path`` (whose summary is ``summary``), and a warning if some of its metrics
    lines are damaged."""
    metrics = eval_metrics(path)
    config = saved_config(path)
    try:  # a config.json that no longer builds is named here, not deep in a table
        result_settings(config)
    except ConfigError as exc:
        raise damaged_config(path, exc) from None
    run = RecordedRun(path, config, summary, metrics.evals, latest_scores(path), metrics.measured)
    if not metrics.damaged:
        return run, None
    return run, f"{RunFolder(path).metrics_path}: skipped {metrics.damaged} damaged line(s)"


def stopped_early(folder: Path, summary: dict[str, Any]) -> str | None:
    """Why the run in ``folder`` is not reported although it has a summary (None: it is, as
    finished or diverged)."""
    if stop_of(summary) in (FINISHED, NON_FINITE):
        return None
    return (
        f"skipped {folder}: stopped at step {summary.get('steps', '?')} "
        f"({summary.get('reason') or stop_of(summary)}); continue it with "
        f"nobubble train --resume {folder}"
    )


def run_folders(path: Path) -> list[Path]:
    """``path`` itself if it is a run folder, else every run folder below it (not inside runs)."""
    if is_run_folder(path):
        return [path]
    if not path.is_dir():
        return []
    found: list[Path] = []
    for child in sorted(p for p in path.iterdir() if p.is_dir()):
        found.extend(run_folders(child))
    return found


def discover(paths: list[Path]) -> tuple[list[RecordedRun], list[str]]:
    """Finished and diverged runs under ``paths``; a warning for each unfinished or duplicate one.

    A path that neither is a run folder nor holds one is an error (most likely a typo).
    """
    runs: list[RecordedRun] = []
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
            summary = read_summary(folder)
            if summary is None:
                warnings.append(f"skipped {folder}: unfinished (no summary.json)")
                continue
            skipped = stopped_early(folder, summary)
            if skipped:
                warnings.append(skipped)
                continue
            run, damaged = load_run(folder, summary)
            if damaged:
                warnings.append(damaged)
            identity = json.dumps(run.settings, sort_keys=True)
            if identity in seen:
                warnings.append(f"skipped {folder}: same settings and seed as {seen[identity]}")
                continue
            seen[identity] = folder
            runs.append(run)
    return runs, warnings


Filter = tuple[str, list[Any]]  # keep runs whose setting is one of these values


def parse_filter(text: str) -> Filter:
    """``KEY=V1,V2`` (values in config syntax) as a filter; ``ef=true|false`` (the old key)
    keeps the runs whose corrections do or do not include error feedback."""
    key, sep, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not values:
        raise ReportError(f"expected KEY=VALUE[,VALUE...], got {text!r} (e.g. optim=adamw,muon)")
    if key == OLD_EF:
        return key, [as_bool(key, v.strip()) for v in values.split(",")]
    return key, [coerce(key, v) for v in values.split(",")]


def matches(run: RecordedRun, filters: list[Filter]) -> bool:
    return all(setting(run, key) in values for key, values in filters)


def setting(run: RecordedRun, key: str) -> Any:
    """``run``'s setting ``key``; ``ef`` (the old key): whether its corrections include ``ef``."""
    if key == OLD_EF:
        return "ef" in names_in(run.settings["correction"])
    return run.settings[key]
