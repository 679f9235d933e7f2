"""``nobubble``: the command line (train, and the tools: schedule, sweep, report, bench, export,
eval, plan, corrections, gpu-check).

Every field of :class:`nobubble.config.TrainConfig` is a flag (``--batch-size 32``; booleans also
``--no-ef``) and a ``key=value`` override; ``--config FILE.toml`` supplies a base layer.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

from nobubble.config import (
    FIELDS,
    OLD_EF,
    NobubbleWarning,
    TrainConfig,
    fold_ef,
    load_toml,
    parse_overrides,
)
from nobubble.config.flags import OneLineParser, add_setting_flags
from nobubble.configure import REGISTRY_NAMES, asks_for_auto, build_config
from nobubble.corrections.auto import choose
from nobubble.layout import first_process
from nobubble.run.telling import Told, tell, user_errors
from nobubble.settings_read import READ_WHEN, RunFacts, UnusedSettingWarning, unused_settings


class AnyOrderParser(OneLineParser):
    """A command's parser whose flags and positional words mix in any order
    (``train steps=3 --out X lr=1e-3``, ``report A --out R B``): argparse's intermixed parsing;
    its errors are one line.

    Plain parsing gives the positional words one place: after the first flag, the words after
    a later flag are "unrecognized arguments". A command with steps of its own (``gpu-check
    plan``) is parsed plainly: argparse cannot intermix a choice of subcommand.
    """

    _intermixing = False

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # the intermixed parse's own passes (up to Python 3.12), or a command with steps
        if self._intermixing or self._subparsers is not None:
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.toml", help="base configuration file")
    group = parser.add_argument_group("configuration (also settable as key=value)")
    notes = {name: f"read only when {when.when}" for name, when in READ_WHEN.items()}
    add_setting_flags(group, FIELDS, names_of=REGISTRY_NAMES, notes=notes, layer=True)
    # the old flag of error feedback, read as --correction ef (fold_ef); not in the help
    group.add_argument(
        f"--{OLD_EF}",
        dest=OLD_EF,
        action="store_true",
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
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
    flags = {name: getattr(args, name) for name in (*FIELDS, OLD_EF) if hasattr(args, name)}
    return [base, fold_ef(flags, warn=True), parse_overrides(args.overrides)]


def chosen_keys(layers: Sequence[dict]) -> set[str]:
    """The settings the user chose in :func:`config_layers`: every flag and ``key=value`` word,
    and each key of the ``--config`` file whose value is not the default (a file may list every
    key: a sweep writes each run's whole config)."""
    base, *typed = layers
    chosen = {key for key, value in base.items() if value != FIELDS[key].default}
    return chosen | {key for layer in typed for key in layer}


def warn_unused_settings(cfg: TrainConfig, chosen: set[str], torchrun: bool) -> None:
    """Warn about each of the ``chosen`` settings that this run never reads."""
    for message in unused_settings(cfg, chosen, RunFacts.of(cfg, torchrun)).values():
        warnings.warn(message, UnusedSettingWarning, stacklevel=2)


def cmd_train(args: argparse.Namespace) -> int:
    from nobubble.run.torchrun import launched_by_torchrun
    from nobubble.run.train import train
    from nobubble.runfolder.resume import RunFinished, resumed_config

    layers, torchrun = config_layers(args), launched_by_torchrun()
    cfg = resumed_config(Path(args.resume), *layers) if args.resume else build_config(*layers)
    if first_process():  # one warning, not one per pipeline stage
        if asks_for_auto(layers):
            print(f"nobubble: {choose(cfg).why}", flush=True)
        # a resumed run's saved settings are no layer: only what is given now is named
        warn_unused_settings(cfg, chosen_keys(layers), torchrun)
    try:
        train(cfg, args.overwrite, resume=bool(args.resume), auto_resume=args.auto_resume)
    except RunFinished as finished:
        if first_process():  # one line, not one per pipeline stage
            print(f"nobubble: {finished}")
        return 0
    return 0


def build_parser() -> argparse.ArgumentParser:
    from nobubble import bench, corrections_cli
    from nobubble.downstream import cli as eval_cli
    from nobubble.gpu_check import cli as gpu_check_cli
    from nobubble.hf import cli as export_cli
    from nobubble.planning import cli as plan_cli
    from nobubble.reporting import cli as report_cli
    from nobubble.schedules import cli as schedule_cli
    from nobubble.sweeping import cli as sweep_cli

    parser = argparse.ArgumentParser(
        prog="nobubble", description="Asynchronous pipeline-parallel LLM pretraining."
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=AnyOrderParser)

    train_parser = commands.add_parser(
        "train",
        help="train a model (one process: the one-process engine; under torchrun: the pipeline)",
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
        (
            "corrections",
            corrections_cli,
            "each delay correction's response to a unit update, mean delay and stable step",
        ),
    )
    for name, module, help_text in tools:
        sub = commands.add_parser(name, help=help_text)
        module.add_arguments(sub)
        sub.set_defaults(func=module.run)
    gpu_check = commands.add_parser("gpu-check", help="the steps of scripts/gpu_check.sh")
    gpu_check_cli.add_arguments(gpu_check)
    # its audit runs `nobubble train` through this same command line
    gpu_check.set_defaults(func=functools.partial(gpu_check_cli.run, command_line=main))
    return parser


def run_command(args: argparse.Namespace) -> int:
    from nobubble.interrupt import Interrupted

    try:
        return args.func(args)
    except Told as told:  # a pipeline rank told its error before it aborted its groups
        return told.code
    except (*user_errors(), KeyboardInterrupt) as error:
        return tell(error)
    except Interrupted as stop:  # a run, or a command's children, stopped by a signal
        if first_process():  # every rank stops after the same step: one line says so
            print(f"nobubble: {stop}", file=sys.stderr)
        return 128 + stop.signum


@contextlib.contextmanager
def warnings_in_one_line() -> Iterator[None]:
    """While a command runs, show nobubble's own warnings (:class:`NobubbleWarning`) as one
    ``nobubble: warning: ...`` line, every other warning in Python's format (its source line
    and code line point at the library that gave it). Only how a warning is shown changes:
    filters and recorders (``warnings.catch_warnings``, ``pytest.warns``) see it as before."""
    python = warnings.formatwarning

    def formatted(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        line: str | None = None,
    ) -> str:
        if issubclass(category, NobubbleWarning):
            return f"nobubble: warning: {message}\n"
        return python(message, category, filename, lineno, line)

    warnings.formatwarning = formatted
    try:
        yield
    finally:
        warnings.formatwarning = python


def main(argv: Sequence[str] | None = None) -> int:
    with warnings_in_one_line():
        code = run_command(build_parser().parse_args(argv))
    process_group = sys.modules.get("nobubble.pipeline.process_group")  # only if a run used one
    return process_group.exit_code(code) if process_group else code
