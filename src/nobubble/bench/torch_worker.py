"""The external baseline of ``nobubble bench``: one stage of ``torch.distributed.pipelining``.

Launched under torchrun (one process per stage) with the same ``key=value`` settings as
``nobubble train``, it builds what our runtime builds (the same :class:`~nobubble.model.Stage`
modules from :func:`~nobubble.model.partition`, the same data from
:func:`~nobubble.run.torchrun.build_stage_data` on the first and last stage, the same
optimizer, per-stage clipping and learning-rate schedule) and trains them with torch's
``ScheduleGPipe`` or ``Schedule1F1B``. The loss convention is ours:
:func:`~nobubble.model.lm_loss` is the mean token loss of a microbatch and ``scale_grads=True``
divides the accumulated gradients by M.

It writes a run folder that reads like ours: ``metrics.jsonl`` (``step``, ``train_loss``,
``tokens``, ``tokens_per_s``, timed at stage 0's optimizer step) and ``summary.json``
(``tokens_per_s``, ``train_s``, ``stages``: every process's
:class:`~nobubble.stage_report.StageReport`, as ours, without action times).

Idle time is the time spent in ``schedules._wait_batch_p2p`` (torch's only blocking wait on
peers), measured on gloo only: on NCCL that call returns before the transfer is done.

With data parallelism (``dp`` > 1) every replica runs torch's schedule on its pipeline's process
group (the device mesh's "pp" dimension) over its share of every microbatch, as our runtime does,
and after the schedule's step the stage averages its gradient (and loss) over its replicas with
the same :class:`~nobubble.pipeline.replicas.ReplicaReduction` as ours, started and waited for at
once: torch's schedules flush every step, so the all-reduce sits on the critical path, as under our
1f1b. Its wait counts as idle time, as in our runtime.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining import schedules as torch_schedules

from nobubble.checkpoint.named_state import named_state
from nobubble.config import ConfigError, TrainConfig, parse_overrides
from nobubble.configure import build_config
from nobubble.device import configure_torch
from nobubble.engine import peak_memory_mb
from nobubble.layout import ParallelLayout, device_mesh
from nobubble.model.layers import Stage, lm_loss
from nobubble.model.partition import stage_specs
from nobubble.model.resolve import model_config
from nobubble.pipeline.process_group import (
    close_process_group,
    device_and_backend,
    exit_code,
    open_process_group,
)
from nobubble.pipeline.replicas import ReplicaReduction, replica_rows
from nobubble.run.torchrun import build_stage_data, launch_layout
from nobubble.runfolder.folder import RunFolder
from nobubble.runfolder.new import create_run
from nobubble.schedules.registry import schedule_spec
from nobubble.stage_options import autocast
from nobubble.stage_report import StageReport
from nobubble.stage_update import build_stage_optimizer, clip_stage, optimizer_step

TORCH_SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "interleaved-zb": ScheduleInterleavedZeroBubble,
}
# stages per rank of torch's interleaved schedules (ours' default): stage c·P + r on rank r
CHUNKS = schedule_spec("interleaved-1f1b").default_chunks
# What the benchmark's simulator runs for each: our order of the same schedule, or nothing (None:
# torch's interleaved zero-bubble order is its own); absent: the config's schedule
SIMULATED_AS = {"interleaved-1f1b": {"schedule": "interleaved-1f1b", "chunks": CHUNKS},
                "interleaved-zb": None}  # fmt: skip


class P2PWaitClock:
    """Accumulates the time torch's schedules spend blocked in ``_wait_batch_p2p``."""

    def __init__(self) -> None:
        self.waited_s = 0.0
        self._original: Callable[[list[dist.Work]], None] = torch_schedules._wait_batch_p2p

    def _timed_wait(self, work: list[dist.Work]) -> None:
        started = time.perf_counter()
        try:
            self._original(work)
        finally:
            self.waited_s += time.perf_counter() - started

    def __enter__(self) -> P2PWaitClock:
        torch_schedules._wait_batch_p2p = self._timed_wait
        return self

    def __exit__(self, *exc: object) -> None:
        torch_schedules._wait_batch_p2p = self._original


def _gather(layout: ParallelLayout, value: Any) -> list[Any] | None:
    gathered = [None] * layout.world if layout.is_leader else None
    dist.gather_object(value, gathered, dst=layout.leader)
    return gathered


class TorchStageRunner:
    """This rank's stage, optimizer and torch schedule; ``train`` returns its measurements."""

    def __init__(
        self,
        cfg: TrainConfig,
        schedule: str,
        run_dir: Path,
        device: torch.device,
        layout: ParallelLayout,
    ):
        self.cfg, self.device, self.layout = cfg, device, layout
        self.first, self.last = layout.is_first_stage, layout.is_last_stage
        data, vocab, _ = build_stage_data(cfg, run_dir, layout)
        self.batches = data.train if data else None
        mc = model_config(cfg, vocab)
        if mc.tie_embeddings and cfg.stages > 1:
            raise ConfigError(
                "the torch baseline cannot split a tied embedding and head over stages (torch's "
                "pipeline stages would train two copies that are never summed); benchmark the "
                "torch variants with tie_embeddings=false, or leave them out"
            )
        chunks = CHUNKS if schedule.startswith("interleaved") else 1
        if chunks > 1 and layout.dp > 1:
            raise ConfigError(
                f"the torch baseline {schedule} runs without data parallelism here; leave it out "
                "of --schedules with --dp"
            )
        layers = cfg.stage_layers if chunks == 1 else None  # stage_layers lists P stages
        specs = stage_specs(dataclasses.replace(cfg, chunks=chunks, stage_layers=layers), mc)
        self.model_stages = dataclasses.replace(layout, chunks=chunks).stages  # our placement
        self.modules = [Stage(mc, specs[i], cfg.seed).to(device) for i in self.model_stages]
        self.module = torch.nn.ModuleList(self.modules)  # for the parameter counts below
        named = [(n, p) for m in self.modules for n, p in m.named_parameters()]
        self.optimizer = build_stage_optimizer(named, cfg, delay=0)  # synchronous
        pipeline, self.reduction = None, None  # dp = 1: the default group, rank = stage
        if layout.dp > 1:
            mesh = device_mesh(layout, device.type)  # not kept: it holds the default group
            pipeline = mesh.get_group("pp")
            self.reduction = ReplicaReduction(mesh.get_group("dp"), layout.dp)
        pipe = [
            PipelineStage(m, i, len(specs), device, group=pipeline)
            for m, i in zip(self.modules, self.model_stages, strict=True)
        ]
        self.schedule = TORCH_SCHEDULES[schedule](
            pipe if chunks > 1 else pipe[0], cfg.microbatches, loss_fn=lm_loss, scale_grads=True
        )

    def replica_share(self, batch: torch.Tensor) -> torch.Tensor:
        """This replica's rows of every microbatch, in microbatch order: torch's schedule splits
        them into M equal microbatches again, each this replica's share of ours."""
        chunks = batch.chunk(self.cfg.microbatches)
        return torch.cat([replica_rows(chunk, self.layout) for chunk in chunks])

    def pipeline_step(self) -> float:
        """One schedule step (all microbatches) and the summed microbatch losses (last stage)."""
        batch = self.batches.next_batch() if self.batches else None
        batch = None if batch is None else self.replica_share(batch).to(self.device)
        inputs = (batch[:, :-1],) if self.first else ()
        target = batch[:, 1:] if self.last else None
        losses: list[torch.Tensor] = []
        with autocast(self.device, self.cfg.dtype):
            self.schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        return sum(loss.item() for loss in losses) if losses else float("nan")

    def optimizer_step(self, step: int, loss_sum: float) -> float:
        """The same update rule as our STEP: the replicas' average gradient (with dp), per-stage
        clipping, scheduled LR, optimizer. Returns the mean microbatch loss (last stage)."""
        if self.reduction is not None:
            loss = None
            if self.last:
                loss = torch.tensor([loss_sum], dtype=torch.float64, device=self.device)
            params = list(self.module.parameters())
            total = self.reduction.finish(self.reduction.start(step, params, loss), params)
            loss_sum = loss_sum if total is None else total.item()
        for module in self.modules:  # per stage, as ours
            clip_stage(module.parameters(), self.cfg.grad_clip)
        optimizer_step(self.optimizer, step, self.cfg)
        return loss_sum / self.cfg.microbatches

    def train(self) -> dict[str, Any]:
        losses, step_ends = [], []
        dist.barrier()
        with P2PWaitClock() as clock:
            started = time.perf_counter()
            for step in range(self.cfg.steps):
                loss_sum = self.pipeline_step()
                # clipping reads the norm: a device sync per step
                losses.append(self.optimizer_step(step, loss_sum))
                step_ends.append(time.perf_counter() - started)
        wall = step_ends[-1]
        idle = clock.waited_s if self.device.type == "cpu" else None
        if idle is not None and self.reduction is not None:
            idle += self.reduction.waited_s  # as in our runtime
        param_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters())
        report = StageReport(
            pp_rank=self.layout.pp_rank,
            model_stages=self.model_stages,
            replica=self.layout.replica,
            blocks=sum(len(m.blocks) for m in self.modules),
            train_wall_s=wall,
            idle_s=idle,
            peak_mem_mb=peak_memory_mb(self.device),
            param_mb=param_bytes / 2**20,
            state_mb=named_state(self.optimizer).nbytes() / 2**20,
            weight_versions_peak=1,
        ).as_dict()
        if self.reduction is not None:
            report |= self.reduction.report("allreduce")
        return {"losses": losses, "step_ends": step_ends, "report": report}


def write_run(
    cfg: TrainConfig, run: RunFolder, reports: list[dict[str, Any]], schedule: str
) -> None:
    """Stage 0's step times and the last stage's losses, in our run-folder format."""
    step_ends, losses = reports[0]["step_ends"], reports[-1]["losses"]
    tokens_per_step = cfg.batch_size * cfg.seq_len
    for step, (seconds, loss) in enumerate(zip(step_ends, losses, strict=True), start=1):
        tokens = step * tokens_per_step
        run.append_metrics(
            {"step": step, "train_loss": loss, "tokens": tokens, "tokens_per_s": tokens / seconds}
        )
    run.write_summary(
        {
            "tokens_per_s": cfg.steps * tokens_per_step / step_ends[-1],
            "train_s": step_ends[-1],
            "steps": cfg.steps,
            "peak_mem_mb": reports[0]["report"]["peak_mem_mb"],
            "stages": [report["report"] for report in reports],
        }
        | ({"simulated_as": SIMULATED_AS[schedule]} if schedule in SIMULATED_AS else {})
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nobubble.bench.torch_worker", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--schedule", choices=sorted(TORCH_SCHEDULES), required=True)
    parser.add_argument("--out", required=True, help="run folder to create")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config settings")
    args = parser.parse_args(argv)
    cfg = build_config(parse_overrides(args.overrides), {"out": args.out})
    configure_torch(cfg)
    device, backend = device_and_backend(cfg)
    layout = launch_layout(cfg)
    open_process_group(
        backend, device, layout.rank, layout.world, cfg.group_timeout_s, cfg.p2p_timeout_s
    )
    try:
        run_dir = Path(args.out)
        run = create_run(cfg, overwrite=True) if layout.is_leader else None
        dist.barrier()  # the run folder exists before any stage writes into it
        reports = _gather(
            layout, TorchStageRunner(cfg, args.schedule, run_dir, device, layout).train()
        )
        if run is not None:
            write_run(cfg, run, reports, args.schedule)
    finally:
        close_process_group()
    return exit_code(0)


if __name__ == "__main__":
    raise SystemExit(main())
