"""The one reader of a run folder: its configuration, summary, metrics, checkpoints and
tokenizer, for every command that looks into one (resuming, the sweep, the report, the bench, the
export, the evaluation, the fault campaign, the GPU check).

Any of its files may have been damaged since the run wrote it (cut short by a full disk or a hard
kill, overwritten, replaced by a folder, deleted): a damaged file is one line naming it and the
fix (:class:`~nobubble.json_files.DamagedFile`), never a traceback; a damaged line of
metrics.jsonl is skipped and counted. A configuration saved by an earlier version reads as it
was meant then (:func:`nobubble.config.from_saved`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nobubble.checkpoint.files import (
    MANIFEST,
    CheckpointError,
    checkpoint_folders,
    sha256,
    verify_checkpoint,
)
from nobubble.config import ConfigError, NobubbleWarning, TrainConfig, from_saved
from nobubble.configure import build_config
from nobubble.data.tokenizer import TOKENIZER_FILE
from nobubble.json_files import DamagedFile, read_json_lines, read_json_object
from nobubble.runfolder.folder import FINISHED, STOPS, RunFolder

# Where a run's settings are kept besides config.json (written by run/checkpoints.py).
CONFIG_COPY = 'a copy is in every checkpoint\'s shard_0/meta.json, under "config"'
CONFIG_FIX = f"it holds the run's settings: restore it ({CONFIG_COPY})"
SUMMARY_FIX = (
    "restore it, or delete it: the run then counts as unfinished (nobubble sweep trains it again)"
)
METRICS_FIX = "move it out of the run folder (a resumed run starts a new one)"


def is_run_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a run (its config.json)."""
    return RunFolder(folder).config_path.is_file()


def saved_config(folder: Path) -> dict[str, Any]:
    """The settings ``folder``'s config.json saved, a key it lacks as it was meant then;
    :class:`ConfigError` if ``folder`` is no run folder, :class:`DamagedFile` if it is damaged."""
    path = RunFolder(folder).config_path
    if not path.exists():
        raise ConfigError(f"{folder} is not a nobubble run folder (it has no config.json)")
    return from_saved(read_json_object(path, CONFIG_FIX))


def damaged_config(folder: Path, exc: ConfigError) -> DamagedFile:
    """The error for ``folder``'s config.json that reads but is refused with ``exc``."""
    return DamagedFile(f"{RunFolder(folder).config_path} is damaged: {exc}; {CONFIG_FIX}")


def saved_train_config(folder: Path) -> TrainConfig:
    """The configuration saved in ``folder``'s config.json, checked like any other."""
    saved = saved_config(folder)
    try:
        return build_config(saved)
    except ConfigError as exc:
        raise damaged_config(folder, exc) from None


def checkpoint_config(folder: Path, meta: dict[str, Any]) -> TrainConfig:
    """The configuration that the checkpoint whose shard 0 holds ``meta`` (its meta.json) was
    saved with; config.json's for a checkpoint without a copy. (config.json may already name a
    layout that no checkpoint was saved in yet.)"""
    saved = meta.get("config")
    return build_config(from_saved(saved)) if saved else saved_train_config(folder)


def stop_of(summary: dict[str, Any]) -> str:
    """Why the run of ``summary`` stopped (summaries from before it was recorded: finished)."""
    return summary.get("stopped", FINISHED)


def read_summary(folder: Path) -> dict[str, Any] | None:
    """summary.json of the run folder ``folder`` (None if it has none); :class:`DamagedFile`
    if it is damaged."""
    path = RunFolder(folder).summary_path
    if not path.exists():
        return None
    summary = read_json_object(path, SUMMARY_FIX)
    if stop_of(summary) not in STOPS:
        raise DamagedFile(
            f"{path} is damaged (stopped={stop_of(summary)!r}, not one of {', '.join(STOPS)}); "
            f"{SUMMARY_FIX}"
        )
    return summary


def has_summary(folder: Path) -> bool:
    """Whether the run in ``folder`` wrote its summary.json (whole or not)."""
    return RunFolder(folder).summary_path.exists()


@dataclass(frozen=True)
class MetricsLines:
    """The lines of metrics.jsonl that hold a JSON object, each as (its text, the object), and
    how many other lines there were (damaged: cut short by a hard kill, or garbage)."""

    lines: list[tuple[str, dict[str, Any]]]
    damaged: int

    @property
    def records(self) -> list[dict[str, Any]]:
        return [record for _, record in self.lines]


def read_metrics(folder: Path, fix: str = METRICS_FIX) -> MetricsLines:
    """metrics.jsonl of ``folder`` (no lines if it has none); :class:`DamagedFile` (with
    ``fix``) if it cannot be read at all."""
    return MetricsLines(*read_json_lines(RunFolder(folder).metrics_path, fix))


def has_metrics(folder: Path) -> bool:
    return RunFolder(folder).metrics_path.exists()


def checkpoints(folder: Path) -> list[Path]:
    """Every checkpoint folder of the run in ``folder``, oldest first (sealed or not)."""
    return checkpoint_folders(RunFolder(folder).checkpoints)


def sealed_checkpoints(folder: Path) -> list[Path]:
    """The run's complete checkpoints (with a manifest, not yet verified), oldest first."""
    return [c for c in checkpoints(folder) if (c / MANIFEST).is_file()]


def latest_valid_checkpoint(folder: Path) -> tuple[Path, dict] | None:
    """The run's newest checkpoint that verifies and its manifest (None: none does), warning
    about every newer one that does not."""
    for checkpoint in reversed(checkpoints(folder)):
        try:
            manifest = verify_checkpoint(checkpoint)
        except CheckpointError as exc:
            warnings.warn(
                f"{exc}; falling back to an older checkpoint", NobubbleWarning, stacklevel=2
            )
            continue
        return checkpoint, manifest
    return None


def tokenizer_path(folder: Path) -> Path:
    return folder / TOKENIZER_FILE


def tokenizer_digest(folder: Path) -> str | None:
    """The checksum of the run's tokenizer.json (None: it has none), which its checkpoints
    record."""
    path = tokenizer_path(folder)
    return sha256(path) if path.is_file() else None
