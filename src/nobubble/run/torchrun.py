"""Training under torchrun: one process per stage and replica, the layout from torchrun's
environment, and a setup that the leader leads.

The layout (:mod:`nobubble.layout`) says which stage (or, interleaved, which model stages) each
process runs. Its leader (the first stage of replica 0) opens the run (a new one is set up in a
folder beside its run folder) and builds the data; the last stage then builds the same data from
the data source with the tokenizer the leader sends it (setting up a new run, no rank but the
leader touches the run folder: nodes share no files but the run folder, where every rank writes
its checkpoint shard and, on a resume, reads it back); stages in between load no data at all. The
run folder changes only once every stage is set up (:func:`nobubble.run.setup.train_with`).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import NoReturn, TypeVar

import torch.distributed as dist

from nobubble.config import ConfigError, TrainConfig
from nobubble.data import DataBundle, build_data
from nobubble.data.errors import DataError
from nobubble.data.tokenizer import tokenizer_from_json
from nobubble.device import configure_torch
from nobubble.engine import Engine
from nobubble.interrupt import Interrupted
from nobubble.layout import ParallelLayout, V, stage_groups
from nobubble.model.presets import ModelConfig
from nobubble.pipeline.links import resolve_links
from nobubble.pipeline.process_group import (
    abort_process_group,
    close_process_group,
    device_and_backend,
    open_process_group,
)
from nobubble.pipeline.replicas import peer_failures
from nobubble.pipeline.runtime import PipelineEngine
from nobubble.run.telling import Told, tell
from nobubble.runfolder.resume import RunFinished
from nobubble.schedules.registry import schedule_spec

T = TypeVar("T")

# How a run ends on every rank at once, with nothing posted and pending: its process group
# closes gracefully. Any other exception ends it with an abort (:func:`tell_and_abort`).
ENDED_TOGETHER = (Interrupted, RunFinished)


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def launch_layout(cfg: TrainConfig) -> ParallelLayout:
    """This process's layout, from torchrun's environment."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    chunks = cfg.chunks
    if chunks > 1 and cfg.stages == 1:
        raise ConfigError(
            f"{cfg.schedule} with stages=1 puts all {chunks} model stages on one process, which "
            "gains nothing from interleaving; use stages >= 2 (processes), or train without "
            "torchrun (the one-process engine runs the same semantics)"
        )
    placement = schedule_spec(cfg.schedule).placement
    return ParallelLayout.from_world(cfg.stages, cfg.dp, rank, world, chunks, placement, cfg.tp)


def check_launch(cfg: TrainConfig, layout: ParallelLayout) -> None:
    """Errors that must stop every rank before any work starts (the config itself is valid)."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts and not cfg.out:
        raise ConfigError(
            "torchrun --max-restarts resumes a restarted run from its folder, so it needs --out"
        )
    if restarts and not cfg.checkpoint_every and layout.is_leader:
        print(
            "nobubble: warning: torchrun --max-restarts with checkpoint_every=0: a restart "
            "resumes from the newest checkpoint, and this run saves one only at the end, so a "
            "worker that fails before then ends the job; set checkpoint_every=N",
            file=sys.stderr,
            flush=True,
        )


def check_model(cfg: TrainConfig, mc: ModelConfig, layout: ParallelLayout) -> None:
    """Errors of the model's shape against the layout, raised alike on every rank before the
    engine is built (the model's tied embedding is known once its preset is resolved)."""
    if mc.tie_embeddings and layout.placement == V and layout.pp > 1:
        raise ConfigError(
            f"{cfg.schedule} with tied embeddings does not run under torchrun yet: the V "
            "placement puts the embedding and the head (the first and the last model stage) on "
            "one process, whose two copies of the tied weight the runtime does not sum in place "
            "(docs/pipeline.md); set tie_embeddings=false, train without torchrun (the "
            "one-process engine runs it exactly), or use zb-h1, zb-h2 or interleaved-1f1b"
        )


def _broadcast(layout: ParallelLayout, value: object) -> object:
    """The leader's ``value``, on every rank."""
    box = [value]
    with peer_failures(layout.name(), "the first process's answer (a broadcast)"):
        dist.broadcast_object_list(box, src=layout.leader)
    return box[0]


def _from_leader(layout: ParallelLayout, make: Callable[[], T]) -> T:
    """``make()`` on the leader, shared with every rank; whatever it raises is raised on every
    rank (so that no stage waits for a result that will never come)."""
    outcome: object = None
    if layout.is_leader:
        try:
            outcome = make()
        except Exception as exc:  # raised again below, on every rank
            outcome = exc
    outcome = _broadcast(layout, outcome)
    if isinstance(outcome, Exception):
        raise outcome
    return outcome  # type: ignore[return-value]


def build_stage_data(
    cfg: TrainConfig, run_dir: Path, layout: ParallelLayout
) -> tuple[DataBundle | None, int, int]:
    """This stage's data (first and last stage only), the vocabulary size and the number of
    validation batches (both known on every rank).

    The leader builds first, training or loading the tokenizer and saving it into ``run_dir``,
    and sends the tokenizer (its ``tokenizer.json`` text) to every rank; the other first and
    last stages build the same data from the data source with it. Only the leader touches
    ``run_dir`` (on a multi-node run the others may not see it); an error of any rank's build is
    raised on every rank.
    """
    data = None

    def lead() -> tuple[str, str, int, int]:
        nonlocal data
        data = build_data(cfg, run_dir)
        tokenizer = data.tokenizer
        return tokenizer.to_json(), tokenizer.spec, tokenizer.vocab_size, len(data.val)

    text, spec, vocab, val_batches = _from_leader(layout, lead)
    needs_data = data is None and (layout.is_first_stage or layout.is_last_stage)
    built = _build_on_every_rank(cfg, layout, (text, spec) if needs_data else None)
    return data or built, vocab, val_batches


def _build_on_every_rank(
    cfg: TrainConfig, layout: ParallelLayout, tokenizer: tuple[str, str] | None
) -> DataBundle | None:
    """This rank's data from the data source with ``tokenizer`` (the leader's ``tokenizer.json``
    text and spec; None: this rank builds nothing). A rank that fails tells every rank, and every
    rank raises an error that names it and its host, so that no rank waits for one that is gone
    and the leader's log says what went wrong."""
    data, failure = None, None
    try:
        if tokenizer is not None:
            data = build_data(cfg, tokenizer=tokenizer_from_json(*tokenizer))
    except Exception as exc:  # raised below, on every rank
        failure = exc
    where = f"rank {layout.rank} ({layout.name()}) on host {socket.gethostname()}"
    what = failure if isinstance(failure, DataError) else f"{type(failure).__name__}: {failure}"
    reports: list[str | None] = [None] * layout.world
    with peer_failures(layout.name(), "the other processes' data (an all-gather)"):
        dist.all_gather_object(reports, None if failure is None else f"{where}: {what}")
    if failure is not None and not isinstance(failure, DataError):
        raise failure  # a bug: its own traceback here
    failed = [report for report in reports if report is not None]
    if failed:
        raise DataError(
            f"{failed[0]}\nEvery node that holds a first or last stage reads the data itself: "
            "the same files at the same path on each (see docs/pipeline.md, Multi-node)"
        )
    return data


def tell_and_abort(error: BaseException) -> NoReturn:
    """Tell ``error`` first, then abort the process groups: NCCL's graceful close would wait
    for the receives posted ahead, which after an error may never complete, until the
    watchdog's timeout (:mod:`nobubble.pipeline.process_group`); the command exits with the
    error's status (:class:`~nobubble.run.telling.Told`)."""
    code = tell(error)
    abort_process_group()
    raise Told(code) from error


def restarted_by_torchrun() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


class TorchrunLauncher:
    """The setup of one rank of a torchrun launch (:class:`nobubble.run.setup.Launcher`): a
    context that opens the process group and closes it once the run is done, or tells the
    error that ended it and aborts it (:func:`tell_and_abort`)."""

    pipeline = True

    def __init__(self, cfg: TrainConfig) -> None:
        self.layout = launch_layout(cfg)
        check_launch(cfg, self.layout)
        configure_torch(cfg)
        self.device, backend = device_and_backend(cfg)
        # a choice the backend cannot run: refused now
        resolve_links(cfg.p2p_routes, backend, cfg.emulate_nccl)
        open_process_group(
            backend,
            self.device,
            self.layout.rank,
            self.layout.world,
            cfg.group_timeout_s,
            cfg.p2p_timeout_s,
            cfg.emulate_nccl,
        )
        self.restarted = restarted_by_torchrun()
        self.replicas = self.tp_mesh = None
        try:  # the mesh of the backend's device: gloo's groups sum CUDA tensors too
            mesh_device = "cpu" if backend == "gloo" else self.device.type
            timeout = datetime.timedelta(seconds=cfg.group_timeout_s)
            self.replicas, self.tp_mesh = stage_groups(self.layout, mesh_device, timeout)
        except BaseException as error:
            tell_and_abort(error)

    @property
    def is_leader(self) -> bool:
        return self.layout.is_leader

    def from_leader(self, make: Callable[[], T]) -> T:
        return _from_leader(self.layout, make)

    def build_data(self, cfg: TrainConfig, run_dir: Path) -> tuple[DataBundle | None, int, int]:
        return build_stage_data(cfg, run_dir, self.layout)

    def engine(self, cfg: TrainConfig, mc: ModelConfig, val_batches: int) -> Engine:
        check_model(cfg, mc, self.layout)
        return PipelineEngine(
            cfg, mc, self.device, val_batches, self.layout, self.replicas, self.tp_mesh
        )

    def barrier(self) -> None:
        with peer_failures(self.layout.name(), "the other processes of the run (a barrier)"):
            dist.barrier()

    def __enter__(self) -> TorchrunLauncher:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType
    ) -> None:
        # what holds a process group keeps its backend alive past close
        self.replicas = self.tp_mesh = None
        if tb is not None:  # so do the locals of a run that a stop or an error ended
            traceback.clear_frames(tb)
        if error is None or isinstance(error, ENDED_TOGETHER):
            close_process_group()
        else:
            tell_and_abort(error)
