"""Reading one benchmark run folder: steady-state throughput, per-stage idle time and memory,
the simulator's bubble for the same schedule beside the measured idle time, and with data
parallelism each stage's gradient all-reduce: how long it took, how much of it the stage waited
for, and how many bytes it carried.

A run folder's ``summary.json`` has one ``stages`` entry per rank (pipeline rank ``pp_rank`` of
replica ``replica``, :mod:`nobubble.stage_report`; earlier versions' entries read alike). The
figures here are per pipeline rank (its stage, where it holds one): a replica's share of its work
is the same, so idle time and busy time are means over the replicas, memory the largest
replica's, and the hidden fraction of the all-reduce is one minus the replicas' summed wait over
their summed all-reduce time.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nobubble.config import TrainConfig
from nobubble.json_files import DamagedFile
from nobubble.runfolder.reading import read_metrics, read_summary, saved_train_config
from nobubble.schedules import generate, lower, simulate
from nobubble.schedules.timing import SimResult, split_rank_times
from nobubble.stage_report import read_stage_report


@dataclass(frozen=True)
class StageResult:
    idle_fraction: float | None  # time blocked on peers / training time; None: not measurable
    busy_s: float | None  # training time minus idle time
    peak_mem_mb: float  # ru_maxrss on the CPU, max_memory_allocated on CUDA
    param_mb: float  # one copy of the stage's weights
    weight_versions: int  # most weight copies held at once
    # optimizer and correction state a replica holds (the most of any; None: not reported)
    state_mb: float | None = None
    # With data parallelism (else None), per optimizer step and rank, means over the replicas,
    # leaving out the run's last all-reduce (waited for at the end, with no compute left to hide
    # behind; where the run folder does not say which one was last, over every step). With
    # sharded state (zero > 0) the "all-reduce" is the update's chain of collectives (reduce,
    # norm, all-gather: nobubble.pipeline.sharded_update), its bytes the bucket and this rank's
    # part:
    allreduce_s: float | None = None  # start of the gradient all-reduce to its completion
    allreduce_wait_s: float | None = None  # the part of it the stage spent blocked
    hidden_fraction: float | None = None  # 1 - summed wait / summed all-reduce time
    hidden_fraction_run: float | None = None  # the same over every step, the last one too
    allreduce_mb: float | None = None  # gradient bytes a rank put into the all-reduce
    peer_wait_s: float | None = None  # idle time on pipeline peers (not on all-reduces)
    replicas: int = 1


@dataclass(frozen=True)
class RunResult:
    tokens_per_s: float  # over the steps after the warm-up
    tokens_per_s_all: float  # over every step (the run's summary)
    final_loss: float
    stages: list[StageResult]
    bubble_uniform: list[float] | None  # simulator, forward 1 and backward 2 on every stage
    # simulator, each stage's measured busy time split as the run measured its F, B, I and W
    # (torch's baselines measure none: as our run of the same order did, else F:B = 1:2)
    bubble_timed: list[float] | None
    predicted_tokens_per_s: float | None = None  # the cost model, from those stage times
    dp: int = 1
    steps: int = 0  # optimizer steps of the run (M times the others' for pipedream)
    # summary.json's entries, as is but for the names of earlier versions (read_stage_report)
    ranks: list[dict[str, Any]] = field(default_factory=list)


def step_times(rows: Sequence[dict]) -> list[tuple[int, float]]:
    """(tokens trained, seconds since training started) at every logged step.

    ``tokens_per_s`` of a metrics line is cumulative over the training time, so the time of a
    line is ``tokens / tokens_per_s``.
    """
    return [(r["tokens"], r["tokens"] / r["tokens_per_s"]) for r in rows if "tokens" in r]


def steady_tokens_per_s(rows: Sequence[dict], skip_tokens: int) -> float:
    """Throughput from the first logged step at or past ``skip_tokens`` to the last step.

    Skipping the first steps leaves out one-off costs (allocator growth, torch's shape
    inference, the pipeline fill of 2bw); the cool-down of the last step stays in.
    """
    times = [(0, 0.0), *step_times(rows)]
    start = next(i for i, (tokens, _) in enumerate(times) if tokens >= skip_tokens)
    if start == len(times) - 1:
        start = 0  # nothing left after the warm-up: fall back to the whole run
    (tokens0, t0), (tokens1, t1) = times[start], times[-1]
    return (tokens1 - tokens0) / (t1 - t0)


@dataclass(frozen=True)
class ActionCosts:
    """Seconds per microbatch of each model stage's forward, backward (B, or I + W) and weight
    gradient (W; None: the simulator's default, half the backward)."""

    fwd: list[float]
    bwd: list[float]
    wgrad: list[float] | None = None


def busy_costs(
    cfg: TrainConfig, stage_costs: Sequence[float], schedule: str | None = None, chunks: int = 1
) -> ActionCosts:
    """From a microbatch's cost (F+B) on each process, split equally over its ``chunks`` model
    stages, forward:backward = 1:2."""
    actions = _generated(cfg, schedule, chunks, 1)
    return ActionCosts(
        split_rank_times([cost / 3 for cost in stage_costs], actions),
        split_rank_times([2 * cost / 3 for cost in stage_costs], actions),
    )


def measured_costs(
    reports: Sequence[dict], micro_total: int, like: Sequence[dict] | None = None
) -> ActionCosts | None:
    """From the pipeline's measured action times (``action_s`` of each process's report). Each
    process's busy time is spread over its F, B, I and W in the proportions it measured them, so
    that what it spent on steps, sends and its loop counts too; replicas of a stage are
    averaged. A report without action times (torch's baselines) takes those of the report of
    the same process in ``like`` (a run of ours in the same order); None if there is none."""
    ours = map(read_stage_report, like or [])
    twins = {(r["pp_rank"], r["replica"]): r.get("action_s") for r in ours}
    per_stage: dict[int, list[dict[str, float]]] = {}
    for report in map(read_stage_report, reports):
        kinds = report.get("action_s") or twins.get((report["pp_rank"], report.get("replica", 0)))
        if kinds is None or report["idle_s"] is None:
            return None
        compute = sum(t for stage in kinds.values() for k, t in stage.items() if k in "FBIW")
        scale = (report["train_wall_s"] - report["idle_s"]) / compute / micro_total
        for stage, times in kinds.items():
            per_stage.setdefault(int(stage), []).append(
                {k: times.get(k, 0.0) * scale for k in "FBIW"}
            )
    stages = [
        {k: statistics.fmean(r[k] for r in per_stage[s]) for k in "FBIW"} for s in sorted(per_stage)
    ]
    split = any(s["W"] > 0 for s in stages)
    return ActionCosts(
        [s["F"] for s in stages],
        [s["B"] + s["I"] + s["W"] for s in stages],
        [s["W"] for s in stages] if split else None,
    )


def _generated(cfg: TrainConfig, schedule: str | None, chunks: int, steps: int):
    name = schedule or cfg.schedule
    return generate(name, cfg.stages, cfg.microbatches, steps, chunks if chunks > 1 else None)


def _simulated(
    cfg: TrainConfig, costs: ActionCosts, schedule: str | None, chunks: int, steps: int
) -> SimResult:
    """``steps`` steps of ``schedule`` (default: ``cfg``'s) in the simulator at ``costs``, no
    communication time."""
    actions = _generated(cfg, schedule, chunks, steps)
    return simulate(lower(actions), costs.fwd, costs.bwd, wgrad=costs.wgrad)


def simulated_bubble(
    cfg: TrainConfig, costs: ActionCosts, schedule: str | None = None, chunks: int = 1
) -> list[float]:
    """Per-rank bubble of the run's steps in the simulator (see :func:`_simulated`)."""
    return _simulated(cfg, costs, schedule, chunks, cfg.steps).bubble_fraction


def predicted_tokens_per_s(
    cfg: TrainConfig, costs: ActionCosts, schedule: str | None = None, chunks: int = 1
) -> float:
    """The cost model's steady throughput from measured per-microbatch action costs: the
    simulated time of the run's last step (the makespan of all its steps minus that of one
    step fewer), as the measured throughput leaves the first steps out."""
    last = _simulated(cfg, costs, schedule, chunks, cfg.steps).makespan
    before = 0.0
    if cfg.steps > 1:
        before = _simulated(cfg, costs, schedule, chunks, cfg.steps - 1).makespan
    return cfg.batch_size * cfg.seq_len / (last - before)


def _mean(values: Sequence[float | None]) -> float | None:
    return None if any(v is None for v in values) else statistics.fmean(values)


def _stage_result(replicas: list[dict], steps: int) -> StageResult:
    """One stage's figures from the summary entries of its replicas (one without dp)."""
    busy = [None if r["idle_s"] is None else r["train_wall_s"] - r["idle_s"] for r in replicas]
    result = StageResult(
        idle_fraction=_mean([r["idle_fraction"] for r in replicas]),
        busy_s=_mean(busy),
        peak_mem_mb=max(r["peak_mem_mb"] for r in replicas),
        param_mb=replicas[0]["param_mb"],
        weight_versions=max(r["weight_versions_peak"] for r in replicas),
        state_mb=max(r["state_mb"] for r in replicas) if "state_mb" in replicas[0] else None,
        replicas=len(replicas),
    )
    key = "zero_comm" if "zero_comm_s" in replicas[0] else "allreduce"
    if not all(f"{key}_s" in r for r in replicas):
        return result
    took = sum(r[f"{key}_s"] for r in replicas)
    waited = sum(r[f"{key}_wait_s"] for r in replicas)
    per_step = len(replicas) * steps
    steady_took, steady_waited, steady_steps = took, waited, per_step
    if steps > 1 and all(f"{key}_last_s" in r for r in replicas):
        steady_took -= sum(r[f"{key}_last_s"] for r in replicas)
        steady_waited -= sum(r[f"{key}_last_wait_s"] for r in replicas)
        steady_steps -= len(replicas)
    peers = [
        None
        if r["idle_s"] is None
        else r["idle_s"] - r[f"{key}_wait_s"] - r.get("tied_allreduce_wait_s", 0.0)
        for r in replicas
    ]
    return dataclasses.replace(
        result,
        allreduce_s=steady_took / steady_steps,
        allreduce_wait_s=steady_waited / steady_steps,
        hidden_fraction=1 - steady_waited / steady_took if steady_took > 0 else None,
        hidden_fraction_run=1 - waited / took if took > 0 else None,
        allreduce_mb=sum(r[f"{key}_mb"] for r in replicas) / per_step,
        peer_wait_s=None if None in peers else sum(peers) / per_step,
    )


def stage_results(reports: Sequence[dict], steps: int) -> list[StageResult]:
    """Per pipeline rank, in order, from ``summary.json``'s per-rank ``stages`` entries."""
    by_rank: dict[int, list[dict]] = {}
    for report in map(read_stage_report, reports):
        by_rank.setdefault(report["pp_rank"], []).append(report)
    return [_stage_result(by_rank[rank], steps) for rank in sorted(by_rank)]


def ring_traffic_mb(bucket_mb: float, dp: int) -> float:
    """What a ring all-reduce of ``bucket_mb`` over ``dp`` ranks sends (and receives) per rank:
    a reduce-scatter and an all-gather of ``dp - 1`` chunks of ``bucket_mb / dp`` each."""
    return 2 * (dp - 1) / dp * bucket_mb


def read_run(run_dir: Path, skip_tokens: int, like: Sequence[dict] | None = None) -> RunResult:
    """The figures of one finished run; its first ``skip_tokens`` tokens count as warm-up.
    ``like``: the per-process reports of a run of ours in the same order, whose measured action
    times stand in where this run has none (see :func:`measured_costs`)."""
    cfg = saved_train_config(run_dir)
    summary = read_summary(run_dir)
    if summary is None:
        raise DamagedFile(f"{run_dir} has no summary.json: the run did not finish; run it again")
    rows = read_metrics(run_dir, "run it again").records
    reports = [read_stage_report(report) for report in summary["stages"]]
    stages = stage_results(reports, cfg.steps)
    micro_total = cfg.steps * cfg.microbatches
    busy = [s.busy_s for s in stages]
    # what to simulate it as: the run's schedule, or what a torch baseline names (None: nothing
    # of ours runs its order)
    simulated = summary.get("simulated_as", {"schedule": cfg.schedule, "chunks": cfg.chunks})
    timed = uniform = predicted = None
    if simulated is not None:
        name, chunks = simulated["schedule"], simulated["chunks"]
        uniform = simulated_bubble(
            cfg, busy_costs(cfg, [3.0] * cfg.stages, name, chunks), name, chunks
        )
        costs = measured_costs(reports, micro_total, like)
        if costs is None and all(b is not None for b in busy):
            costs = busy_costs(cfg, [b / micro_total for b in busy], name, chunks)
        if costs is not None:
            timed = simulated_bubble(cfg, costs, name, chunks)
            predicted = predicted_tokens_per_s(cfg, costs, name, chunks)
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    return RunResult(
        tokens_per_s=steady_tokens_per_s(rows, skip_tokens),
        tokens_per_s_all=summary["tokens_per_s"],
        final_loss=losses[-1],
        stages=stages,
        bubble_uniform=uniform,
        predicted_tokens_per_s=predicted,
        bubble_timed=timed,
        dp=cfg.dp,
        steps=cfg.steps,
        ranks=reports,
    )
