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


def line_with(text: str, *parts: str) -> str:
    """The first line of ``text`` that holds every one of ``parts`` (the settings, values and
    fix a message names, in any wording around them); an AssertionError showing ``text`` if no
    line does."""
    for line in text.splitlines():
        if all(part in line for part in parts):
            return line
    raise AssertionError(f"no line holds all of {parts!r} in:\n{text}")
