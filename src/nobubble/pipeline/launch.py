"""Start a pipeline run under torchrun: one process per stage, the same training loop on each.

Rank 0 (the first stage) creates the run folder and builds the data; the last stage then builds
the same data (reusing the tokenizer rank 0 saved); stages in between load no data at all.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed as dist

from nobubble.config import ConfigError, TrainConfig
from nobubble.data import DataBundle, build_data
from nobubble.interrupt import stop_on_signals
from nobubble.model import PRESETS, model_config
from nobubble.pipeline.process_group import (
    close_process_group,
    device_and_backend,
    open_process_group,
)
from nobubble.resume import open_run
from nobubble.runfolder import RunFolder
from nobubble.train import configure_torch, restore_checkpoint, run_training


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def check_world(cfg: TrainConfig, world: int) -> None:
    """Errors that must stop every rank before any work starts."""
    tied = PRESETS[cfg.preset].tie_embeddings if cfg.tie_embeddings is None else cfg.tie_embeddings
    if tied and world > 1:
        raise ConfigError(
            f"preset {cfg.preset!r} ties the head to the embedding, which must then live on one "
            "stage; set tie_embeddings=false to pipeline it over several stages"
        )
    if world != cfg.stages:
        raise ConfigError(
            f"torchrun started {world} processes but the config asks for stages={cfg.stages}; "
            f"run `torchrun --nproc-per-node {cfg.stages} ...` or pass --stages {world}"
        )


def _broadcast(value: object) -> object:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
    check_world(cfg, world)
    configure_torch(cfg)
    device, backend = device_and_backend(cfg)
    open_process_group(backend, device, rank, world, cfg.p2p_timeout_s)
    auto_resume = auto_resume or restarted_by_torchrun()
    try:
        opened = open_run(cfg, overwrite, resume, auto_resume) if rank == 0 else None
        path, checkpoint = _broadcast(
            (str(opened[0].path), opened[1] and str(opened[1])) if opened else None
        )
        run, checkpoint = RunFolder(Path(path)), checkpoint and Path(checkpoint)
        try:
            data, vocab, val_batches = build_stage_data(cfg, run.path, rank, world)
            engine = PipelineEngine(cfg, model_config(cfg, vocab), device, val_batches)
            if checkpoint is not None:
                restore_checkpoint(checkpoint, run, engine, data)
        except BaseException:
            if rank == 0 and checkpoint is None:
                shutil.rmtree(run.path, ignore_errors=True)
            raise
        if rank == 0:
            resuming = f" (resuming {checkpoint.name})" if checkpoint else ""
            print(f"run folder: {run.path}{resuming}", flush=True)
        dist.barrier()
        with stop_on_signals(announce=rank == 0) as stop:
            run_training(cfg, run, data, engine, stop)
        dist.barrier()  # nobody tears the group down while a peer still talks to it
        return run.path
    finally:
        close_process_group()
