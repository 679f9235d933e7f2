"""The numbers a command's flags take: one rule for every command.

A numeric flag declares what it accepts as a :class:`~nobubble.config.fields.Range` (with why
its limit is there, where it has one), as a setting of the training configuration does, and
takes its argparse type from :func:`whole`, :func:`real` or their list forms here. Text that is
no number of the kind, nan, inf or a value out of range is then refused while the command line
is read, before any work, in one line (:class:`OneLineParser`) that names the flag, what it
accepts and why: ``nobubble corrections: error: argument --terms: must be in [1, 1000], got
100000000 (...)``. A limit on several flags together (a product of counts) is checked by the
command with the same :meth:`Range.refusal`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

from nobubble.config.fields import POSITIVE, Range

COUNT = Range(1)  # a count of anything: at least one


class OneLineParser(argparse.ArgumentParser):
    """A parser whose errors are one line, ``PROG: error: MESSAGE``, exit 2 (argparse prints
    its whole usage before it); ``--help`` still shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parse(kind: type, text: str) -> float:
    try:
        return kind(text)
    except ValueError:
        noun = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {noun}, got {text!r}") from None


def _checked(kind: type, accepted: Range, text: str) -> float:
    value = _parse(kind, text.strip())
    refusal = accepted.refusal(value)
    if refusal:
        raise argparse.ArgumentTypeError(refusal)
    return value


def whole(accepted: Range = COUNT) -> Callable[[str], int]:
    """The argparse type of a whole-number flag that takes ``accepted``."""

    def parse(text: str) -> int:
        return int(_checked(int, accepted, text))

    return parse


def real(accepted: Range = POSITIVE) -> Callable[[str], float]:
    """The argparse type of a number flag that takes ``accepted`` (finite in any case)."""

    def parse(text: str) -> float:
        return float(_checked(float, accepted, text))

    return parse


def wholes(accepted: Range = COUNT) -> Callable[[str], list[int]]:
    """The argparse type of a flag of comma-separated whole numbers, each in ``accepted``."""

    def parse(text: str) -> list[int]:
        parts = [part for part in text.split(",") if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"must be whole numbers like 2,4,8, got {text!r}")
        return [int(_checked(int, accepted, part)) for part in parts]

    return parse


def reals(accepted: Range = POSITIVE) -> Callable[[str], list[float]]:
    """The argparse type of a flag of comma-separated numbers, each in ``accepted``."""

    def parse(text: str) -> list[float]:
        return [float(_checked(float, accepted, part)) for part in text.split(",")]

    return parse
