"""The run folder: where it is, the names of its files, and how a run writes them (the one
reader: :mod:`nobubble.runfolder.reading`; a new one: :mod:`nobubble.runfolder.new`).

summary.json says why the run stopped (``stopped``, one of :data:`STOPS`): a run that trained
all its steps, and one that stopped early on a signal, on non-finite losses or on an error.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nobubble.config import ConfigError, TrainConfig
from nobubble.corrections.registry import chosen
from nobubble.json_files import write_json_atomic

# Why a run stopped, as summary.json records it under "stopped".
FINISHED = "finished"  # it trained all its steps
SIGNAL = "signal"  # SIGTERM or Ctrl-C: it saved a checkpoint and can be resumed
NON_FINITE = "non-finite"  # the non-finite policy stopped it (nonfinite_patience): diverged
ERROR = "error"  # an error stopped it (its message is in "reason")
STOPS = (FINISHED, SIGNAL, NON_FINITE, ERROR)

# The files of a run folder (its tokenizer: ``nobubble.data.tokenizer.TOKENIZER_FILE``). They
# are named here and read in :mod:`nobubble.runfolder.reading` alone.
CONFIG = "config.json"  # the run's resolved settings
METRICS = "metrics.jsonl"  # one JSON object a line: every step's, every evaluation's
SUMMARY = "summary.json"  # why the run stopped, its final figures
CHECKPOINTS = "checkpoints"  # step_NNNNNN folders (nobubble.checkpoint.files)
SCORES = "downstream"  # the scores of `nobubble eval` (nobubble.runfolder.scores)


def run_name(cfg: TrainConfig) -> str:
    """``name``, or one made of the settings that tell runs apart (preset, optimizer, schedule,
    corrections, stages, dp, seed)."""
    if cfg.name:
        return cfg.name
    corrections = "".join(f"-{name}" for name in chosen(cfg))
    dp = f"-dp{cfg.dp}" if cfg.dp > 1 else ""
    return f"{cfg.preset}-{cfg.optim}-{cfg.schedule}{corrections}-p{cfg.stages}{dp}-s{cfg.seed}"


def default_run_dir(cfg: TrainConfig) -> Path:
    name = run_name(cfg)
    if "/" in name or "\0" in name:
        raise ConfigError(
            f"name={name!r} is not a plain folder name: without --out the run folder is "
            "runs/<name>-<time>, so the name may not hold '/'; give a name without one, or "
            "choose the folder with --out"
        )
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_path(cfg: TrainConfig) -> Path:
    return Path(cfg.out) if cfg.out else default_run_dir(cfg)


def holds_files(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


# What frees a write that failed with these errors; any other: "fix that".
_FIXES = {
    errno.ENOSPC: "free space on its disk",
    errno.EDQUOT: "free space (the disk quota is full)",
    errno.EROFS: "make it writable",
    errno.EACCES: "make it writable",
    errno.EPERM: "make it writable (chattr -i, if it was made immutable)",
}


class RunWriteError(RuntimeError):
    """A write into the run folder ``run`` failed (a full disk, a read-only folder): the one
    line a run ends with (:meth:`RunFolder.writing` is the one place that makes it).

    ``after``: what the leader adds once it knows more (whether summary.json could still be
    written, the command that continues the run)."""

    def __init__(self, run: Path, target: Path, exc: OSError) -> None:
        super().__init__(run, target, exc)
        self.run, self.target, self.errno = run, target, exc.errno
        problem = os.strerror(exc.errno) if exc.errno else str(exc)
        self.problem = problem[:1].lower() + problem[1:]
        self.after = ""

    def __str__(self) -> str:
        fix = _FIXES.get(self.errno, "fix that")
        return (
            f"cannot write {self.target}: {self.problem}; the run stopped (everything written "
            f"before is intact): {fix}, then continue it from its newest checkpoint"
            f"{self.after}"
        )


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to the file ``fd``."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class RunFolder:
    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS

    @property
    def summary_path(self) -> Path:
        return self.path / SUMMARY

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def scores(self) -> Path:
        return self.path / SCORES

    @contextlib.contextmanager
    def writing(self, target: Path) -> Iterator[None]:
        """Writes into the run folder (to ``target``, or the file the error names): an
        :class:`OSError` of theirs becomes a :class:`RunWriteError`."""
        try:
            yield
        except OSError as exc:
            failed = Path(exc.filename) if isinstance(exc.filename, str) else target
            raise RunWriteError(self.path, failed, exc) from None

    def append_metrics(self, record: dict[str, Any]) -> None:
        """Append a line to metrics.jsonl; a write that fails leaves the file as it was (a part
        of the line written before, say on a full disk, is cut off again)."""
        with self.writing(self.metrics_path):
            fd = os.open(self.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                size = os.fstat(fd).st_size
                try:
                    write_all(fd, (json.dumps(record) + "\n").encode())
                except OSError:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, size)
                    raise
            finally:
                os.close(fd)

    def write_config(self, cfg: TrainConfig) -> None:
        write_json_atomic(self.config_path, cfg.to_dict())

    def write_summary(self, summary: dict[str, Any]) -> None:
        with self.writing(self.summary_path):
            write_json_atomic(self.summary_path, summary)
