"""``nobubble schedule``: generate, lower, simulate, check and draw pipeline schedules."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence

from tqdm import tqdm

from nobubble.config.fields import NON_NEGATIVE
from nobubble.config.flags import add_setting_flags, real, reals, whole
from nobubble.destinations import check_output_file
from nobubble.markdown import markdown_table
from nobubble.schedules.generators import generate
from nobubble.schedules.invariants import check_invariants
from nobubble.schedules.ir import ScheduleError
from nobubble.schedules.lowering import lower
from nobubble.schedules.registry import PIPELINE_SCHEDULES, SCHEDULE_NAMES, schedule_spec
from nobubble.schedules.render_png import render_png
from nobubble.schedules.render_text import grid_columns, render_text
from nobubble.schedules.timing import (
    MAX_SIMULATED_FORWARDS,
    SimResult,
    simulate,
    split_rank_times,
)
from nobubble.schedules.trace import write_trace

ALL = "all"  # --schedule all: every pipeline schedule
PROGRESS_DELAY_S = 1.0  # work that takes longer draws a progress bar on stderr
MAX_GRID_COLUMNS = 1_000_000  # characters of the text grid's rows, before wrapping


def _times(text: str) -> float | list[float]:
    """One time for every stage ("2") or one per stage ("1,1,2,1"), each positive."""
    values = reals()(text)
    return values[0] if len(values) == 1 else values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # a schedule worth drawing: 2bw on 4 stages, 8 microbatches a step, 3 steps (the steady state)
    add_setting_flags(
        parser,
        ("schedule", "stages", "microbatches", "steps", "chunks"),
        defaults={"schedule": "2bw", "stages": 4, "microbatches": 8, "steps": 3},
        names_of={"schedule": (*SCHEDULE_NAMES, ALL)},
        notes={
            "schedule": f"{ALL}: every pipeline schedule, compared",
            "steps": "of M microbatches each; pipedream steps after every microbatch, so it runs "
            "M*steps updates",
            "chunks": "the times below are per rank and split equally over its stages",
        },
    )
    parser.add_argument(
        "--fwd",
        type=_times,
        default=1.0,
        help="forward time, or one per stage: 1,1,2,1 (default: 1)",
    )
    parser.add_argument(
        "--bwd", type=_times, default=2.0, help="backward time, or one per stage (default: 2)"
    )
    parser.add_argument(
        "--wgrad",
        type=_times,
        help="the weight-gradient part of the backward, where a schedule splits it (zb-h1: its W "
        "takes wgrad, its I bwd - wgrad), or one per stage (default: half the backward)",
    )
    parser.add_argument(
        "--comm", type=real(NON_NEGATIVE), default=0.0, help="latency of every send (default: 0)"
    )
    parser.add_argument("--png", metavar="FILE", help="write a PNG timeline")
    parser.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace (JSON)")
    parser.add_argument(
        "--json", action="store_true", help="print a JSON summary instead of the text grid"
    )
    parser.add_argument(
        "--no-grid", action="store_true", help="print only the figures, not the text grid"
    )
    parser.add_argument(
        "--width",
        type=whole(),
        default=shutil.get_terminal_size().columns,
        help="text grid width in characters (default: the terminal's)",
    )


def _percent(x: float) -> str:
    return f"{x:.1%}"


def _stage_table(result: SimResult) -> str:
    head = "stage" if result.one_stage_per_rank else "rank"
    labels = (len(result.row_label(r, short=True)) for r in range(result.ranks))
    width = max(len(head), *labels) + 1
    lines = [f"{head.ljust(width)} busy    idle    bubble  peak activations  weight versions"]
    for s in range(result.ranks):
        lines.append(
            f"{result.row_label(s, short=True):<{width}} {result.busy[s]:<7g} {result.idle[s]:<7g} "
            f"{_percent(result.bubble_fraction[s]):<7} {result.peak_activations[s]:<17} "
            f"{result.weight_versions[s]}"
        )
    return "\n".join(lines)


def comparison_table(results: dict[str, SimResult]) -> str:
    """A Markdown table: one row per schedule."""
    header = [
        "schedule", "makespan", "bubble", "throughput (mb/unit)", "peak activations per rank",
        "weight versions per rank",
    ]  # fmt: skip
    rows = [
        [
            name,
            f"{r.makespan:g}",
            _percent(r.bubble_fraction_overall),
            f"{r.throughput:.3f}",
            str(r.peak_activations),
            str(r.weight_versions),
        ]
        for name, r in results.items()
    ]
    return markdown_table(header, rows, align="lrrrll")


def _chunks(args: argparse.Namespace, name: str) -> int | None:
    """The stages per rank asked of ``name`` (None: the schedule's own)."""
    return args.chunks if schedule_spec(name).takes_chunks else None


def _check_size(args: argparse.Namespace, name: str) -> None:
    """Refuse a shape whose actions are too many to generate, simulate and draw."""
    chunks = _chunks(args, name) or schedule_spec(name).default_chunks
    size = args.stages * chunks * args.microbatches * args.steps
    if size > MAX_SIMULATED_FORWARDS:
        shape = f"--stages {args.stages}{f' x {chunks} chunks' if chunks > 1 else ''}"
        raise ScheduleError(
            f"{name}: {shape} x --microbatches {args.microbatches} x --steps {args.steps} = "
            f"{size:,} forwards to simulate and draw, more than {MAX_SIMULATED_FORWARDS:,} "
            "(about half a minute); use fewer steps (3 show the steady state) or microbatches, "
            "or `nobubble plan` for the figures of large shapes"
        )


def _names(args: argparse.Namespace) -> tuple[str, ...]:
    """The schedules to draw: the one asked for, or under ``all`` every pipeline schedule whose
    rule on M takes the shape (each one left out named on stderr, with why)."""
    if args.schedule != ALL:
        return (args.schedule,)
    names = []
    for name in PIPELINE_SCHEDULES:
        problem = schedule_spec(name).microbatch_problem(args.stages, args.microbatches)
        if problem:
            print(f"{name}: not drawn: {problem}", file=sys.stderr)
        else:
            names.append(name)
    return tuple(names)


def _check(args: argparse.Namespace, names: Sequence[str]) -> None:
    """What can be wrong with the flags, found before any work."""
    if args.chunks is not None and args.schedule != ALL:
        problem = schedule_spec(args.schedule).chunk_problem(args.chunks)
        if problem:
            raise ScheduleError(f"--chunks: {problem}")
    for name in names:
        _check_size(args, name)
    for flag, path in (("--png", args.png), ("--trace", args.trace)):
        if path:
            check_output_file(path, flag)


def _check_grid(name: str, result: SimResult) -> None:
    """Refuse a text grid too wide to draw (before anything is written)."""
    columns = grid_columns(result)
    if columns > MAX_GRID_COLUMNS:
        raise ScheduleError(
            f"{name}: the text grid would be {columns:,} characters wide (its shortest action "
            f"gets a label's width, the whole timeline as many of those as it takes), more "
            f"than {MAX_GRID_COLUMNS:,}; use --no-grid or --json, or times closer together"
        )


def _progress(total: int) -> tqdm:
    """A bar on stderr, drawn only once the work has taken PROGRESS_DELAY_S."""
    return tqdm(
        total=total,
        delay=PROGRESS_DELAY_S,
        file=sys.stderr,
        bar_format="{desc}{percentage:3.0f}%|{bar}| {elapsed}<{remaining}",
    )


def _phase(bar: tqdm, text: str) -> None:
    bar.set_description(text, refresh=False)
    bar.update(0)  # redraws if the bar is showing (and not drawn a moment ago)


def run(args: argparse.Namespace) -> int:
    """Run ``nobubble schedule``; 0 on success, 1 if an invariant fails.

    Bad input raises :class:`ScheduleError` (or ConfigError for an output path) before any work.
    """
    names = _names(args)
    _check(args, names)
    shape = f"P={args.stages} M={args.microbatches} steps={args.steps}"
    results: dict[str, SimResult] = {}
    violations: dict[str, list[str]] = {}
    with _progress(len(names)) as bar:  # a schedule's simulation moves it by one
        for name in names:
            _phase(bar, f"{name}: generating")
            chunks = _chunks(args, name)
            actions = generate(name, args.stages, args.microbatches, args.steps, chunks)
            lowered = lower(actions)
            _phase(bar, f"{name}: simulating")
            results[name] = simulate(
                lowered,
                fwd=split_rank_times(args.fwd, actions, "--fwd"),
                bwd=split_rank_times(args.bwd, actions, "--bwd"),
                wgrad=None
                if args.wgrad is None
                else split_rank_times(args.wgrad, actions, "--wgrad"),
                comm=args.comm,
                on_progress=bar.update,
            )
            _phase(bar, f"{name}: checking invariants")
            violations[name] = check_invariants(actions, name, results[name])
            if not (args.json or args.no_grid):
                _check_grid(name, results[name])
        panels = [(f"{name} {shape}", result) for name, result in results.items()]
        if args.png:
            _phase(bar, "drawing the PNG")
            render_png(panels, args.png)
        if args.trace:
            _phase(bar, "writing the trace")
            write_trace(panels, args.trace)

    if args.json:
        summaries = {
            name: {
                "schedule": name,
                "stages": args.stages,
                "microbatches": args.microbatches,
                "steps": args.steps,
                "fwd": args.fwd,
                "bwd": args.bwd,
                "wgrad": args.wgrad,
                "chunks": results[name].stages // args.stages,
                "comm": args.comm,
                **result.summary(),
                "invariant_violations": violations[name],
            }
            for name, result in results.items()
        }
        print(json.dumps(summaries if args.schedule == ALL else summaries[args.schedule], indent=2))
    else:
        for name, result in results.items():
            title = f"{name} {shape}"
            print(title if args.no_grid else render_text(result, title=title, width=args.width))
            print(_stage_table(result))
            print(
                f"makespan {result.makespan:g}, throughput {result.throughput:.3f} "
                f"microbatches/unit, bubble {_percent(result.bubble_fraction_overall)} overall"
            )
            print("invariants: " + ("all hold" if not violations[name] else "VIOLATED"))
            for problem in violations[name]:
                print(f"  - {problem}")
            print()
        if len(results) > 1:
            print(comparison_table(results))
        for label, path in (("PNG", args.png), ("trace", args.trace)):
            if path:
                print(f"wrote {label} {path}")
    return 1 if any(violations.values()) else 0
