"""Opening a run folder to train into: a fresh run, an explicit resume, or an automatic one.

A resumed run continues from the newest checkpoint whose checksums verify (older ones are the
fallback when the newest is corrupt), with the saved configuration: only the fields in
``SAFE_TO_CHANGE`` may differ, everything else would make the continuation a different run.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from nobubble.checkpoint import CheckpointError, verify_checkpoint
from nobubble.config import FIELDS, ConfigError, TrainConfig, build_config
from nobubble.runfolder import RunFolder, default_run_dir, write_json_atomic

SAFE_TO_CHANGE = frozenset(
    {
        "steps", "eval_every", "eval_batches", "log_every", "checkpoint_every",
        "keep_checkpoints", "out", "name", "progress", "threads", "p2p_timeout_s",
        "nonfinite_patience", "device",
    }
)  # fmt: skip


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


def latest_valid_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint that verifies, warning about every newer one that does not."""
    for folder in sorted(root.glob("step_*"), reverse=True):
        try:
            verify_checkpoint(folder)
        except CheckpointError as exc:
            warnings.warn(f"{exc}; falling back to an older checkpoint", stacklevel=2)
            continue
        return folder
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


def open_run(
    cfg: TrainConfig, overwrite: bool = False, resume: bool = False, auto_resume: bool = False
) -> tuple[RunFolder, Path | None]:
    """Create the run folder, or reopen it to resume; return it and the checkpoint to load.

    ``resume``: the folder must hold a valid checkpoint. ``auto_resume``: resume if the folder
    holds this run with a valid checkpoint, else start it (over) from scratch.
    """
    path = Path(cfg.out) if cfg.out else default_run_dir(cfg)
    if resume or (auto_resume and (path / "config.json").is_file()):
        check_compatible(build_config(saved_config(path)), cfg, path)
        checkpoint = latest_valid_checkpoint(path / "checkpoints")
        if checkpoint is not None:
            run = RunFolder(path)
            write_json_atomic(run.config_path, cfg.to_dict())
            truncate_metrics(run, int(checkpoint.name.split("_")[1]))
            return run, checkpoint
        if resume:
            raise CheckpointError(
                f"{path} holds no complete checkpoint to resume from; start a new run instead "
                "(another --out, or --overwrite to replace this one)"
            )
        overwrite = True  # the same run, with nothing saved yet: start it over
    return RunFolder.create(cfg, overwrite=overwrite), None
