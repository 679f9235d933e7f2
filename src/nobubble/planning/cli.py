"""``nobubble plan``: predicted throughput and memory of every schedule on a cluster."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from nobubble.config import ConfigError, Range
from nobubble.config.fields import POSITIVE
from nobubble.config.flags import (
    SettingValue,
    add_setting_flags,
    real,
    section_of,
    whole,
    wholes,
)
from nobubble.config.parallel import ParallelSettings
from nobubble.destinations import check_output_file
from nobubble.markdown import markdown_table
from nobubble.optim.registry import OPTIMIZERS
from nobubble.planning.costs import non_embedding_parameters
from nobubble.planning.estimate import ClusterPlan, Estimate, estimate, shape_problem
from nobubble.planning.grid import grid, grid_png, grid_table
from nobubble.planning.hardware import DEVICES, LINKS, Link
from nobubble.planning.mesh import Splits, gpus_problem
from nobubble.planning.shapes import LLAMA3_FAMILY, PLANNING_SHAPES
from nobubble.planning.target import (
    FIT_COMMAND,
    TOKENS_PER_PARAMETER,
    has_law,
    read_laws,
    time_to_target,
)
from nobubble.planning.target_output import target_json, target_lines
from nobubble.schedules.registry import PIPELINE_SCHEDULES

# every count of a plan: at least one, and no more than its floating-point arithmetic holds
COUNT = Range(1, 2**53, high_open=False, why="the plan computes in floating point, exact to 2^53")
# the hardware's figures: wider than any hardware's, and narrow enough that no time of a step
# computed from them leaves floating point's range (to 0 or infinity)
BEYOND_ANY = "beyond any hardware, and the step's times leave floating point's range"
PEAK_TFLOPS = Range(1e-3, 1e6, high_open=False, why=BEYOND_ANY)
SHARE_OF_PEAK = Range(1e-3, 1, high_open=False, why=BEYOND_ANY)
GB_PER_S = Range(1e-6, 1e6, high_open=False, why=BEYOND_ANY)
LATENCY_US = Range(0, 1e9, high_open=False, why=BEYOND_ANY)
# --grid x --grid-ratios: each shape predicts every schedule (about a second on a quiet core)
GRID_SHAPES = Range(1, 64, high_open=False, why="each predicts every schedule, about a second")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # a cluster's shape, not a laptop's: llama3-8b at 4096 tokens on 4 stages, 16 microbatches
    add_setting_flags(
        parser,
        ("preset", "vocab_size", "seq_len", "stages", "microbatches", "dp", "chunks", "zero"),
        defaults={"preset": "llama3-8b", "vocab_size": 256, "seq_len": 4096, "stages": 4,
                  "microbatches": 16},
        limits=dict.fromkeys(("vocab_size", "seq_len", "stages", "microbatches", "dp", "chunks"),
                             COUNT),
        names_of={"preset": tuple(PLANNING_SHAPES)},
        notes={"vocab_size": "read only for a preset that takes it from a tokenizer; 256: bytes"},
    )  # fmt: skip
    parser.add_argument(
        "--microbatch-size",
        type=whole(COUNT),
        default=1,
        help="sequences per microbatch and replica (default: 1)",
    )
    add_setting_flags(parser, ["activation_checkpointing"])
    parser.add_argument("--gpu", default="h100", choices=list(DEVICES))
    add_setting_flags(
        parser,
        ["peak_tflops"],
        limits={"peak_tflops": PEAK_TFLOPS},
        shown={"peak_tflops": "the --gpu's"},
    )
    parser.add_argument(
        "--mfu",
        type=real(SHARE_OF_PEAK),
        default=0.4,
        help="share of the peak a stage's compute reaches (default: 0.4, an assumption)",
    )
    parser.add_argument("--p2p", default="ib-ndr", choices=list(LINKS), help="stage-to-stage link")
    parser.add_argument("--p2p-gbps", type=real(GB_PER_S), help="override its GB/s (one direction)")
    parser.add_argument("--p2p-latency-us", type=real(LATENCY_US), help="override its latency")
    parser.add_argument(
        "--allreduce", default="ib-ndr", choices=list(LINKS), help="data-parallel link"
    )
    parser.add_argument("--allreduce-gbps", type=real(GB_PER_S), help="override its GB/s")
    parser.add_argument(
        "--memory-limit-gb",
        type=real(POSITIVE),
        help="memory per GPU to fit in (default: the GPU's)",
    )
    add_setting_flags(
        parser,
        ["tp"],
        limits={"tp": COUNT},
        notes={
            "tp": "the plan: GPUs inside one node, with sequence parallelism (docs/schedules.md)"
        },
    )
    parser.add_argument(
        "--ep",
        type=whole(COUNT),
        default=1,
        help="expert-parallel GPUs per MoE block, borrowed from --dp: each holds 1/ep of the "
        "experts (default: 1)",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=whole(COUNT),
        default=8,
        help="GPUs a node's links join (default: 8)",
    )
    parser.add_argument(
        "--node-gbps",
        type=real(GB_PER_S),
        help="GB/s (one direction) between a node's GPUs (default: the --gpu's NVLink)",
    )
    parser.add_argument(
        "--gpus",
        type=whole(COUNT),
        help="check that the plan uses this many GPUs (--stages x --dp x --tp)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--grid",
        type=SettingValue("stages", COUNT, many=True),
        metavar="P,P,...",
        help="instead of one shape: 2bw against the best synchronous schedule for each of these "
        "stage counts P, with M = r·P for each r of --grid-ratios (--stages and "
        "--microbatches are then ignored)",
    )
    parser.add_argument(
        "--grid-ratios",
        type=wholes(COUNT),
        default="1,2,4,8",
        metavar="R,R,...",
        help=f"M/P ratios (default 1,2,4,8); at most {GRID_SHAPES.high:,} shapes in all",
    )
    parser.add_argument("--png", type=Path, help="with --grid: also draw it into this PNG")
    add_setting_flags(
        parser,
        ["optim"],
        defaults={"optim": None},
        names_of={"optim": OPTIMIZERS},
        notes={
            "optim": "given: also each schedule's time to the synchronous run's final loss with "
            "this optimizer, from the fitted law of the delay's extra steps"
        },
    )
    parser.add_argument(
        "--laws",
        type=Path,
        metavar="PATH",
        help=f"with --optim: the fitted laws ({FIT_COMMAND} writes them; default: the "
        "shipped ones)",
    )
    parser.add_argument(
        "--tokens",
        type=real(POSITIVE),
        help=f"with --optim: the tokens to train on (default: {TOKENS_PER_PARAMETER} per "
        "non-embedding parameter)",
    )


def _link(link: Link, gbps: float | None, latency_us: float | None) -> Link:
    return dataclasses.replace(
        link,
        gb_per_s=link.gb_per_s if gbps is None else gbps,
        latency_us=link.latency_us if latency_us is None else latency_us,
    )


def plan_from_args(args: argparse.Namespace) -> ClusterPlan:
    """The plan the flags ask for (each number already in its range: add_arguments)."""
    model = PLANNING_SHAPES[args.preset]
    if model.vocab_size is None:
        model = dataclasses.replace(model, vocab_size=args.vocab_size)
    device = DEVICES[args.gpu]
    if args.peak_tflops is not None:
        device = dataclasses.replace(device, peak_tflops=args.peak_tflops)
    plan = ClusterPlan(
        model=model,
        parallel=section_of(ParallelSettings, args),
        microbatch_size=args.microbatch_size,
        seq_len=args.seq_len,
        device=device,
        mfu=args.mfu,
        p2p=_link(LINKS[args.p2p], args.p2p_gbps, args.p2p_latency_us),
        allreduce=_link(LINKS[args.allreduce], args.allreduce_gbps, None),
        activation_checkpointing=args.activation_checkpointing,
        splits=Splits(tp=args.tp, ep=args.ep, gpus_per_node=args.gpus_per_node),
        node_link=_link(LINKS[device.node_link], args.node_gbps, None),
    )
    if args.gpus:
        if args.grid:
            raise ConfigError("--gpus checks one plan, not a --grid; leave out one of them")
        problem = gpus_problem(plan.parallel.stages, plan.parallel.dp, args.tp, args.gpus)
        if problem:
            raise ConfigError(problem)
    return plan


def estimates(plan: ClusterPlan) -> tuple[list[Estimate], dict[str, str]]:
    """Every schedule's prediction, fastest first, and why the others cannot run this shape."""
    done, skipped = [], {}
    for name in PIPELINE_SCHEDULES:
        problem = shape_problem(plan, name)
        if problem:
            skipped[name] = problem
            continue
        done.append(estimate(plan, name))
    return sorted(done, key=lambda p: p.step_s), skipped


def largest_fitting(plan: ClusterPlan, schedule: str, limit_gb: float) -> str:
    """The largest of the Llama 3 shapes whose peak memory per GPU under ``schedule`` and the
    rest of ``plan`` fits in ``limit_gb`` ("none" if not even the smallest)."""
    fitting = "none"
    splits = dataclasses.replace(plan.splits, ep=1)  # dense: the ep replicas are plain replicas
    for name in LLAMA3_FAMILY:
        if splits.problem(plan.parallel.dp, PLANNING_SHAPES[name]):  # --tp 16: 8 key/value heads
            break
        shape = dataclasses.replace(plan, model=PLANNING_SHAPES[name], splits=splits)
        if shape_problem(shape, schedule) is None:
            if estimate(shape, schedule).peak_memory_gb > limit_gb:
                break
            fitting = name
    return fitting


def table(results: list[Estimate], limit_gb: float, largest: dict[str, str]) -> str:
    header = [
        "schedule", "step (ms)", "tokens/s", "bubble", "data-parallel comm. exposed (ms)",
        "peak memory per GPU (GB)", "fits", "largest Llama 3 that fits",
    ]  # fmt: skip
    rows = [
        [
            p.schedule,
            f"{p.step_s * 1e3:.1f}",
            f"{p.tokens_per_s:,.0f}",
            f"{p.bubble:.1%}",
            f"{p.exposed_dp_s * 1e3:.1f}",
            f"{p.peak_memory_gb:.1f}",
            "yes" if p.peak_memory_gb <= limit_gb else "no",
            largest[p.schedule],
        ]
        for p in results
    ]
    return markdown_table(header, rows, align="lrrrrrll")


def check_grid(args: argparse.Namespace) -> None:
    """Refuse a grid of more shapes than :data:`GRID_SHAPES` allows, before any is predicted."""
    refusal = GRID_SHAPES.refusal(len(args.grid) * len(args.grid_ratios))
    if refusal:
        raise ConfigError(f"the shapes of --grid x --grid-ratios {refusal}")


def run_grid(args: argparse.Namespace, plan: ClusterPlan) -> int:
    points = grid(plan, args.grid, args.grid_ratios)
    title = (
        f"{args.preset}: {plan.device.name} at MFU {plan.mfu:g}, p2p {plan.p2p.gb_per_s:g} GB/s, "
        f"dp {plan.parallel.dp}{splits_words(plan)}"
    )
    print(title)
    print(grid_table(points))
    for pt in points:
        for name, why in pt.skipped.items():
            print(f"P={pt.stages} M={pt.microbatches}: {name} not predicted: {why}")
    if args.png:
        grid_png(points, args.png, title)
        print(f"wrote {args.png}")
    return 0


def check_target_flags(args: argparse.Namespace) -> None:
    """--laws and --tokens go with --optim, and --optim with one plan."""
    if args.optim is None:
        for flag, value in (("--laws", args.laws), ("--tokens", args.tokens)):
            if value is not None:
                raise ConfigError(f"{flag} goes with --optim (the time to target); add --optim")
    elif args.grid:
        raise ConfigError("--optim times one plan, not a --grid; leave out one of them")


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    check_target_flags(args)
    laws = read_laws(args.laws) if args.optim else None  # before any work, as --png
    if args.png:  # before any work: a typo in the path costs a line, not the grid
        if not args.grid:
            raise ConfigError("--png draws a --grid; add --grid P,P,...")
        check_output_file(args.png, "--png")
    if args.grid:
        check_grid(args)
        return run_grid(args, plan)
    limit = args.memory_limit_gb or plan.device.memory_gb
    results, skipped = estimates(plan)
    fitting = [p for p in results if p.peak_memory_gb <= limit]
    best = fitting[0].schedule if fitting else None
    largest = {p.schedule: largest_fitting(plan, p.schedule, limit) for p in results}
    target = None
    if args.optim and has_law(laws, args.optim):
        tokens = args.tokens or TOKENS_PER_PARAMETER * non_embedding_parameters(plan.model)
        target = time_to_target(plan, results, laws, args.optim, tokens, limit)
    if args.json:
        shape = plan.parallel
        extra = {"time_to_target": target_json(args, plan, target)} if args.optim else {}
        print(json.dumps({
            "plan": {
                "preset": args.preset, "stages": shape.stages, "microbatches": shape.microbatches,
                "microbatch_size": plan.microbatch_size, "seq_len": plan.seq_len, "dp": shape.dp,
                "zero": shape.zero, "activation_checkpointing": plan.activation_checkpointing,
                "tp": plan.splits.tp, "ep": plan.splits.ep,
                "gpus_per_node": plan.splits.gpus_per_node, "gpus": plan.gpus,
                "node_link": dataclasses.asdict(plan.node),
                "gpu": dataclasses.asdict(plan.device), "mfu": plan.mfu,
                "p2p": dataclasses.asdict(plan.p2p),
                "allreduce": dataclasses.asdict(plan.allreduce),
                "memory_limit_gb": limit,
            },
            "predictions": [
                dataclasses.asdict(p) | {"largest_llama3_that_fits": largest[p.schedule]}
                for p in results
            ],
            "skipped": skipped,
            "best": best,
        } | extra, indent=2))  # fmt: skip
        return 0 if results else 1
    shape = plan.parallel
    print(
        f"{args.preset} on {shape.stages} x {shape.dp} {plan.device.name} (peak "
        f"{plan.device.peak_tflops:g} TFLOP/s at MFU {plan.mfu:g}), M={shape.microbatches} x "
        f"{plan.microbatch_size} x {plan.seq_len} tokens, p2p {plan.p2p.name}, dp all-reduce "
        f"{plan.allreduce.name}, zero={shape.zero}, activation checkpointing "
        f"{'on' if plan.activation_checkpointing else 'off'}{splits_words(plan)}"
    )
    if results:
        print(table(results, limit, largest))
    for name, why in skipped.items():
        print(f"{name}: not predicted: {why}")
    print(conclusion(plan, results, limit, best))
    if args.optim:
        print()
        print("\n".join(target_lines(args, plan, target, limit)))
    return 0 if results else 1


def splits_words(plan: ClusterPlan) -> str:
    """The title's words on the splits inside a stage ("" with none)."""
    splits = plan.splits
    if splits.tp == 1 and splits.ep == 1:
        return ""
    words = f"; {plan.gpus} GPUs: tp={splits.tp} on {plan.node.name} ({plan.node.gb_per_s:g} GB/s)"
    if splits.ep > 1:
        words += f", ep={splits.ep} on {plan.ep_link.name} ({plan.ep_link.gb_per_s:g} GB/s)"
    return words


def conclusion(plan: ClusterPlan, results: list[Estimate], limit: float, best: str | None) -> str:
    """The last line: the best schedule that fits, or why there is none."""
    if not results:
        return (
            f"no schedule could be predicted for P={plan.parallel.stages}, "
            f"M={plan.parallel.microbatches}: none "
            "can run this shape (each one's reason is above)"
        )
    if best is None:
        return f"no schedule fits in {limit:g} GB per GPU"
    return f"best under {limit:g} GB per GPU: {best}"
