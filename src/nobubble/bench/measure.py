"""Reading one benchmark run folder: steady-state throughput, per-stage idle time and memory,
and the simulator's bubble for the same schedule beside the measured idle time."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nobubble.config import TrainConfig, build_config
from nobubble.schedules import generate, lower, simulate


@dataclass(frozen=True)
class StageResult:
    idle_fraction: float | None  # time blocked on peers / training time; None: not measurable
    busy_s: float | None  # training time minus idle time
    peak_mem_mb: float  # ru_maxrss on the CPU, max_memory_allocated on CUDA
    param_mb: float  # one copy of the stage's weights
    weight_versions: int  # most weight copies held at once


@dataclass(frozen=True)
class RunResult:
    tokens_per_s: float  # over the steps after the warm-up
    tokens_per_s_all: float  # over every step (the run's summary)
    final_loss: float
    stages: list[StageResult]
    bubble_uniform: list[float]  # simulator, forward 1 and backward 2 on every stage
    bubble_timed: list[float] | None  # simulator, each stage's measured busy time (F:B = 1:2)


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


def simulated_bubble(cfg: TrainConfig, stage_costs: Sequence[float]) -> list[float]:
    """Per-stage bubble of ``cfg``'s schedule in the simulator, a microbatch (F+B) costing
    ``stage_costs[s]`` at stage s, split forward:backward = 1:2, no communication time."""
    actions = lower(generate(cfg.schedule, cfg.stages, cfg.microbatches, cfg.steps))
    forward = [cost / 3 for cost in stage_costs]
    backward = [2 * cost / 3 for cost in stage_costs]
    return simulate(actions, forward, backward).bubble_fraction


def _stage_result(report: dict) -> StageResult:
    idle = report["idle_fraction"]
    busy = None if report["idle_s"] is None else report["train_wall_s"] - report["idle_s"]
    return StageResult(
        idle_fraction=idle,
        busy_s=busy,
        peak_mem_mb=report["peak_mem_mb"],
        param_mb=report["param_mb"],
        weight_versions=report["weight_versions_peak"],
    )


def read_run(run_dir: Path, skip_tokens: int) -> RunResult:
    """The figures of one finished run; its first ``skip_tokens`` tokens count as warm-up."""
    cfg = build_config(json.loads((run_dir / "config.json").read_text()))
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stages = [_stage_result(report) for report in summary["stages"]]
    micro_total = cfg.steps * cfg.microbatches
    busy = [s.busy_s for s in stages]
    timed = None
    if all(b is not None for b in busy):
        timed = simulated_bubble(cfg, [b / micro_total for b in busy])
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    return RunResult(
        tokens_per_s=steady_tokens_per_s(rows, skip_tokens),
        tokens_per_s_all=summary["tokens_per_s"],
        final_loss=losses[-1],
        stages=stages,
        bubble_uniform=simulated_bubble(cfg, [3.0] * cfg.stages),
        bubble_timed=timed,
    )
