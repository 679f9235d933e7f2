"""Saving a run's checkpoint from an engine, and restoring an engine from one."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from nobubble.checkpoint.files import (
    CheckpointError,
    CheckpointReader,
    checkpoint_name,
    prune,
    publish,
    read_meta,
    staging_dir,
    write_shard,
)
from nobubble.checkpoint.named_state import NamedStateError
from nobubble.config import TrainConfig
from nobubble.data import DataBundle
from nobubble.engine import Engine
from nobubble.run.steplog import Elapsed
from nobubble.runfolder.folder import RunFolder
from nobubble.runfolder.reading import tokenizer_digest


def save_checkpoint(
    run: RunFolder,
    engine: Engine,
    data: DataBundle | None,
    cfg: TrainConfig,
    elapsed: Elapsed,
    lines: list[dict],
) -> None:
    """Replica 0 of every stage writes that stage's shard (the replicas of a stage hold the same
    weights, and the same optimizer state, or with ``zero`` > 0 parts of it that replica 0
    gathers; under tensor parallelism its tp index 0 writes, the split tensors gathered whole);
    the leader seals the checkpoint once all are written. ``lines``: the metrics lines of the
    step (the leader's), kept so that a resume can write them again if metrics.jsonl loses
    them."""
    root, layout = run.checkpoints, engine.layout
    state = engine.checkpoint_state()  # every replica: with sharded state, gathered on replica 0
    tensors = engine.checkpoint_tensors()  # every tp rank: split weights gathered whole
    if layout.replica == 0 and layout.tp_rank == 0:
        meta = {
            "step": engine.step,
            "data": data.train.state_dict() if data else None,
            # the leader's alone (shard 0, which a resume checks): no other rank reads run files
            "tokenizer_sha256": tokenizer_digest(run.path) if layout.is_leader else None,
            "config": cfg.to_dict(),
            "elapsed": asdict(elapsed),
            "metrics": lines,
        }
        with run.writing(staging_dir(root, engine.step)):
            write_shard(
                staging_dir(root, engine.step),
                layout.shard,
                tensors,
                state["step"],
                state["optimizer"],
                torch.get_rng_state(),
                meta,
            )
    engine.barrier()
    if layout.is_leader:
        with run.writing(root / checkpoint_name(engine.step)):
            publish(
                staging_dir(root, engine.step),
                root / checkpoint_name(engine.step),
                engine.step,
                layout.shards,
            )
            prune(root, cfg.keep_checkpoints)
    engine.barrier()


def restore_checkpoint(folder: Path | None, engine: Engine, data: DataBundle | None) -> Elapsed:
    """Load this process's parameters from a verified checkpoint (if any) into the engine, and
    the data position; return the time the run had spent up to it.

    The checkpoint may come from any layout (the one-process engine, another number of stages): the
    process reads its parameters by name from whichever shards hold them. Whether the layout may
    change at all was decided when the run was opened (:func:`nobubble.runfolder.resume.reopen`).
    """
    if folder is None:
        return Elapsed()
    reader = CheckpointReader(folder)
    names = {key.split("/", 1)[1] for key in engine.checkpoint_tensors()}  # this stage's
    try:
        loaded = reader.load(names, complete=engine.layout.shards == 1)
        engine.restore(loaded.weights, {"step": loaded.step, "optimizer": loaded.optimizer})
    except NamedStateError as exc:
        raise CheckpointError(f"cannot continue from {folder}: {exc}") from None
    torch.set_rng_state(reader.rng(engine.layout.shard))
    meta = read_meta(folder, 0)  # shard 0 is the first stage's, which always reads the data
    if data is not None:
        data.train.load_state_dict(meta["data"])
    return Elapsed(**meta.get("elapsed", {}))  # checkpoints older than "elapsed" count from 0
