"""The downstream scores a run folder keeps: ``downstream/step_NNNNNN.json``, one per evaluation
of ``nobubble eval`` (:mod:`nobubble.downstream`), read back by ``nobubble report``.

A score file is written once and never replaced: another evaluation of the same checkpoint goes
to ``step_NNNNNN-2.json`` (then ``-3``, ...). The file is written under a hidden name and then
hard-linked to the first free final name; a link never replaces a file, so two evaluations
finishing at once both keep their results, and a reader sees a whole file or none.

Contents (``format`` 1)::

    format, step, version   the checkpoint's step and the weight version evaluated
    tasks                   the task names asked for
    headline                the names the results are reported under: the tasks and groups asked
                            for (a tag, such as ai2_arc, stands for its tasks)
    results                 {name: {alias, n_shot, samples, metrics: {metric: {value, stderr}}}}
                            for every task and group evaluated (a group's subtasks too)
    settings                num_fewshot, limit, batch_size, device, include_path
    versions                nobubble, lm_eval, transformers, torch; task_versions by task
    eval_s, date            how long the evaluation took, and when it finished (UTC)

``metric`` is lm-eval's metric name (``acc``, ``acc_norm``), followed by `` (filter)`` for a
filter other than ``none``; ``stderr`` is null where lm-eval gives none. ``samples`` is the number
of examples scored (fewer than the task has under ``limit``; null for a group).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nobubble.config import ConfigError
from nobubble.json_files import damaged, read_json_object
from nobubble.runfolder.folder import RunFolder

FORMAT = 1
_NAME = re.compile(r"step_(\d+)(?:-(\d+))?\.json")
FIX = "move it out of the run folder's downstream/ folder"


def score_files(run_dir: Path) -> list[Path]:
    """The score files of ``run_dir``, oldest first (by step, then by evaluation)."""
    folder = RunFolder(run_dir).scores
    if not folder.is_dir():
        return []
    found = [(m, p) for p in folder.iterdir() if (m := _NAME.fullmatch(p.name))]
    found.sort(key=lambda mp: (int(mp[0][1]), int(mp[0][2] or 1)))
    return [path for _, path in found]


def write_scores(run_dir: Path, record: Mapping[str, Any]) -> Path:
    """Write ``record`` (of checkpoint step ``record["step"]``) as a new score file of
    ``run_dir``; return its path. Never replaces a file."""
    folder = RunFolder(run_dir).scores
    folder.mkdir(exist_ok=True)
    tmp = folder / f".step_{record['step']:06d}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(record, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    try:
        for number in range(1, 10_000):
            suffix = "" if number == 1 else f"-{number}"
            path = folder / f"step_{record['step']:06d}{suffix}.json"
            try:
                os.link(tmp, path)
            except FileExistsError:
                continue
            return path
        raise ConfigError(f"{folder} holds 9,999 score files of step {record['step']}")
    finally:
        tmp.unlink()


@dataclass(frozen=True)
class Column:
    """What a score measures: comparable across runs only when all four agree."""

    task: str
    metric: str
    n_shot: int | None
    limit: int | None  # evaluated on the first ``limit`` examples only

    @property
    def label(self) -> str:
        parts = [f"{self.task} {self.metric}"]
        if self.n_shot:
            parts.append(f"{self.n_shot}-shot")
        if self.limit is not None:
            parts.append(f"first {self.limit}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Score:
    value: float
    stderr: float | None
    step: int


def _read(path: Path) -> dict[str, Any]:
    record = read_json_object(path, FIX)
    if record.get("format") != FORMAT:
        problem = f"is not a score file of format {FORMAT} (written by `nobubble eval`)"
        raise damaged(path, problem, FIX)
    return record


def scores_of(record: Mapping[str, Any]) -> dict[Column, Score]:
    """The headline scores of one score file, by column."""
    limit = record["settings"].get("limit")
    out: dict[Column, Score] = {}
    for name in record["headline"]:
        result = record["results"][name]
        for metric, score in result["metrics"].items():
            column = Column(name, metric, result.get("n_shot"), limit)
            out[column] = Score(score["value"], score.get("stderr"), record["step"])
    return out


def latest_scores(run_dir: Path) -> dict[Column, Score]:
    """Each column's score from the newest checkpoint evaluated for it (the latest evaluation,
    if that checkpoint was evaluated more than once); empty for a run never evaluated."""
    out: dict[Column, Score] = {}
    for path in score_files(run_dir):
        try:
            out.update(scores_of(_read(path)))  # oldest first: newer ones win
        except (KeyError, TypeError, AttributeError) as exc:
            problem = f"is damaged (no {exc} where `nobubble eval` writes one)"
            raise damaged(path, problem, FIX) from None
    return out
