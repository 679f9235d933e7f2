"""Start a pipeline run under torchrun: one process per stage, the same training loop on each.

Rank 0 (the first stage) opens the run (a new one is set up in a folder beside its run folder)
and builds the data; the last stage then builds the same data (reusing the tokenizer rank 0 saved
there); stages in between load no data at all. The run folder changes only once every stage is set
up.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from nobubble.config import ConfigError, TrainConfig
from nobubble.data import DataBundle, build_data
from nobubble.interrupt import stop_on_signals
from nobubble.model import model_config
from nobubble.pipeline.process_group import (
    close_process_group,
    device_and_backend,
    open_process_group,
)
from nobubble.resume import open_run
from nobubble.train import (
    configure_torch,
    restore_checkpoint,
    resuming,
    run_training,
)

T = TypeVar("T")


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def check_world(cfg: TrainConfig, world: int, rank: int) -> None:
    """Errors that must stop every rank before any work starts (the config itself is valid)."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts and not cfg.out:
        raise ConfigError(
            "torchrun --max-restarts resumes a restarted run from its folder, so it needs --out"
        )
    if world != cfg.stages:
        raise ConfigError(
            f"torchrun started {world} processes but the config asks for stages={cfg.stages}; "
            f"run `torchrun --nproc-per-node {cfg.stages} ...` or pass --stages {world}"
        )
    if restarts and not cfg.checkpoint_every and rank == 0:
        print(
            "nobubble: warning: torchrun --max-restarts with checkpoint_every=0: a restart "
            "resumes from the newest checkpoint, and this run saves one only at the end, so a "
            "worker that fails before then ends the job; set checkpoint_every=N",
            file=sys.stderr,
            flush=True,
        )


def _broadcast(value: object) -> object:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _from_rank0(rank: int, make: Callable[[], T]) -> T:
    """``make()`` on rank 0, shared with every rank; whatever it raises is raised on every rank
    (so that no stage waits for a result that will never come)."""
    outcome: object = None
    if rank == 0:
        try:
            outcome = make()
        except Exception as exc:  # raised again below, on every rank
            outcome = exc
    outcome = _broadcast(outcome)
    if isinstance(outcome, Exception):
        raise outcome
    return outcome  # type: ignore[return-value]


def build_stage_data(
    cfg: TrainConfig, run_dir: Path, rank: int, world: int
) -> tuple[DataBundle | None, int, int]:
    """This stage's data (first and last stage only), the vocabulary size and the number of
    validation batches (both known on every rank).

    Rank 0 builds first, training or loading the tokenizer and saving it into ``run_dir``; the
    last stage then builds the same data with that tokenizer.
    """
    data = build_data(cfg, run_dir) if rank == 0 else None
    vocab, val_batches = _broadcast((data.tokenizer.vocab_size, len(data.val)) if data else None)
    if rank == world - 1 and rank != 0:
        data = build_data(cfg, run_dir)
    return data, vocab, val_batches


def restarted_by_torchrun() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def train_pipeline(
    cfg: TrainConfig, overwrite: bool = False, resume: bool = False, auto_resume: bool = False
) -> Path:
    """Run this process's stage of the pipeline to the end; return the run folder.

    After a torchrun restart (``--max-restarts``) the run resumes from its newest valid
    checkpoint by itself.
    """
    from nobubble.pipeline.runtime import PipelineEngine

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    check_world(cfg, world, rank)
    configure_torch(cfg)
    device, backend = device_and_backend(cfg)
    open_process_group(backend, device, rank, world, cfg.p2p_timeout_s)
    auto_resume = auto_resume or restarted_by_torchrun()
    try:
        setup = None
        try:  # rank 0 opens the run (a new one in its setup folder); every stage sets up
            setup = _from_rank0(rank, lambda: open_run(cfg, overwrite, resume, auto_resume, world))
            data, vocab, val_batches = build_stage_data(cfg, setup.work, rank, world)
            engine = PipelineEngine(cfg, model_config(cfg, vocab), device, val_batches)
            before = restore_checkpoint(setup.checkpoint, engine, data)
            dist.barrier()  # every stage is ready: only now may the run folder change
            run = _from_rank0(rank, setup.commit)
        except BaseException:
            if rank == 0 and setup is not None:
                setup.discard()
            raise
        if rank == 0:
            print(f"run folder: {run.path}{resuming(setup.checkpoint)}", flush=True)
        with stop_on_signals(announce=rank == 0) as stop:
            run_training(cfg, run, data, engine, before, stop)
        dist.barrier()  # nobody tears the group down while a peer still talks to it
        return run.path
    finally:
        close_process_group()
