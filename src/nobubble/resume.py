"""Opening a run folder to train into: a new run, an explicit resume, or an automatic one.

A resumed run continues from the newest checkpoint whose checksums verify (older ones are the
fallback when the newest is corrupt), with the saved configuration: only the fields in
``SAFE_TO_CHANGE`` may differ, everything else would make the continuation a different run.

Opening checks everything it can up front and changes no file: the caller sets the run up in
``work``, then :meth:`commit` makes it the run (or :meth:`discard` undoes the setup). Nothing
here ever deletes a run it was asked to continue.
"""

from __future__ import annotations

import json
import os
import shlex
import warnings
from dataclasses import dataclass
from pathlib import Path

from nobubble.checkpoint import (
    CheckpointError,
    checkpoint_step,
    read_meta,
    sha256,
    verify_checkpoint,
)
from nobubble.config import FIELDS, ConfigError, TrainConfig, build_config
from nobubble.runfolder import NewRun, RunFolder, holds_files, run_path, write_json_atomic

SAFE_TO_CHANGE = frozenset(
    {
        "steps", "eval_every", "eval_batches", "log_every", "checkpoint_every",
        "keep_checkpoints", "out", "name", "progress", "threads", "p2p_timeout_s",
        "nonfinite_patience", "device",
    }
)  # fmt: skip


class RunFinished(Exception):
    """The run has trained all its steps already: there is nothing to do (not an error)."""


def saved_config(run_dir: Path) -> dict:
    path = run_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a nobubble run folder (it has no config.json)")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


def resumed_config(run_dir: Path, *layers: dict) -> TrainConfig:
    """The saved config of ``run_dir`` with ``layers`` applied, if they only change safe fields."""
    for layer in layers:
        out = layer.get("out")
        if out is not None and Path(out).resolve() != run_dir.resolve():
            raise ConfigError(
                f"--resume continues {run_dir} in place, so out={out} cannot apply; drop --out "
                "(to branch a run, copy its folder and resume the copy)"
            )
    saved = build_config(saved_config(run_dir))
    cfg = build_config(saved.to_dict(), *layers, {"out": str(run_dir)})
    check_compatible(saved, cfg, run_dir)
    return cfg


def check_compatible(saved: TrainConfig, cfg: TrainConfig, run_dir: Path) -> None:
    for key in FIELDS:
        old, new = getattr(saved, key), getattr(cfg, key)
        if key not in SAFE_TO_CHANGE and old != new:
            raise ConfigError(
                f"cannot continue {run_dir} with {key}={new!r}: the run was trained with "
                f"{key}={old!r}, and {key} cannot change within a run. Start a new run (another "
                f"--out) or keep {key}; only {', '.join(sorted(SAFE_TO_CHANGE))} may change"
            )


def latest_valid_checkpoint(root: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint that verifies and its manifest, warning about every newer one that
    does not."""
    for folder in sorted(root.glob("step_*"), reverse=True):
        try:
            manifest = verify_checkpoint(folder)
        except CheckpointError as exc:
            warnings.warn(f"{exc}; falling back to an older checkpoint", stacklevel=2)
            continue
        return folder, manifest
    return None


def truncate_metrics(run: RunFolder, step: int) -> None:
    """Drop metrics lines after ``step`` (the resumed run writes them again) and torn lines."""
    if not run.metrics_path.exists():
        return
    kept = []
    for line in run.metrics_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a hard kill
        if record.get("step", 0) <= step:
            kept.append(line)
    tmp = run.metrics_path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(run.metrics_path)


def tokenizer_digest(run_dir: Path) -> str | None:
    path = run_dir / "tokenizer.json"
    return sha256(path) if path.is_file() else None


def resume_command(run_dir: Path, shards: int) -> str:
    """The command that continues ``run_dir`` from a checkpoint of ``shards`` shards."""
    launcher = f"torchrun --nproc-per-node {shards} -m nobubble" if shards > 1 else "nobubble"
    return f"{launcher} train --resume {shlex.quote(str(run_dir))}"


def _processes(count: int) -> str:
    return f"the pipeline ({count} processes)" if count > 1 else "one process"


@dataclass
class Resumption:
    """A run to continue from ``checkpoint``, set up in place: the setup writes nothing, and
    :meth:`commit` updates config.json and metrics.jsonl for the continuation."""

    cfg: TrainConfig
    work: Path
    checkpoint: Path

    def commit(self) -> RunFolder:
        run = RunFolder(self.work)
        write_json_atomic(run.config_path, self.cfg.to_dict())
        truncate_metrics(run, checkpoint_step(self.checkpoint))
        return run

    def discard(self) -> None:
        """Nothing to undo."""


def reopen(cfg: TrainConfig, path: Path, world: int) -> Resumption:
    """Check that ``path`` holds this run and a checkpoint that ``world`` processes can load."""
    check_compatible(build_config(saved_config(path)), cfg, path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(
            f"cannot continue {path}: it is not writable (the run writes metrics and "
            "checkpoints into it); make it writable or copy it and resume the copy"
        )
    found = latest_valid_checkpoint(path / "checkpoints")
    if found is None:
        tried = len(list((path / "checkpoints").glob("step_*")))
        why = f"{tried} failed verification, see the warnings above" if tried else "it has none"
        raise CheckpointError(
            f"{path} holds no complete checkpoint to resume from ({why}); nothing was changed. "
            "Restore its checkpoints to continue it, start it over with --overwrite (which "
            "replaces the folder), or choose another --out"
        )
    checkpoint, manifest = found
    step = checkpoint_step(checkpoint)
    if step == cfg.steps:
        raise RunFinished(
            f"{path} is finished: it trained all {step} steps; nothing to do (pass a larger "
            "steps=N to train on)"
        )
    if step > cfg.steps:
        raise ConfigError(
            f"{path} has trained {step} steps, more than steps={cfg.steps}; pass steps={step} "
            "or more"
        )
    if manifest["shards"] != world:
        raise CheckpointError(
            f"{checkpoint} was saved by {_processes(manifest['shards'])} and this command runs "
            f"{_processes(world)}; a checkpoint cannot move between the two yet (it is not keyed "
            f"by parameter name). Continue it with: {resume_command(path, manifest['shards'])}"
        )
    if read_meta(checkpoint).get("tokenizer_sha256") != tokenizer_digest(path):
        raise CheckpointError(
            f"{path / 'tokenizer.json'} is not the tokenizer {checkpoint} was trained with; "
            "restore the run's original tokenizer.json"
        )
    return Resumption(cfg, path, checkpoint)


def open_run(
    cfg: TrainConfig,
    overwrite: bool = False,
    resume: bool = False,
    auto_resume: bool = False,
    world: int = 1,
) -> NewRun | Resumption:
    """Check up front and prepare the run to train, changing no file of an existing run.

    ``resume``: continue the run in ``cfg.out`` (it must have a valid checkpoint). ``auto_resume``:
    the same if that folder holds anything, else start a new run there. ``world``: the processes
    that will load the checkpoint (1, or the pipeline's stages). Raises :class:`RunFinished` when
    the run has trained all ``cfg.steps`` steps.
    """
    if auto_resume and not cfg.out:
        raise ConfigError(
            "--auto-resume needs --out: it continues the run in that folder (without --out "
            "every run gets a new one)"
        )
    path = run_path(cfg)
    if resume or (auto_resume and holds_files(path)):
        return reopen(cfg, path, world)
    return NewRun(cfg, path, overwrite)
