"""``nobubble plan --grid``: 2bw against the best synchronous schedule over pipeline shapes.

For every P in a list and M = r·P for every ratio r, the cost model predicts 2bw and every
synchronous schedule that can run the shape, and reports 2bw's throughput over the fastest of
them at any memory, and over the fastest that needs no more peak memory per GPU than 2bw.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nobubble.config import ConfigError
from nobubble.config.extras import require
from nobubble.markdown import markdown_table
from nobubble.planning.estimate import ClusterPlan, Estimate, estimate, shape_problem
from nobubble.schedules.registry import PIPELINE_SCHEDULES, SYNCHRONOUS_SCHEDULES

ASYNC = "2bw"


@dataclass(frozen=True)
class GridPoint:
    stages: int
    microbatches: int
    async_run: Estimate
    sync_runs: list[Estimate]  # fastest first
    skipped: dict[str, str]

    @property
    def best_sync(self) -> Estimate:
        return self.sync_runs[0]

    @property
    def best_sync_within_memory(self) -> Estimate | None:
        """The fastest synchronous schedule whose peak memory is at most 2bw's."""
        limit = self.async_run.peak_memory_gb
        return next((p for p in self.sync_runs if p.peak_memory_gb <= limit), None)


def grid_point(plan: ClusterPlan) -> GridPoint:
    """2bw and every synchronous schedule that can run ``plan``'s shape."""
    runs, skipped = [], {}
    for name in (n for n in PIPELINE_SCHEDULES if n in SYNCHRONOUS_SCHEDULES):
        problem = shape_problem(plan, name)
        if problem:
            skipped[name] = problem
        else:
            runs.append(estimate(plan, name))
    runs.sort(key=lambda p: p.step_s)
    shape = plan.parallel
    return GridPoint(shape.stages, shape.microbatches, estimate(plan, ASYNC), runs, skipped)


def grid(plan: ClusterPlan, stages: list[int], ratios: list[int]) -> list[GridPoint]:
    """Every (P, M = r·P) of ``stages`` x ``ratios``, the other figures as ``plan``'s."""
    if any(p < 2 for p in stages) or any(r < 1 for r in ratios):
        raise ConfigError("--grid: stages must be at least 2 and ratios M/P at least 1")
    too_deep = [p for p in stages if p > plan.model.n_layers]
    if too_deep:
        raise ConfigError(
            f"--grid: the model has {plan.model.n_layers} blocks, too few for P = "
            f"{', '.join(map(str, too_deep))}; choose fewer stages or a deeper preset"
        )
    return [grid_point(plan.shaped(stages=p, microbatches=r * p)) for p in stages for r in ratios]


def grid_table(points: list[GridPoint]) -> str:
    header = [
        "P", "M", "2bw tokens/s", "best sync", "2bw / best sync", "best sync at <= 2bw's memory",
        "2bw / it", "2bw GB", "bubble of best sync",
    ]  # fmt: skip
    rows = []
    for pt in points:
        a, best, fit = pt.async_run, pt.best_sync, pt.best_sync_within_memory
        fit_name, fit_ratio = "none", "n/a"
        if fit is not None:
            fit_name, fit_ratio = fit.schedule, f"{a.tokens_per_s / fit.tokens_per_s:.3f}x"
        rows.append([
            str(pt.stages), str(pt.microbatches), f"{a.tokens_per_s:,.0f}", best.schedule,
            f"{a.tokens_per_s / best.tokens_per_s:.3f}x", fit_name, fit_ratio,
            f"{a.peak_memory_gb:.0f}", f"{best.bubble:.1%}",
        ])  # fmt: skip
    return markdown_table(header, rows, align="rrrlrlrrr")


def grid_png(points: list[GridPoint], path: Path, title: str) -> None:
    """2bw / best sync against M/P, one line per P (solid: any memory; dashed: at most 2bw's)."""
    fig = require("matplotlib.figure", "plan --grid --png").Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for p in sorted({pt.stages for pt in points}):
        row = [pt for pt in points if pt.stages == p]
        ratios = [pt.microbatches / p for pt in row]
        anyway = [pt.async_run.tokens_per_s / pt.best_sync.tokens_per_s for pt in row]
        (line,) = ax.plot(ratios, anyway, marker="o", label=f"P = {p}")
        fits = [
            (r, pt.async_run.tokens_per_s / pt.best_sync_within_memory.tokens_per_s)
            for r, pt in zip(ratios, row, strict=True)
            if pt.best_sync_within_memory is not None
        ]
        if fits:
            ax.plot(*zip(*fits, strict=True), linestyle="--", color=line.get_color())
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ticks = sorted({pt.microbatches / pt.stages for pt in points})
    ax.set_xticks(ticks, labels=[f"{t:g}" for t in ticks])
    ax.set_xlabel("microbatches per step / stages (M / P)")
    ax.set_ylabel("2bw tokens/s ÷ best synchronous")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, title="solid: any memory; dashed: ≤ 2bw's", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
