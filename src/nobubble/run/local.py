"""Training in one process: the one-process engine, and a setup nobody else shares."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from nobubble.config import TrainConfig
from nobubble.data import DataBundle, build_data
from nobubble.device import configure_torch, resolve_device
from nobubble.engine import Engine
from nobubble.model.presets import ModelConfig
from nobubble.one_process import OneProcessEngine

T = TypeVar("T")


def dp_note(dp: int, zero: int = 0) -> str:
    """What ``dp`` (and ``zero``) mean in one process: nothing to split, the same run."""
    sharded = f" with zero={zero}" if zero else ""
    return (
        f"nobubble: note: dp={dp}{sharded} in one process: the one-process engine computes every "
        f"microbatch whole and holds the whole optimizer state, which is what {dp} replicas "
        "compute together (equal up to the order of summation, docs/pipeline.md); launch "
        "stages x dp processes with torchrun to split it"
    )


class LocalLauncher:
    """The setup of a run in this process alone (:class:`nobubble.run.setup.Launcher`)."""

    is_leader = True
    pipeline = False
    restarted = False

    def __init__(self, cfg: TrainConfig) -> None:
        configure_torch(cfg)
        self.device = resolve_device(cfg.device)
        if cfg.dp > 1:
            print(dp_note(cfg.dp, cfg.zero), file=sys.stderr, flush=True)

    def from_leader(self, make: Callable[[], T]) -> T:
        return make()

    def build_data(self, cfg: TrainConfig, run_dir: Path) -> tuple[DataBundle, int, int]:
        data = build_data(cfg, run_dir)
        return data, data.tokenizer.vocab_size, len(data.val)

    def engine(self, cfg: TrainConfig, mc: ModelConfig, val_batches: int) -> Engine:
        return OneProcessEngine(cfg, mc, self.device)

    def barrier(self) -> None:
        """Nobody to wait for."""
