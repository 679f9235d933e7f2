"""``nobubble train``: a run in this process, or this rank's part of a torchrun launch."""

from __future__ import annotations

from pathlib import Path

from nobubble.config import TrainConfig
from nobubble.run.local import LocalLauncher
from nobubble.run.setup import train_with
from nobubble.run.torchrun import TorchrunLauncher, launched_by_torchrun


def train(
    cfg: TrainConfig, overwrite: bool = False, resume: bool = False, auto_resume: bool = False
) -> Path:
    """Train ``cfg`` to the end (the one-process engine; under torchrun, this rank's stage of
    the pipeline); return the run folder."""
    if not launched_by_torchrun():
        return train_with(LocalLauncher(cfg), cfg, overwrite, resume, auto_resume)
    with TorchrunLauncher(cfg) as launcher:
        return train_with(launcher, cfg, overwrite, resume, auto_resume)
