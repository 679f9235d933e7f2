"""A planned run: its full config, its folder, and the state that folder is in.

A run is complete when its folder holds summary.json and a config.json with the same result
settings as planned (folder, threads and progress bar aside). Without a summary it is diverged if
the non-finite policy stopped it (:func:`~nobubble.reporting.runs.stopped_diverged`): done, like
a complete run, with an infinite loss; otherwise it is half-done: continued from its newest valid
checkpoint, or removed and run again if it has none. A folder
with any other content is never touched: the sweep stops and says which folder and which
settings differ.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from nobubble.config import TrainConfig
from nobubble.reporting.runs import final_loss, result_settings, stopped_diverged


class Status(enum.Enum):
    NEW = "run"
    PARTIAL = "rerun"  # half-done: continued from a checkpoint, else removed and run again
    COMPLETE = "skip"
    DIVERGED = "diverged"  # stopped by the non-finite policy: done, an infinite loss
    CONFLICT = "CONFLICT"

    @property
    def done(self) -> bool:
        return self in (Status.COMPLETE, Status.DIVERGED)


@dataclass(frozen=True)
class PlannedRun:
    phase: str
    name: str
    path: Path
    config: TrainConfig
    launcher: str

    @property
    def label(self) -> str:
        return f"{self.phase}/{self.name}" if self.phase else self.name

    @property
    def processes(self) -> int:
        return self.config.stages if self.launcher == "torchrun" else 1

    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    def status(self) -> Status:
        if not self.path.exists() or (self.path.is_dir() and not any(self.path.iterdir())):
            return Status.NEW
        if self.conflict() is not None:
            return Status.CONFLICT
        if self.summary_path.is_file():
            return Status.COMPLETE
        return Status.DIVERGED if stopped_diverged(self.path) else Status.PARTIAL

    def conflict(self) -> str | None:
        """Why the folder cannot hold this run, or None if it can."""
        stored_path = self.path / "config.json"
        if not stored_path.is_file():
            return f"{self.path} holds files but no config.json (not a run folder)"
        try:
            stored = result_settings(json.loads(stored_path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            return f"{stored_path} is unreadable: {exc}"
        planned = result_settings(self.config.to_dict())
        diffs = [
            f"{k}: folder has {stored[k]!r}, grid plans {planned[k]!r}"
            for k in planned
            if stored[k] != planned[k]
        ]
        return f"{self.path} holds a different run ({'; '.join(diffs)})" if diffs else None


LossOf = Callable[[PlannedRun], float | None]


def finished_loss(run: PlannedRun, failed: Collection[Path] = ()) -> float | None:
    """A complete run's final loss, inf for a diverged run or one in ``failed``, None for an
    unfinished one."""
    status = run.status()
    if status is Status.COMPLETE:
        return final_loss(json.loads(run.summary_path.read_text()))
    return math.inf if status is Status.DIVERGED or run.path in failed else None
