"""``nobubble gpu-check``: the steps of ``scripts/gpu_check.sh`` that run on the CPU side (the
plan, a row within its timeout, the audited ``train`` of the audit row, a comparison, the
table); :mod:`nobubble.gpu_check` says what each is."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from nobubble.config.flags import OneLineParser, whole
from nobubble.destinations import make_output_folder
from nobubble.gpu_check.audit import audit_main
from nobubble.gpu_check.parity import compare
from nobubble.gpu_check.plan import plan, planned_run, skipped, write_plan
from nobubble.gpu_check.row import run_row
from nobubble.gpu_check.table import render, write_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    steps = parser.add_subparsers(dest="step", required=True, parser_class=OneLineParser)
    planning = steps.add_parser("plan", help="the runs for N GPUs, a line each")
    planning.add_argument("--gpus", type=whole(), required=True, help="GPUs on this machine")
    planning.add_argument("--out", type=Path, required=True)
    running = steps.add_parser("row", help="one run of the plan, within its timeout")
    running.add_argument("out", type=Path)
    running.add_argument("name")
    auditing = steps.add_parser("audit", help="nobubble train, its step 1 audited for syncs")
    auditing.add_argument("folder", type=Path)
    auditing.add_argument("train", nargs=argparse.REMAINDER, metavar="-- train ARGS")
    comparing = steps.add_parser("compare", help="one run against its reference")
    comparing.add_argument("out", type=Path)
    comparing.add_argument("name")
    tabling = steps.add_parser("table", help="the table of the runs; exit 1 if one failed")
    tabling.add_argument("out", type=Path)


def run(args: argparse.Namespace, command_line: Callable[[Sequence[str]], int]) -> int:
    """The step ``args.step``; ``command_line`` runs a nobubble command line (the audit's
    ``train``)."""
    if args.step == "plan":
        make_output_folder(args.out, "--out")
        runs = plan(args.gpus)
        write_plan(args.out, args.gpus, runs, skipped(args.gpus))
        print("\n".join(run.line() for run in runs))
        return 0
    if args.step == "row":
        return run_row(args.out, planned_run(args.out, args.name))
    if args.step == "audit":
        train = args.train[1:] if args.train[:1] == ["--"] else args.train
        return audit_main(args.folder, train, command_line)
    if args.step == "compare":
        print(json.dumps(compare(args.out, args.name)))
        return 0
    rows = write_table(args.out)
    print(render(rows))
    return 1 if any(r["failed"] for r in rows) else 0
