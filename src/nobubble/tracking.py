"""Loggers beside metrics.jsonl: TensorBoard and Weights & Biases (``logger=...``).

Every scalar of a metrics line goes to each chosen logger at that line's step, under the same
name (``train_loss``, ``val_bpb``, ``mfu``, ...); a pipeline run adds per-process scalars where
they are measured (``stage{p}/idle_fraction``, ...: ``p`` is the process's pipeline rank, its
report's ``pp_rank``, under the name these scalars have always had). A metrics line's
per-model-stage lists of staleness (``weight_drift``, ``grad_cosine``) go as one scalar per
model stage s, ``weight_drift/model_stage{s}``. Only the leader opens a logger.

A resumed run continues the same logger runs: TensorBoard writes into the run folder's ``tb/``
and drops the events after the checkpoint (``purge_step``), as metrics.jsonl drops its lines;
W&B resumes the run whose id the run folder keeps in ``wandb.json``. The packages are imported
only when chosen, through :func:`nobubble.config.extras.require` (a missing one names its extra).
"""

from __future__ import annotations

import json
import re
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Protocol

from nobubble.config import ConfigError, NobubbleWarning, TrainConfig, chosen_loggers
from nobubble.config.extras import require
from nobubble.interrupt import Interrupted
from nobubble.json_files import write_json_atomic
from nobubble.stage_report import IDENTIFIERS, read_stage_report
from nobubble.staleness import PER_STAGE

TB_FOLDER = "tb"
WANDB_ID_FILE = "wandb.json"


def require_loggers(cfg: TrainConfig) -> None:
    """Fail before anything is written if a chosen logger's package is missing, or W&B online
    has no API key (the check reads the key where W&B keeps it: no network, no prompt)."""
    names = chosen_loggers(cfg)
    packages = {name: require(name, f"logger={name}") for name in names}  # module = logger
    online = "wandb" in names and cfg.wandb_mode == "online"
    if online and not packages["wandb"].login(verify=False, prompt=False):
        raise ConfigError(
            "logger=wandb with wandb_mode=online needs a W&B API key: run `wandb login` or "
            "set WANDB_API_KEY, or pass wandb_mode=offline (then `wandb sync` the run "
            "folder's wandb/offline-run-* folders later)"
        )


class Logger(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record ``scalars`` at ``step`` (steps never decrease; a step may come twice with
        different scalars: a metrics line, then the stages' measurements)."""

    def close(self, error: BaseException | None) -> None:
        """Write out everything; ``error``: what ends the run early, if anything."""


class Loggers:
    """The chosen loggers as one (none: every call does nothing)."""

    def __init__(self, loggers: list[Logger]) -> None:
        self.loggers = loggers

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if scalars:
            for logger in self.loggers:
                logger.log(step, scalars)

    def close(self, error: BaseException | None = None) -> None:
        """Close every logger; one that fails to is warned about (the run's own files, the
        summary among them, still get written)."""
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            try:
                logger.close(error)
            except Exception as exc:  # reported; the others are still closed
                warnings.warn(
                    f"could not close {type(logger).__name__}: {exc}", NobubbleWarning, stacklevel=2
                )


def open_loggers(cfg: TrainConfig, run_dir: Path, start: int) -> Loggers:
    """The loggers ``cfg.logger`` names, writing into ``run_dir``; ``start``: the step training
    continues from (0 for a new run): nothing was logged after it, or it is discarded."""
    opened: list[Logger] = []
    try:
        for name in chosen_loggers(cfg):
            maker = TensorBoardLogger if name == "tensorboard" else WandbLogger
            opened.append(maker(cfg, run_dir, start))
    except BaseException:
        Loggers(opened).close()
        raise
    return Loggers(opened)


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a metrics line, but its step (lists such as skipped_stages are
    not scalars), and each model stage's staleness measure as ``weight_drift/model_stage{s}``
    and ``grad_cosine/model_stage{s}`` (:mod:`nobubble.staleness`)."""
    scalars = {
        key: value
        for key, value in record.items()
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
    }
    for key in PER_STAGE:
        for stage, value in enumerate(record.get(key) or []):
            if value is not None:
                scalars[f"{key}/model_stage{stage}"] = value
    return scalars


def stage_scalars(reports: list[dict[str, Any]]) -> dict[str, float]:
    """Per-process scalars of the pipeline's stage reports: ``stage{p}/{measure}``, or
    ``stage{p}/replica{r}/{measure}`` with data parallelism, ``p`` being the pipeline rank
    (``pp_rank``; the names dashboards already know)."""
    reports = [read_stage_report(report) for report in reports]
    several = any(report["replica"] for report in reports)
    scalars = {}
    for report in reports:
        prefix = f"stage{report['pp_rank']}" + (f"/replica{report['replica']}" if several else "")
        measures = {k: v for k, v in report.items() if k not in IDENTIFIERS}
        scalars |= {f"{prefix}/{key}": value for key, value in scalars_of(measures).items()}
    return scalars


class TensorBoardLogger:
    """Event files in ``RUN/tb`` (``tensorboard --logdir RUN/tb``)."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        folder = run_dir / TB_FOLDER
        wait_for_a_later_name(folder)
        # a resumed run: the events of the steps after the checkpoint are hidden, as their
        # metrics lines are dropped (TensorBoard's readers honour purge_step)
        self.writer = SummaryWriter(str(folder), purge_step=start + 1 if start else None)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self, error: BaseException | None) -> None:
        self.writer.close()


def wait_for_a_later_name(folder: Path) -> None:
    """TensorBoard reads a folder's event files in name order, and a name starts with the second
    its file was made in: a resumed session's file must not share the second of an earlier one
    (which another process's id could then sort after it)."""
    stamps = [
        int(match.group(1))
        for path in folder.glob("events.out.tfevents.*")
        if (match := re.match(r"events\.out\.tfevents\.(\d+)\.", path.name))
    ]
    while stamps and int(time.time()) <= max(stamps):
        time.sleep(0.05)


class WandbLogger:
    """A W&B run in ``RUN/wandb``, its id kept in ``RUN/wandb.json`` so that a resumed run
    continues it (``resume="allow"``)."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, start: int) -> None:
        import wandb

        try:
            self.run = wandb.init(
                project=cfg.wandb_project,
                id=wandb_run_id(run_dir),
                name=run_dir.name,
                dir=str(run_dir),
                mode=cfg.wandb_mode,
                resume="allow",
                config=cfg.to_dict(),
                allow_val_change=True,  # a resume may change the safe keys (steps, logger, ...)
            )
        except wandb.errors.Error as exc:
            raise ConfigError(
                f"could not start the W&B run of {run_dir}: {exc}; pass wandb_mode=offline to "
                "log without the W&B server (no step was trained: a new run starts again with "
                "--overwrite, a resumed one with --resume)"
            ) from None
        # W&B keeps a step once logged (a run's history only grows): online, a resumed run
        # starts after the last step the server holds, which a crash may have left past the
        # checkpoint (offline it starts at 0: the offline run knows no server)
        self.first = self.run.starting_step

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if step >= self.first:
            self.run.log(scalars, step=step)

    def close(self, error: BaseException | None) -> None:
        if isinstance(error, Interrupted):
            self.run.mark_preempting()  # stopped on a signal with a checkpoint: to be resumed
        self.run.finish(exit_code=0 if error is None else 1)


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run id of this run folder (made and kept on first use)."""
    path = run_dir / WANDB_ID_FILE
    if path.is_file():
        return json.loads(path.read_text())["run_id"]
    run_id = uuid.uuid4().hex[:16]
    write_json_atomic(path, {"run_id": run_id})
    return run_id
