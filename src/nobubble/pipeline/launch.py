"""Start a pipeline run under torchrun: one process per stage, the same training loop on each.

Rank 0 (the first stage) creates the run folder and builds the data; the last stage then builds
the same data (reusing the tokenizer rank 0 saved); stages in between load no data at all.
"""

from __future__ import annotations

import datetime
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from nobubble.config import ConfigError, TrainConfig
from nobubble.data import DataBundle, build_data
from nobubble.model import model_config
from nobubble.runfolder import RunFolder
from nobubble.train import configure_torch, resolve_device, run_training


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def check_world(cfg: TrainConfig, world: int) -> None:
    """Errors that must stop every rank before any work starts."""
    if world != cfg.stages:
        raise ConfigError(
            f"torchrun started {world} processes but the config asks for stages={cfg.stages}; "
            f"run `torchrun --nproc-per-node {cfg.stages} ...` or pass --stages {world}"
        )


def _broadcast(value: object) -> object:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _device(cfg: TrainConfig) -> tuple[torch.device, str]:
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local), "nccl"
    return device, "gloo"


def train_pipeline(cfg: TrainConfig, overwrite: bool = False) -> Path:
    """Run this process's stage of the pipeline to the end; return the run folder."""
    from nobubble.pipeline.runtime import PipelineEngine

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    check_world(cfg, world)
    configure_torch(cfg)
    device, backend = _device(cfg)
    timeout = datetime.timedelta(seconds=cfg.p2p_timeout_s)
    dist.init_process_group(
        backend, timeout=timeout, device_id=device if backend == "nccl" else None
    )
    try:
        run_path = Path(
            _broadcast(str(RunFolder.create(cfg, overwrite).path) if rank == 0 else None)
        )
        run = RunFolder(run_path)
        data: DataBundle | None = None
        try:
            if rank == 0:
                data = build_data(cfg, run.path)
            shape = _broadcast((data.tokenizer.vocab_size, len(data.val)) if rank == 0 else None)
            if rank == world - 1 and rank != 0:
                data = build_data(cfg, run.path)
            vocab, val_batches = shape
            engine = PipelineEngine(cfg, model_config(cfg, vocab), device, val_batches)
        except BaseException:
            if rank == 0:
                shutil.rmtree(run.path, ignore_errors=True)
            raise
        if rank == 0:
            print(f"run folder: {run.path}")
        dist.barrier()
        run_training(cfg, run, data, engine)
        return run.path
    finally:
        dist.destroy_process_group()
