"""One setup for both launchers: open the run, build the data and the engine, restore, start.

A launcher (one process, :class:`nobubble.run.local.LocalLauncher`; or a rank of a torchrun
launch, :class:`nobubble.run.torchrun.TorchrunLauncher`) says how its processes share the setup;
the order of the setup is this module's alone. Nothing of a run folder changes until every
process is ready to train (a failed setup leaves it as it was).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from nobubble.config import ConfigError, TrainConfig
from nobubble.data import DataBundle
from nobubble.engine import Engine
from nobubble.hf.init import check_init_from, init_note, init_source, load_init_from
from nobubble.interrupt import stop_on_signals
from nobubble.model.partition import resolve_partition
from nobubble.model.presets import ModelConfig
from nobubble.model.resolve import model_config
from nobubble.profiling import profiled
from nobubble.run.checkpoints import restore_checkpoint
from nobubble.run.loop import run_training
from nobubble.runfolder.resume import open_run

T = TypeVar("T")


class Launcher(Protocol):
    """How the processes of a run share its setup."""

    is_leader: bool  # the process that opens the run folder, builds the data first and logs
    pipeline: bool  # several processes (their profiler traces are merged)
    restarted: bool  # torchrun restarted this process: the run resumes by itself

    def from_leader(self, make: Callable[[], T]) -> T:
        """``make()`` on the leader, its result (or its error) on every process."""

    def build_data(self, cfg: TrainConfig, run_dir: Path) -> tuple[DataBundle | None, int, int]:
        """This process's data (None where it needs none), the vocabulary size and the number
        of validation batches."""

    def engine(self, cfg: TrainConfig, mc: ModelConfig, val_batches: int) -> Engine:
        """This process's engine."""

    def barrier(self) -> None:
        """Wait for every process."""


def train_with(
    launcher: Launcher,
    cfg: TrainConfig,
    overwrite: bool = False,
    resume: bool = False,
    auto_resume: bool = False,
) -> Path:
    """Set the run up on every process of ``launcher``, train it to the end; return its folder."""
    with contextlib.ExitStack() as held:  # the leader locks the run folder until the end
        return _train(launcher, cfg, held, overwrite, resume, auto_resume or launcher.restarted)


def _train(
    launcher: Launcher,
    cfg: TrainConfig,
    held: contextlib.ExitStack,
    overwrite: bool,
    resume: bool,
    auto_resume: bool,
) -> Path:
    setup = None
    try:  # the leader opens the run (a new one in its setup folder); every process sets up
        setup = launcher.from_leader(lambda: open_run(cfg, held, overwrite, resume, auto_resume))
        data, vocab, val_batches = launcher.build_data(cfg, setup.work)
        mc = model_config(cfg, vocab)
        cfg = setup.cfg = resolve_partition(cfg, mc)  # partition=flops: the split, saved
        source = init_source(cfg, setup.checkpoint)
        if source:  # the leader checks (it has the tokenizer), every process loads its own
            launcher.from_leader(lambda: check_init_from(source, mc, data.tokenizer))
        engine = built(lambda: launcher.engine(cfg, mc, val_batches))
        before = restore_checkpoint(setup.checkpoint, engine, data)
        if source:
            load_init_from(engine, source)
        launcher.barrier()  # every process is ready: only now may the run folder change
        run = launcher.from_leader(setup.commit)
    except BaseException:
        if launcher.is_leader and setup is not None:
            setup.discard()
        raise
    if launcher.is_leader:
        print(f"run folder: {run.path}{resuming(setup.checkpoint)}{init_note(source)}", flush=True)
    with (
        stop_on_signals(announce=launcher.is_leader) as stop,
        profiled(cfg, run.path, engine, pipeline=launcher.pipeline),
    ):
        run_training(cfg, mc, run, data, engine, before, stop)
    launcher.barrier()  # nobody tears a process group down while a peer still talks to it
    return run.path


def built(make: Callable[[], Engine]) -> Engine:
    """``make()``, with a model too large for the device's memory refused in one line."""
    try:
        return make()
    except RuntimeError as exc:  # torch.OutOfMemoryError (CUDA) is one too
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if not isinstance(exc, torch.OutOfMemoryError) and "allocate" not in first:
            raise
        raise ConfigError(
            f"the model does not fit in memory ({first}); choose a smaller shape (d_model, "
            "n_layers, vocab_size, moe_experts) or spread it over more stages"
        ) from None


def resuming(checkpoint: Path | None) -> str:
    return f" (resuming {checkpoint.name})" if checkpoint else ""
