"""``nobubble bench``: every schedule on our runtime and torch's, back to back, one report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nobubble.bench.report import (
    dp_markdown,
    markdown,
    option_summary,
    options_markdown,
    ordered,
    summarize,
    targets,
    zero_markdown,
)
from nobubble.bench.runner import (
    BUSY_CORES,
    MEMORY_STEPS,
    BenchError,
    bench_shape,
    run_memory_pass,
    run_timed,
)
from nobubble.bench.variants import (
    DEFAULT_VARIANTS,
    FIXED_SETTINGS,
    OPTIONS,
    VARIANTS,
    ZERO_SUFFIX,
    Shape,
    Variant,
    option_sets,
    with_options,
    with_zero,
)
from nobubble.children import stopping
from nobubble.config import ConfigError, Range, parse_overrides, zero_problem
from nobubble.config.fields import NON_NEGATIVE
from nobubble.config.flags import OneLineParser, add_setting_flags, whole
from nobubble.config.parallel import ParallelSettings
from nobubble.configure import REGISTRY_NAMES, build_config
from nobubble.destinations import check_output_file, make_output_folder
from nobubble.provenance import machine, provenance
from nobubble.schedules.registry import SCHEDULE_NAMES, schedule_spec
from nobubble.schedules.timing import MAX_SIMULATED_FORWARDS

# The measured configuration of docs/benchmarks.md, and a seconds-long smoke run.
DEFAULTS = dict(
    steps=40, repeats=3, warmup_steps=2, batch_size=16, seq_len=256, busy_retries=2,
    memory_pass=True,
)  # fmt: skip
QUICK = dict(
    steps=4, repeats=1, warmup_steps=1, batch_size=8, seq_len=32, busy_retries=0,
    memory_pass=False,
)  # fmt: skip
QUICK_MODEL = ("d_model=32", "n_layers=4", "n_heads=4", "n_kv_heads=2", "d_ff=64")
RUN_SIZES = ("steps", "batch_size", "seq_len")  # settings of every run DEFAULTS and QUICK size
# the zero levels measured beside each variant with zero=0
ZERO_LEVELS = Range(1, 2, high_open=False, why="each variant runs with zero=0 anyway")
# each repeat runs every variant once more, and each retry a disturbed run again
REPEATS = Range(1, 100, high_open=False, why="each runs every variant again; medians settle")
RETRIES = Range(0, 10, high_open=False, why="each reruns a whole run; a machine that stays busy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # the measured shape of docs/benchmarks.md: 2 stages, 4 microbatches; the run's length and
    # batch from DEFAULTS, or QUICK with --quick (resolve)
    add_setting_flags(
        parser,
        ("stages", "microbatches", "dp", "zero", "steps", "batch_size", "seq_len", "preset"),
        defaults={"stages": 2, "microbatches": 4, "zero": None, **dict.fromkeys(RUN_SIZES)},
        limits={"zero": ZERO_LEVELS},
        lists=("zero",),
        names_of=REGISTRY_NAMES,
        notes={
            "zero": "with --dp > 1: also each of our variants with sharded state at these zero "
            "levels (1, 2 or 1,2), reported against the same variant with zero=0",
        },
        shown={
            "zero": "none",
            **{key: f"{DEFAULTS[key]}, {QUICK[key]} with --quick" for key in RUN_SIZES},
        },
    )
    add_setting_flags(
        parser,
        ["device"],
        defaults={"device": "cpu"},
        limits={"device": ("cpu", "cuda")},
        notes={"device": "cuda: one GPU per stage and replica"},
    )
    parser.add_argument(
        "--repeats",
        type=whole(REPEATS),
        help=f"runs of every variant, interleaved, {REPEATS} (default: 3)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=whole(NON_NEGATIVE),
        help="first steps left out of tokens/s (default: 2)",
    )
    parser.add_argument(
        "--schedules",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated variants (default: all of {', '.join(DEFAULT_VARIANTS)}; also "
        f"{', '.join(v for v in VARIANTS if v not in DEFAULT_VARIANTS)})",
    )
    parser.add_argument(
        "--options",
        metavar="SETS",
        help="also run each of our variants with these speed and memory options, e.g. "
        "compile,ac,compile+ac (ac: activation_checkpointing), and report them against the "
        "variant without them (default: none)",
    )
    parser.add_argument(
        "--busy-retries",
        type=whole(RETRIES),
        help=f"run a variant again, up to this many times ({RETRIES}), while other processes use "
        f"more than {BUSY_CORES} cores during it (default: 2; 0 with --quick)",
    )
    parser.add_argument(
        "--memory-pass",
        action=argparse.BooleanOptionalAction,
        help=f"on the CPU, run every variant once more for {MEMORY_STEPS} steps with RSS "
        "following live tensors, for the memory figures (default: on; off with --quick)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a very small model for a few steps, once (a smoke test, not a measurement)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    parser.add_argument(
        "--runs-dir", metavar="DIR", help="keep the run folders here (default: a temporary one)"
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="more config settings, e.g. d_model=384"
    )


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags left unset from DEFAULTS, or from QUICK with --quick."""
    defaults = QUICK if args.quick else DEFAULTS
    values = {
        key: default if getattr(args, key) is None else getattr(args, key)
        for key, default in defaults.items()
    }
    return argparse.Namespace(**{**vars(args), **values})


def check_counts(args: argparse.Namespace) -> None:
    """What the counts that size the runs ask together, checked before the first run (``args``
    resolved; each count is in its range: add_arguments)."""
    chunks = max(schedule_spec(name).default_chunks for name in SCHEDULE_NAMES)
    forwards = args.stages * chunks * args.microbatches * args.steps
    if forwards > MAX_SIMULATED_FORWARDS:
        raise ConfigError(
            f"--stages {args.stages} x {chunks} chunks (interleaving) x --microbatches "
            f"{args.microbatches} x --steps {args.steps} = {forwards:,} forwards, more than the "
            f"{MAX_SIMULATED_FORWARDS:,} a run's steps may take: each run is simulated again "
            "for its bubble (about half a minute at that); use fewer steps"
        )
    if args.warmup_steps >= args.steps:
        raise ConfigError(
            f"--warmup-steps {args.warmup_steps} leaves none of the {args.steps} steps to time "
            f"(tokens/s leaves the warm-up steps out); use --warmup-steps {args.steps - 1} or "
            f"fewer, or --steps {args.warmup_steps + 1} or more"
        )


def selected_variants(spec: str) -> list[Variant]:
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        raise ConfigError(f"unknown variants {unknown}; choose from: {', '.join(VARIANTS)}")
    return [VARIANTS[name] for name in ordered(names)]


def common_settings(args: argparse.Namespace) -> list[str]:
    """The settings every variant shares (the user's last), checked against ours."""
    ours = [
        f"preset={args.preset}",
        f"seq_len={args.seq_len}",
        f"device={args.device}",
        *FIXED_SETTINGS,
        *(QUICK_MODEL if args.quick else ()),
    ]
    controlled = set(parse_overrides(ours)) | {f.name for f in dataclasses.fields(Shape)}
    controlled |= {"schedule", "out", "correction", "zero"}
    if args.options:
        controlled |= set(parse_overrides(OPTIONS.values()))
    clash = sorted(controlled & set(parse_overrides(args.overrides)))
    if clash:
        raise ConfigError(
            f"the benchmark sets {', '.join(clash)} itself; use its flags (see --help)"
        )
    return ours + list(args.overrides)


def machine_info() -> dict[str, Any]:
    """The machine (:func:`nobubble.provenance.machine`), Python's version and the code."""
    return {**machine(), "python": platform.python_version(), **provenance()}


def cpu_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def oversubscribed(args: argparse.Namespace) -> str | None:
    """Why throughput cannot be judged (more processes than CPU cores), or None."""
    processes, cores = args.stages * args.dp, cpu_cores()
    if args.device != "cpu" or processes <= cores:
        return None
    return f"{processes} processes on {cores} CPU cores"


def oversubscription_note(reason: str) -> str:
    return (
        f"Oversubscribed: {reason}, each with gloo's all-reduce thread beside it. The processes "
        "take turns on the cores, so tokens/s and its ratios are not those of as many devices: "
        "the speed targets are reported, not judged. What holds: the bytes every all-reduce "
        "carries (exact), and per stage how much of the all-reduce time the stage waited for "
        "under each schedule (hidden vs exposed). The all-reduce time includes waiting for the "
        "replica that reaches the step last, and its reduction competes for the same cores as "
        "the compute it runs behind."
    )


def header(args: argparse.Namespace, info: dict[str, Any], log: list[dict]) -> str:
    """What was run, on what, and how disturbed the machine was."""
    others = [entry["foreign_cores"] for entry in log if entry["foreign_cores"] is not None]
    busiest = f"{max(others):.2f}" if others else "n/a"
    steals = [entry.get("steal_cores") for entry in log if entry.get("steal_cores") is not None]
    steal = (
        f"; the hypervisor stole {min(steals):.2f}-{max(steals):.2f} cores (not counted as "
        "other processes)"
        if steals
        else ""
    )
    dp = f" dp={args.dp} ({args.stages * args.dp} processes)" if args.dp > 1 else ""
    return (
        f"P={args.stages}{dp} M={args.microbatches} steps={args.steps} batch={args.batch_size} "
        f"seq_len={args.seq_len} preset={args.preset} {' '.join(args.overrides)}\n"
        f"{args.device}: {info['gpu'] or info['cpu']} ×{info['cpus']}, torch {info['torch']}, "
        f"nobubble {info['nobubble']}; medians of {args.repeats} interleaved repeats; tokens/s "
        f"leaves out the first {args.warmup_steps} steps; other processes used at most "
        f"{busiest} cores during a timed run{steal}"
    )


def check_device(device: str, stages: int, dp: int = 1) -> None:
    """On CUDA every process (a stage of a replica) takes its own GPU (NCCL refuses two ranks
    on one)."""
    if device != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here; use --device cpu")
    gpus, needed = torch.cuda.device_count(), stages * dp
    if gpus < needed:
        asked = f"--stages {stages}" if dp == 1 else f"--stages {stages} x --dp {dp}"
        raise ConfigError(
            f"--device cuda runs one GPU per stage and replica: {asked} needs {needed} GPUs, "
            f"this machine has {gpus}"
        )


def run(args: argparse.Namespace) -> int:
    args = resolve(args)
    try:
        check_counts(args)
        variants = selected_variants(args.schedules)
        if args.options:
            variants = with_options(variants, option_sets(args.options))
        if args.zero:
            problem = zero_problem(ParallelSettings(dp=args.dp, zero=max(args.zero)))
            if problem:
                raise ConfigError(problem)
            variants = with_zero(variants, sorted(set(args.zero)))
        common = common_settings(args)
        shape: Shape = bench_shape(args)
        for variant in variants:  # every config error before the first launch
            build_config(parse_overrides([*common, *shape.settings(variant)]))
        check_device(args.device, args.stages, args.dp)
        if args.json:
            check_output_file(args.json, "--json")
        if args.runs_dir:
            make_output_folder(args.runs_dir, "--runs-dir")
        # the runs in flight are stopped before their scratch folder goes
        with (
            tempfile.TemporaryDirectory(prefix="nobubble-bench-") as scratch,
            stopping("bench", "no figures written (run it again)") as children,
        ):
            runs_dir = Path(args.runs_dir or scratch)
            results, log = run_timed(args, variants, common, runs_dir, children)
            memory = None
            if args.memory_pass and args.device == "cpu":
                memory = run_memory_pass(args, variants, common, runs_dir, children)
    except (ConfigError, BenchError) as exc:
        print(f"nobubble bench: error: {exc}", file=sys.stderr)
        return 2
    summaries = [summarize(name, results, memory) for name in results]
    crowded = oversubscribed(args)
    found = targets(results, memory, args.stages, args.microbatches, crowded)
    info = machine_info()
    print(header(args, info, log) + "\n")
    print(markdown(summaries, found))
    if args.dp > 1:
        print(
            f"\nData parallelism, dp={args.dp}: per optimizer step and rank, leaving out the "
            "run's last all-reduce (waited for at the end, with nothing left to hide behind) "
            "but in the second hidden column; for a variant with sharded state (+zero) the "
            "all-reduce columns are its update's chain (reduce, norm, all-gather) and its MB "
            "the bucket and this rank's part; per-stage cells list stage 0 first:\n"
        )
        print(dp_markdown(summaries))
    if args.zero:
        print(
            "\nSharded state (zero): each variant with zero=0 and then sharded; state: the "
            "optimizer's and the correction's per rank (the most of any replica); hidden: of "
            "the update's chain of collectives (zero > 0) or the all-reduce (zero=0):\n"
        )
        print(zero_markdown(summaries, memory is not None))
    options = [
        option_summary(v.name, v.plain, results, memory)
        for v in variants
        if v.plain and ZERO_SUFFIX not in v.name
    ]
    if options:
        print(
            "\nSpeed and memory options, each against the same variant without them (tokens/s: "
            "median of the ratios of runs that ran back to back; memory per stage):\n"
        )
        print(options_markdown(options, memory is not None))
    if crowded:
        print("\n" + oversubscription_note(crowded))
    if args.json:
        payload = {
            "argv": sys.argv,
            "args": {k: v for k, v in vars(args).items() if not callable(v)},  # not `func`
            "machine": info,
            "oversubscribed": crowded,
            "runs": {name: [dataclasses.asdict(r) for r in runs] for name, runs in results.items()},
            "memory_pass": memory
            and {name: dataclasses.asdict(runs[0]) for name, runs in memory.items()},
            "log": log,
            "summary": [dataclasses.asdict(s) for s in summaries],
            "targets": [dataclasses.asdict(t) for t in found],
            "options": [dataclasses.asdict(o) for o in options],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="nobubble bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
