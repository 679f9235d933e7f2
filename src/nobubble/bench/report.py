"""Medians over repeats, the issue's targets, and the markdown report."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nobubble.bench.measure import RunResult, ring_traffic_mb
from nobubble.bench.variants import BASELINE, TORCH, VARIANTS, ZERO_SUFFIX
from nobubble.markdown import markdown_table
from nobubble.schedules import schedule_spec

Results = dict[str, list[RunResult]]  # variant -> one result per run, in repeat order

# What a memory figure cannot resolve: RSS counts whole pages (each copy of a stage's ~30
# weight tensors rounds up to pages) and the allocator's and Python's own bookkeeping.
SLACK_MB = 1.0
# The all-reduce target: under 2bw with M >= 2P at least this much of every stage's
# gradient all-reduce runs behind compute (1 - exposed wait / all-reduce time).
HIDDEN_TARGET = 0.90


@dataclass(frozen=True)
class VariantSummary:
    name: str
    tokens_per_s: float
    ratio_to_baseline: float | None  # median of the per-repeat ratios to torch's Schedule1F1B
    final_loss: float
    idle: list[float | None]
    bubble_timed: list[float] | None
    bubble_uniform: list[float] | None
    predicted_tokens_per_s: float | None  # the cost model from measured stage times (median)
    peak_mem_mb: list[float]  # of the timed runs
    tensor_mem_mb: list[float] | None  # of the memory pass (CPU only)
    param_mb: list[float]
    weight_versions: list[int]
    # with data parallelism (dp > 1; else None), per stage, medians over repeats:
    dp: int = 1
    allreduce_ms: list[float | None] | None = None  # per optimizer step and rank
    allreduce_wait_ms: list[float | None] | None = None  # the exposed part of it
    hidden: list[float | None] | None = None  # 1 - wait / all-reduce time
    hidden_run: list[float | None] | None = None  # the same, the run's last all-reduce in
    allreduce_mb: list[float | None] | None = None  # bucket per optimizer step and rank
    peer_wait_ms: list[float | None] | None = None  # idle on pipeline peers, per step
    steps: int = 0  # optimizer steps of a run
    state_mb: list[float | None] | None = None  # optimizer and correction state per rank


@dataclass(frozen=True)
class Target:
    claim: str
    measured: str
    required: str
    met: bool | None  # None: reported, not judged (the required column says why)


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def paired_ratio(results: Results, name: str, reference: str) -> float | None:
    """Median over repeats of ``name``'s throughput over ``reference``'s in the same repeat.

    Pairing runs that ran back to back cancels most of the drift of a shared machine.
    """
    if name not in results or reference not in results:
        return None
    return statistics.median(
        a.tokens_per_s / b.tokens_per_s
        for a, b in zip(results[name], results[reference], strict=True)
    )


def _per_stage(runs: list[RunResult], value: Callable[[RunResult, int], float | None]) -> list:
    return [_median([value(run, s) for run in runs]) for s in range(len(runs[0].stages))]


def _peak_mb(runs: list[RunResult]) -> list[float]:
    return _per_stage(runs, lambda run, s: run.stages[s].peak_mem_mb)


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def summarize(name: str, results: Results, memory: Results | None) -> VariantSummary:
    runs = results[name]
    timed = None
    if all(run.bubble_timed is not None for run in runs):
        timed = _per_stage(runs, lambda run, s: run.bubble_timed[s])
    reduced = {}
    if runs[0].dp > 1:
        reduced = dict(
            allreduce_ms=_per_stage(runs, lambda run, s: _scaled(run.stages[s].allreduce_s, 1e3)),
            allreduce_wait_ms=_per_stage(
                runs, lambda run, s: _scaled(run.stages[s].allreduce_wait_s, 1e3)
            ),
            hidden=_per_stage(runs, lambda run, s: run.stages[s].hidden_fraction),
            hidden_run=_per_stage(runs, lambda run, s: run.stages[s].hidden_fraction_run),
            allreduce_mb=_per_stage(runs, lambda run, s: run.stages[s].allreduce_mb),
            peer_wait_ms=_per_stage(runs, lambda run, s: _scaled(run.stages[s].peer_wait_s, 1e3)),
        )
    return VariantSummary(
        name=name,
        tokens_per_s=_median([run.tokens_per_s for run in runs]),
        ratio_to_baseline=paired_ratio(results, name, BASELINE),
        final_loss=_median([run.final_loss for run in runs]),
        idle=_per_stage(runs, lambda run, s: run.stages[s].idle_fraction),
        bubble_timed=timed,
        bubble_uniform=runs[0].bubble_uniform,
        predicted_tokens_per_s=_median([run.predicted_tokens_per_s for run in runs]),
        peak_mem_mb=_peak_mb(runs),
        tensor_mem_mb=_peak_mb(memory[name]) if memory else None,
        param_mb=_per_stage(runs, lambda run, s: run.stages[s].param_mb),
        weight_versions=[
            max(run.stages[s].weight_versions for run in runs) for s in range(len(runs[0].stages))
        ],
        dp=runs[0].dp,
        steps=runs[0].steps,
        state_mb=_per_stage(runs, lambda run, s: run.stages[s].state_mb),
        **reduced,
    )


@dataclass(frozen=True)
class OptionSummary:
    """A variant run with --options, against the same variant without them."""

    name: str
    plain: str
    tokens_per_s: float
    speed_ratio: float  # median over repeats of the paired ratio to the plain variant
    peak_mem_mb: list[float]  # per stage: the memory pass's if there was one, else the timed runs'
    memory_ratio: list[float]  # per stage, to the plain variant's
    final_loss: float
    plain_final_loss: float


def option_summary(
    name: str, plain: str, results: Results, memory: Results | None
) -> OptionSummary:
    peaks = memory or results
    mine, theirs = _peak_mb(peaks[name]), _peak_mb(peaks[plain])
    return OptionSummary(
        name=name,
        plain=plain,
        tokens_per_s=_median([run.tokens_per_s for run in results[name]]),
        speed_ratio=paired_ratio(results, name, plain),
        peak_mem_mb=mine,
        memory_ratio=[a / b for a, b in zip(mine, theirs, strict=True)],
        final_loss=_median([run.final_loss for run in results[name]]),
        plain_final_loss=_median([run.final_loss for run in results[plain]]),
    )


def options_markdown(rows: list[OptionSummary], memory_pass: bool) -> str:
    """The --options table: every option set against the same variant without it."""
    where = "memory pass" if memory_pass else "timed runs"
    header = [
        "variant", "tokens/s", "× without", f"peak MB ({where})", "× without", "final loss",
        "final loss without",
    ]  # fmt: skip
    body = [
        [
            r.name,
            f"{r.tokens_per_s:,.0f}",
            f"{r.speed_ratio:.3f}",
            _megabytes(r.peak_mem_mb),
            _figures(r.memory_ratio, ".3f"),
            f"{r.final_loss:.4f}",
            f"{r.plain_final_loss:.4f}",
        ]
        for r in rows
    ]
    return markdown_table(header, body, align="lrrllrr")


def memory_extra(results: Results, name: str, reference: str) -> list[float]:
    """Per stage, the median over repeats of ``name``'s peak memory minus ``reference``'s."""
    pairs = list(zip(results[name], results[reference], strict=True))
    return [
        statistics.median(a.stages[s].peak_mem_mb - b.stages[s].peak_mem_mb for a, b in pairs)
        for s in range(len(pairs[0][0].stages))
    ]


def _speed_targets(
    results: Results, stages: int, microbatches: int, unjudged: str | None = None
) -> list[Target]:
    """The throughput targets; ``unjudged``: why they are only reported (oversubscribed)."""
    found = []
    ratio = paired_ratio(results, "1f1b", BASELINE)
    if ratio is not None:
        found.append(
            Target("our 1f1b vs torch Schedule1F1B", f"{ratio:.3f}×", "≥ 0.950×", ratio >= 0.95)
        )
    ratio = paired_ratio(results, "2bw", "1f1b")
    if ratio is not None:
        ideal = (microbatches + stages - 1) / microbatches
        found.append(
            Target(
                "2bw vs our 1f1b",
                f"{ratio:.3f}×",
                f"≥ 0.95 × (M+P-1)/M = {0.95 * ideal:.3f}×",
                ratio >= 0.95 * ideal,
            )
        )
    if unjudged:
        found = [
            dataclasses.replace(t, required=f"{t.required} (not judged: {unjudged})", met=None)
            for t in found
        ]
    return found


def is_synchronous(name: str) -> bool:
    """A plain variant with synchronous semantics: torch's baselines, and ours that flush."""
    variant = VARIANTS.get(name)  # --options variants (1f1b+ac, ...) are not plain ones
    if variant is None:
        return False
    return variant.backend == TORCH or schedule_spec(variant.schedule).flushes


def _sync_comparison(results: Results, memory: Results) -> list[Target]:
    """2bw against the fastest synchronous variant measured, at any memory and at no more
    peak memory than 2bw's (the most of any stage; reported, not judged)."""
    if "2bw" not in results:
        return []
    peak = {name: max(_peak_mb(runs)) for name, runs in (memory or results).items()}
    speed = {name: _median([run.tokens_per_s for run in runs]) for name, runs in results.items()}
    sync = sorted((n for n in results if is_synchronous(n)), key=lambda n: -speed[n])
    found = []
    for label, pool in (
        ("at any memory", sync),
        (
            "at no more peak memory than 2bw",
            [n for n in sync if peak.get(n, math.inf) <= peak["2bw"]],
        ),
    ):
        if pool:
            best = pool[0]
            ratio = paired_ratio(results, "2bw", best)
            found.append(
                Target(f"2bw vs the fastest synchronous schedule {label} ({best})",
                       f"{ratio:.3f}×", "reported", None)
            )  # fmt: skip
    return found


def _allreduce_targets(results: Results, stages: int, microbatches: int) -> list[Target]:
    """2bw hides its all-reduce (with sharded state: its update's chain of collectives) behind
    compute: judged with M >= 2P, reported with M < 2P."""
    found = []
    names = [n for n in results if n in ("2bw", "2bw+ef") or _zero_of(n, ("2bw", "2bw+ef"))]
    for name in names:
        if results[name][0].dp == 1:
            continue
        hidden = summarize(name, results, None).hidden or []
        measured = _percentages(hidden)
        what = "the update's collectives" if ZERO_SUFFIX in name else "all-reduce"
        claim = f"{name}: {what} time hidden (not waited for), per stage"
        if microbatches >= 2 * stages:
            required = f"≥ {100 * HIDDEN_TARGET:.0f}% (M ≥ 2P)"
            met = all(h is not None and h >= HIDDEN_TARGET for h in hidden)
            found.append(Target(claim, measured, required, met))
        else:
            required = f"none at M = {microbatches} < 2P = {2 * stages} (what it leaves exposed)"
            found.append(Target(claim, measured, required, None))
    return found


def _memory_targets(memory: Results) -> list[Target]:
    found = []
    for name in ("2bw", "2bw+ef"):
        if name in memory and "1f1b" in memory:
            extra = memory_extra(memory, name, "1f1b")
            copies = 2 if name == "2bw+ef" else 1  # the second weight copy (+ the EF buffer)
            claim = f"{name} peak memory above 1f1b, per stage"
            if memory[name][0].dp > 1:  # the gradient bucket of an all-reduce behind compute
                copies += 1
                claim += " (dp: + the gradient bucket in flight)"
            param_mb = _per_stage(memory[name], lambda run, s: run.stages[s].param_mb)
            budget = [copies * p for p in param_mb]
            found.append(
                Target(
                    claim,
                    " / ".join(f"{e:+.2f} MB" for e in extra),
                    "≤ " + " / ".join(f"{b:.2f} MB" for b in budget) + f" (+{SLACK_MB:g} MB)",
                    all(e <= b + SLACK_MB for e, b in zip(extra, budget, strict=True)),
                )
            )
    return found


def _zero_of(name: str, plains: Sequence[str]) -> bool:
    """Whether ``name`` is one of ``plains`` run with sharded state (``2bw+zero1``)."""
    plain, _, level = name.rpartition(ZERO_SUFFIX)
    return bool(level) and plain in plains


def _state_targets(results: Results) -> list[Target]:
    """Sharded state: each replica holds about 1/dp of what a replica of zero=0 holds."""
    found = []
    for name, runs in results.items():
        plain = name.rpartition(ZERO_SUFFIX)[0]
        if ZERO_SUFFIX not in name or plain not in results or runs[0].dp == 1:
            continue
        mine = _per_stage(runs, lambda run, s: run.stages[s].state_mb)
        whole = _per_stage(results[plain], lambda run, s: run.stages[s].state_mb)
        if None in mine or None in whole:
            continue
        dp = runs[0].dp
        ratios = [m / w for m, w in zip(mine, whole, strict=True)]
        found.append(
            Target(
                f"{name}: optimizer and correction state per rank, × {plain}'s, per stage",
                " / ".join(f"{r:.3f}" for r in ratios),
                f"≈ 1/dp = {1 / dp:.3f} (within 10%; whole matrices may weigh it more)",
                all(r <= 1.1 / dp for r in ratios),
            )
        )
    return found


def zero_markdown(summaries: list[VariantSummary], memory_pass: bool) -> str:
    """Sharded state against the same variant with zero=0: per stage, the state a rank holds,
    its peak memory (the memory pass's on the CPU), throughput and the hidden fraction."""
    where = "memory pass" if memory_pass else "timed runs"
    header = [
        "variant", "state MB/rank", f"peak MB/rank ({where})", "× zero=0", "tokens/s", "× zero=0",
        "hidden",
    ]  # fmt: skip
    rows = []
    for plain in summaries:
        levels = [s for s in summaries if s.name.rpartition(ZERO_SUFFIX)[0] == plain.name]
        if ZERO_SUFFIX in plain.name or not levels:
            continue
        plain_peak = plain.tensor_mem_mb or plain.peak_mem_mb
        for row in (plain, *levels):
            peak = row.tensor_mem_mb or row.peak_mem_mb
            ratio = [a / b for a, b in zip(peak, plain_peak, strict=True)]
            rows.append([
                row.name, _figures(row.state_mb, ".2f"), _megabytes(peak), _figures(ratio, ".3f"),
                f"{row.tokens_per_s:,.0f}", f"{row.tokens_per_s / plain.tokens_per_s:.3f}",
                _percentages(row.hidden),
            ])  # fmt: skip
    return markdown_table(header, rows, align="llllrrl")


def targets(
    results: Results,
    memory: Results | None,
    stages: int,
    microbatches: int,
    unjudged: str | None = None,
) -> list[Target]:
    """The issue's targets that the selected variants allow; memory from the memory pass if
    there was one (CPU), else from the timed runs (CUDA: allocated tensor memory). With
    ``unjudged`` (a reason: more processes than cores) the speed targets are reported, not
    judged."""
    return (
        _speed_targets(results, stages, microbatches, unjudged)
        + _sync_comparison(results, memory)
        + _allreduce_targets(results, stages, microbatches)
        + _memory_targets(memory or results)
        + _state_targets(results)
    )


def _percentages(values: Sequence[float | None] | None) -> str:
    if values is None:
        return "n/a"
    return " / ".join("n/a" if v is None else f"{100 * v:.1f}%" for v in values)


def _megabytes(values: Sequence[float] | None) -> str:
    return "n/a" if values is None else " / ".join(f"{v:.0f}" for v in values)


def _figures(values: Sequence[float | None] | None, fmt: str) -> str:
    if values is None:
        return "n/a"
    return " / ".join("n/a" if v is None else format(v, fmt) for v in values)


def _met(met: bool | None) -> str:
    return "not judged" if met is None else "yes" if met else "NO"


def dp_markdown(summaries: list[VariantSummary]) -> str:
    """The data-parallel table: per stage, each replica's gradient all-reduce per optimizer
    step, the part the stage waited for, the hidden fraction (without the run's last all-reduce,
    which has no compute left to hide behind, and with it), the stage's other idle time (on its
    pipeline peers: what the unexposed part may hide behind besides compute), and the bytes the
    all-reduce carried beside what the stage's weights make them (one gradient copy; a ring
    all-reduce sends and receives 2(dp-1)/dp of it per rank)."""
    if not summaries or summaries[0].dp == 1:
        return ""
    dp = summaries[0].dp
    header = [
        "variant", "all-reduce ms/step", "exposed wait ms/step", "hidden",
        "hidden, last all-reduce in", "idle on pipeline peers ms/step", "all-reduce MB/step/rank",
        "expected: one gradient copy, MB",
        f"ring traffic MB/step/rank, expected: 2({dp}-1)/{dp} × copy", "steps",
    ]  # fmt: skip
    rows = [
        [
            s.name,
            _figures(s.allreduce_ms, ".1f"),
            _figures(s.allreduce_wait_ms, ".1f"),
            _percentages(s.hidden),
            _percentages(s.hidden_run),
            _figures(s.peer_wait_ms, ".1f"),
            _figures(s.allreduce_mb, ".2f"),
            _figures(s.param_mb, ".2f"),
            _figures([ring_traffic_mb(p, dp) for p in s.param_mb], ".2f"),
            str(s.steps),
        ]
        for s in summaries
    ]
    return markdown_table(header, rows, align="lllllllllr")


def markdown(summaries: list[VariantSummary], found: list[Target]) -> str:
    """The results table and the targets, as markdown; per-stage cells list stage 0 first."""
    header = [
        "variant", "tokens/s", "× torch 1F1B", "final loss", "idle (measured)",
        "bubble (sim, measured stage times)", "bubble (sim, F=1 B=2)", "peak memory MB",
        "peak MB, memory pass", "weight copies",
    ]  # fmt: skip
    rows = []
    for s in summaries:
        ratio = "n/a" if s.ratio_to_baseline is None else f"{s.ratio_to_baseline:.3f}"
        rows.append([
            s.name, f"{s.tokens_per_s:,.0f}", ratio, f"{s.final_loss:.4f}",
            _percentages(s.idle), _percentages(s.bubble_timed), _percentages(s.bubble_uniform),
            _megabytes(s.peak_mem_mb), _megabytes(s.tensor_mem_mb),
            " / ".join(map(str, s.weight_versions)),
        ])  # fmt: skip
    lines = [markdown_table(header, rows, align="lrrrllllll")]
    param = " / ".join(f"{p:.2f}" for p in summaries[0].param_mb) if summaries else "n/a"
    lines += ["", f"One weight copy per stage: {param} MB.", ""]
    lines += [cost_model_markdown(summaries), ""]
    if found:
        rows = [[t.claim, t.measured, t.required, _met(t.met)] for t in found]
        lines.append(markdown_table(["target", "measured", "required", "met"], rows))
    return "\n".join(lines)


def cost_model_markdown(summaries: list[VariantSummary]) -> str:
    """The cost model's throughput from each variant's measured stage times against the
    measured throughput (issue 14 asks for errors within 5%)."""
    header = [
        "variant",
        "tokens/s measured",
        "tokens/s predicted (cost model, measured stage times)",
        "error",
    ]
    rows = []
    for s in summaries:
        if s.predicted_tokens_per_s is None:
            rows.append([s.name, f"{s.tokens_per_s:,.0f}", "n/a", "n/a"])
            continue
        error = s.predicted_tokens_per_s / s.tokens_per_s - 1
        rows.append([
            s.name, f"{s.tokens_per_s:,.0f}", f"{s.predicted_tokens_per_s:,.0f}", f"{error:+.1%}"
        ])  # fmt: skip
    return markdown_table(header, rows, align="lrrr")


def ordered(names: Sequence[str]) -> list[str]:
    """``names`` in the order of :data:`VARIANTS` (ours first, then torch's)."""
    return [name for name in VARIANTS if name in names]
