"""Launching the benchmark's runs: timed repeats, interleaved, and the CPU memory pass."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from nobubble.bench.load import ForeignLoad
from nobubble.bench.measure import RunResult, read_run
from nobubble.bench.report import Results
from nobubble.bench.variants import VARIANTS, Shape, Variant, command, twin
from nobubble.children import Children
from nobubble.runfolder.reading import has_summary

BUSY_CORES = 0.1  # CPU use of other processes above which a timed run counts as disturbed
# glibc gives every allocation of 64 KiB or more its own mapping and unmaps it when freed, so
# peak RSS follows the tensors alive at once instead of the allocator's high-water mark. It
# makes training about a third slower, hence a separate, short pass.
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
MEMORY_STEPS = 6


class BenchError(RuntimeError):
    """A benchmark run failed; the message holds its command and the end of its output."""


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """One intra-op thread per stage unless the caller chose otherwise (torchrun's default)."""
    return {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1", **extra}


def _failure_lines(output: str) -> str:
    """The lines that say what went wrong (any rank), then the end of the output."""
    errors = [ln for ln in output.splitlines() if "rror" in ln or "terminate" in ln]
    return "\n".join([*dict.fromkeys(errors)][-10:]) + "\n...\n" + output[-2000:]


def launch(
    children: Children,
    variant: Variant,
    processes: int,
    out: Path,
    settings: list[str],
    env: dict[str, str],
) -> int:
    """Run one variant to the end; return its exit code.

    A run whose summary exists trained to the end, so its figures stand even if a process then
    crashed while shutting down: that only gets a warning. Its output goes to a file, not a
    pipe: a run stopped with the benchmark must not block on output nobody reads any more.
    """
    cmd = command(variant, processes, out, settings)
    with tempfile.TemporaryFile("w+") as output:
        process = children.start(cmd, env=child_env(env), stdout=output, stderr=subprocess.STDOUT)
        code = children.wait(process)
        output.seek(0)
        text = output.read()
    if code != 0 and not has_summary(out):
        raise BenchError(
            f"{variant.name} failed with exit code {code}:\n{' '.join(cmd)}\n"
            + _failure_lines(text)
        )
    if code != 0:
        print(
            f"warning: {variant.name} exited with code {code} after writing its "
            f"summary; its figures are kept:\n{_failure_lines(text)}",
            file=sys.stderr,
        )
    return code


def timed_run(
    children: Children,
    variant: Variant,
    processes: int,
    out: Path,
    settings: list[str],
    retries: int,
) -> dict[str, Any]:
    """Run ``variant``, again (up to ``retries`` times) while other processes took CPU time."""
    for attempt in range(retries + 1):
        with ForeignLoad() as load:
            code = launch(children, variant, processes, out, settings, {})
        if load.cores is None or load.cores <= BUSY_CORES or attempt == retries:
            break
        print(
            f"  {variant.name}: other processes used {load.cores:.2f} cores; running it again",
            file=sys.stderr,
        )
    return {
        "exit_code": code,
        "foreign_cores": load.cores,
        "steal_cores": load.steal_cores,
        "attempts": attempt + 1,
    }


def bench_shape(args: argparse.Namespace, steps: int | None = None) -> Shape:
    """The shape of the benchmark's runs from its flags (``steps`` instead of ``--steps``)."""
    steps = args.steps if steps is None else steps
    return Shape(args.stages, args.microbatches, steps, args.batch_size, args.dp)


def _folder(variant: Variant) -> str:
    return variant.name.replace("+", "-")


def run_timed(
    args: argparse.Namespace,
    variants: list[Variant],
    common: list[str],
    runs_dir: Path,
    children: Children,
) -> tuple[Results, list[dict]]:
    """Every variant ``args.repeats`` times, interleaved (A B C, C B A, ...) so that drift
    hits all of them alike; the log says how disturbed each run was."""
    shape = bench_shape(args)
    skip_tokens = args.warmup_steps * args.batch_size * args.seq_len
    results: Results = {v.name: [] for v in variants}
    log = []
    for repeat in range(args.repeats):
        for variant in variants if repeat % 2 == 0 else variants[::-1]:
            out = runs_dir / f"{repeat}-{_folder(variant)}"
            settings = [*common, *shape.settings(variant)]
            info = timed_run(children, variant, shape.processes, out, settings, args.busy_retries)
            result: RunResult = read_run(out, skip_tokens)
            results[variant.name].append(result)
            log.append({"repeat": repeat, "variant": variant.name, "out": out, **info})
            others = "n/a" if info["foreign_cores"] is None else f"{info['foreign_cores']:.2f}"
            steal = "" if info["steal_cores"] is None else f", steal {info['steal_cores']:.2f}"
            print(
                f"[{repeat + 1}/{args.repeats}] {variant.name:12s} {result.tokens_per_s:10,.0f}"
                f" tokens/s  (other processes: {others} cores{steal})",
                file=sys.stderr,
            )
    _predict_baselines(results, log, skip_tokens)
    for entry in log:
        del entry["out"]
    return results, log


def _predict_baselines(results: Results, log: list[dict], skip_tokens: int) -> None:
    """Read torch's baseline runs again with the action times of our run of the same order and
    repeat (:func:`nobubble.bench.variants.twin`), where that ran too."""
    folders = {(entry["variant"], entry["repeat"]): entry["out"] for entry in log}
    for name, runs in results.items():
        ours = twin(VARIANTS[name]) if name in VARIANTS else None
        if ours not in results:
            continue
        for repeat, twin_run in enumerate(results[ours]):
            runs[repeat] = read_run(folders[name, repeat], skip_tokens, twin_run.ranks)


def run_memory_pass(
    args: argparse.Namespace,
    variants: list[Variant],
    common: list[str],
    runs_dir: Path,
    children: Children,
) -> Results:
    """Every variant once more for a few steps under :data:`MEMORY_ENV` (CPU only)."""
    shape = bench_shape(args, steps=min(args.steps, MEMORY_STEPS))
    results: Results = {}
    for variant in variants:
        out = runs_dir / f"memory-{_folder(variant)}"
        settings = [*common, *shape.settings(variant)]
        launch(children, variant, shape.processes, out, settings, MEMORY_ENV)
        results[variant.name] = [read_run(out, skip_tokens=0)]
        peaks = " / ".join(f"{s.peak_mem_mb:.0f}" for s in results[variant.name][0].stages)
        print(f"[memory] {variant.name:12s} peak {peaks} MB", file=sys.stderr)
    return results
