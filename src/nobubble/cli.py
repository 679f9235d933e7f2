"""``nobubble``: the command line (train, and the tools: schedule, sweep, report, bench, export,
eval, plan).

Every field of :class:`nobubble.config.TrainConfig` is a flag (``--batch-size 32``; booleans also
``--no-ef``) and a ``key=value`` override; ``--config FILE.toml`` supplies a base layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from nobubble.config import FIELDS, HINTS, ConfigError, TrainConfig, load_toml, parse_overrides
from nobubble.configure import REGISTRY_NAMES, build_config


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _choices(field: dataclasses.Field) -> str:
    """``one of: a, b; `` for a setting of fixed words or of a registry's names."""
    registry = field.metadata["registry"]
    options = REGISTRY_NAMES[registry] if registry else field.metadata["choices"]
    return f"one of: {', '.join(options)}; " if options else ""


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.toml", help="base configuration file")
    group = parser.add_argument_group("configuration (also settable as key=value)")
    for name, field in FIELDS.items():
        help_text = f"{field.metadata['help']} ({_choices(field)}default: {field.default})"
        if HINTS[name] in (bool, bool | None):
            group.add_argument(
                _flag(name),
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            group.add_argument(
                _flag(name),
                dest=name,
                metavar=name.upper(),
                default=argparse.SUPPRESS,
                help=help_text,
            )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config overrides, e.g. optim=muon lr=2e-3",
    )


def config_layers(args: argparse.Namespace) -> list[dict]:
    """--config file < flags < key=value overrides (each a dict of only what was given)."""
    base = load_toml(args.config) if args.config else {}
    flags = {name: getattr(args, name) for name in FIELDS if hasattr(args, name)}
    return [base, flags, parse_overrides(args.overrides)]


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return build_config(*config_layers(args))


def cmd_train(args: argparse.Namespace) -> int:
    from nobubble.interrupt import Interrupted
    from nobubble.pipeline.launch import launched_by_torchrun, train_pipeline
    from nobubble.resume import RunFinished, resumed_config
    from nobubble.train import train

    if args.resume:
        cfg = resumed_config(Path(args.resume), *config_layers(args))
    else:
        cfg = config_from_args(args)
    run = train_pipeline if launched_by_torchrun() else train
    try:
        run(cfg, args.overwrite, resume=bool(args.resume), auto_resume=args.auto_resume)
    except RunFinished as finished:
        if os.environ.get("RANK", "0") == "0":  # one line, not one per pipeline stage
            print(f"nobubble: {finished}")
        return 0
    except Interrupted as stop:
        print(f"nobubble: {stop}", file=sys.stderr)
        return 128 + stop.signum
    return 0


def build_parser() -> argparse.ArgumentParser:
    from nobubble import bench
    from nobubble.downstream import cli as eval_cli
    from nobubble.hf import cli as export_cli
    from nobubble.planning import cli as plan_cli
    from nobubble.reporting import cli as report_cli
    from nobubble.schedules import cli as schedule_cli
    from nobubble.sweeping import cli as sweep_cli

    parser = argparse.ArgumentParser(
        prog="nobubble", description="Asynchronous pipeline-parallel LLM pretraining."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train_parser = commands.add_parser(
        "train", help="train a model (one process: simulation; under torchrun: the pipeline)"
    )
    add_config_arguments(train_parser)
    run_folder = train_parser.add_mutually_exclusive_group()
    run_folder.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run in --out, once the new run is set up and ready to start",
    )
    run_folder.add_argument(
        "--resume",
        metavar="RUN_FOLDER",
        help="continue a run from its newest valid checkpoint (flags may change only safe keys)",
    )
    run_folder.add_argument(
        "--auto-resume",
        action="store_true",
        help="with --out: continue the run there, or start it if the folder is empty or absent "
        "(for restarts); never deletes anything",
    )
    train_parser.set_defaults(func=cmd_train)

    tools = (
        ("schedule", schedule_cli, "simulate and draw a pipeline schedule"),
        ("sweep", sweep_cli, "train every run of a grid, N at a time (resumable)"),
        ("report", report_cli, "tables and plots from run folders"),
        ("bench", bench, "pipeline throughput and memory: every schedule vs torch's pipelining"),
        ("export", export_cli, "a run's checkpoint as a Hugging Face Llama model folder"),
        ("eval", eval_cli, "benchmark scores of a run's checkpoint (lm-evaluation-harness)"),
        ("plan", plan_cli, "predicted step time and memory of every schedule on a cluster"),
    )
    for name, module, help_text in tools:
        sub = commands.add_parser(name, help=help_text)
        module.add_arguments(sub)
        sub.set_defaults(func=module.run)
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    from nobubble.checkpoint.files import CheckpointError
    from nobubble.data import DataError
    from nobubble.pipeline.comm import PeerFailure
    from nobubble.schedules import ScheduleError
    from nobubble.train import TrainingError

    return (ConfigError, DataError, TrainingError, CheckpointError, ScheduleError, PeerFailure)


def run_command(args: argparse.Namespace) -> int:
    try:
        return args.func(args)
    except user_errors() as exc:
        print(f"nobubble: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("nobubble: interrupted", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    code = run_command(build_parser().parse_args(argv))
    process_group = sys.modules.get("nobubble.pipeline.process_group")  # only if a run used one
    return process_group.exit_code(code) if process_group else code
