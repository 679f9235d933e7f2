"""Where a run trains and how torch is set up for it."""

from __future__ import annotations

import torch

from nobubble.config import ConfigError, TrainConfig


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda was requested but no CUDA device is available; use cpu")
    return torch.device(name)


def configure_torch(cfg: TrainConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
