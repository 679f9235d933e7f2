"""A planned run: its full config, its folder, and the state that folder is in.

A run is complete when its folder holds a config.json with the same result settings as planned
(folder, threads and progress bar aside; a key the folder's config.json lacks means what it
meant when the run was saved, and a split planned by ``partition=flops`` is the one the run
resolved and saved) and a summary.json saying it finished; diverged when the
summary says the non-finite policy stopped it: done, like a complete run, with an infinite loss.
Otherwise (no summary, or one of a run stopped by a signal or an error) it is half-done:
continued from its newest valid checkpoint, or, with none to continue from, moved aside and run
again (:mod:`nobubble.sweeping.launch`). A folder with any other content (no run, another run,
a damaged config.json or summary.json) is never touched: the sweep stops and says which folder
and what is wrong.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nobubble.config import TrainConfig
from nobubble.json_files import DamagedFile
from nobubble.model.partition import split_by_flops
from nobubble.reporting.runs import final_loss, result_settings
from nobubble.runfolder.folder import FINISHED, NON_FINITE
from nobubble.runfolder.reading import is_run_folder, read_summary, saved_config, stop_of


class Status(enum.Enum):
    NEW = "run"
    PARTIAL = "rerun"  # half-done: continued from a checkpoint, else moved aside and run again
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

    def status(self) -> Status:
        if not self.path.exists() or (self.path.is_dir() and not any(self.path.iterdir())):
            return Status.NEW
        if self.conflict() is not None:
            return Status.CONFLICT
        stopped = self.stopped()
        if stopped == FINISHED:
            return Status.COMPLETE
        return Status.DIVERGED if stopped == NON_FINITE else Status.PARTIAL

    def summary(self) -> dict[str, Any] | None:
        return read_summary(self.path)

    def stopped(self) -> str | None:
        """Why the run stopped, as its summary says (None: it has none)."""
        summary = self.summary()
        return None if summary is None else stop_of(summary)

    def conflict(self) -> str | None:
        """Why the folder cannot hold this run, or None if it can."""
        if not is_run_folder(self.path):
            return f"{self.path} holds files but no config.json (not a run folder)"
        try:
            stored = result_settings(saved_config(self.path))
            self.summary()
        except DamagedFile as exc:
            return str(exc)
        planned = result_settings(self.config.to_dict())
        if split_by_flops(self.config):  # the run saved the split the rule gave it
            planned["stage_layers"] = stored["stage_layers"]
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
    summary = run.summary()
    if status is Status.COMPLETE and summary is not None:
        return final_loss(summary)
    return math.inf if status is Status.DIVERGED or run.path in failed else None
