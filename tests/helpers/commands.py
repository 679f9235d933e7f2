"""Subcommands called in this process, as the command line would call them."""

import argparse
from types import ModuleType


def call(module: ModuleType, *argv: str) -> int:
    """Run the subcommand ``module`` (its ``add_arguments`` and ``run``) on ``argv``."""
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return module.run(parser.parse_args(list(argv)))


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]
