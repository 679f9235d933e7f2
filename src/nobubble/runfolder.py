"""The run folder: config.json, metrics.jsonl, summary.json, tokenizer and checkpoints.

A new run is set up in a hidden folder next to its run folder and moved into place only once it
is ready to start (:class:`NewRun`): a setup that fails, or is killed, leaves the run folder as
it was (absent, empty, or under ``--overwrite`` the old run).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shlex
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from nobubble.config import ConfigError, TrainConfig
from nobubble.corrections.registry import chosen


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON to ``path`` so that readers see the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def run_name(cfg: TrainConfig) -> str:
    """``name``, or one made of the settings that tell runs apart (preset, optimizer, schedule,
    corrections, stages, dp, seed)."""
    if cfg.name:
        return cfg.name
    corrections = "".join(f"-{name}" for name in chosen(cfg))
    dp = f"-dp{cfg.dp}" if cfg.dp > 1 else ""
    return f"{cfg.preset}-{cfg.optim}-{cfg.schedule}{corrections}-p{cfg.stages}{dp}-s{cfg.seed}"


def default_run_dir(cfg: TrainConfig) -> Path:
    return Path("runs") / f"{run_name(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_path(cfg: TrainConfig) -> Path:
    return Path(cfg.out) if cfg.out else default_run_dir(cfg)


def holds_files(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


class RunFolder:
    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @classmethod
    def create(cls, cfg: TrainConfig, overwrite: bool = False) -> RunFolder:
        """Make a new run folder at once (for callers with nothing to set up first)."""
        return NewRun(cfg, run_path(cfg), overwrite).commit()

    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json_atomic(self.summary_path, summary)


def _beside(full: Path, kind: str) -> Path:
    """A hidden folder next to ``full`` on the same file system, private to this process."""
    return full.parent / f".{full.name}.{kind}-{os.getpid()}"


class NewRun:
    """A new run being set up in a hidden folder beside ``path`` (``work``).

    Nothing at ``path`` changes until :meth:`commit` moves the set-up run there: into an absent or
    empty folder, or under ``overwrite`` in place of the old run (moved aside, then deleted).
    :meth:`discard` removes only what this setup made.
    """

    checkpoint: Path | None = None  # a new run starts from scratch

    def __init__(self, cfg: TrainConfig, path: Path, overwrite: bool = False) -> None:
        self.cfg, self.path, self.full = cfg, path, Path(os.path.abspath(path))
        check_can_make(path, self.full)
        self.replaces = holds_files(self.full)
        if self.replaces and not overwrite:
            raise ConfigError(
                f"run folder {path} already holds files; choose another --out, continue it "
                f"with --resume {path}, or pass --overwrite to replace it"
            )
        if self.replaces and not (self.full / "config.json").is_file():
            raise ConfigError(
                f"{path} holds files but is not a nobubble run folder (it has no config.json); "
                "--overwrite only replaces run folders: choose another --out"
            )
        self.made = [p for p in self.full.parents if not p.exists()]  # nearest first
        self.full.parent.mkdir(parents=True, exist_ok=True)
        self.work = _beside(self.full, "new")
        self.work.mkdir()
        self.committed = False

    def commit(self) -> RunFolder:
        """Move the set-up run to ``path``; a failure puts everything back as it was."""
        write_json_atomic(self.work / "config.json", self.cfg.to_dict())
        aside = _beside(self.full, "old")
        try:
            if self.replaces:
                os.rename(self.full, aside)
            try:
                os.rename(self.work, self.full)  # replaces an empty folder too
            except OSError:
                if self.replaces:
                    os.rename(aside, self.full)
                raise
        except OSError as exc:
            raise ConfigError(f"cannot move the new run into {self.path}: {exc}") from None
        self.committed = True
        if self.replaces:
            try:
                shutil.rmtree(aside)
            except OSError as exc:
                warnings.warn(f"could not delete the replaced run {aside}: {exc}", stacklevel=2)
        return RunFolder(self.path)

    def discard(self) -> None:
        """Remove the setup folder and the parent folders made for it (if still empty)."""
        if self.committed:
            return
        shutil.rmtree(self.work)
        for folder in self.made:
            with contextlib.suppress(OSError):
                folder.rmdir()


def check_can_make(path: Path, full: Path) -> None:
    """Refuse, before any work, a run folder that cannot be made at ``path`` (``full``).

    Also refuse while an ``--overwrite`` of ``path`` that was cut short between its two renames
    has left the old run aside: the user decides what to keep.
    """
    existing = next(p for p in (full, *full.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(
            f"cannot make run folder {path}: {existing} is a file, not a folder; choose another "
            "--out"
        )
    writable = full.parent if existing == full else existing
    if not os.access(writable, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot make run folder {path}: {writable} is not writable")
    moved_aside = f".{glob.escape(full.name)}.old-*"
    asides = [] if existing == full else sorted(full.parent.glob(moved_aside))
    if asides:
        raise ConfigError(
            f"{path} is missing and {asides[0]} holds the run that an --overwrite was replacing "
            f"when it was cut short; put it back with `mv {shlex.quote(str(asides[0]))} "
            f"{shlex.quote(str(path))}` (or delete it), then run this command again"
        )
