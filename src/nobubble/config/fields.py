"""What a setting is: a dataclass field with its help, its range of numbers or its choices.

Every section of the configuration (:mod:`nobubble.config.schema`) declares its fields with
:func:`setting`, so the command line, ``key=value`` words, TOML files and the checks all read
one description of each key. A field whose values are the names of a registry (presets,
optimizers, schedules, corrections) says which (``registry``); the registry itself lives above the
configuration, which imports nothing else of nobubble.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message says how."""


def as_bool(key: str, value: Any) -> bool:
    """``value`` of the true-or-false setting ``key``: a bool, or true/false, yes/no, 1/0 as
    written."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    raise ConfigError(f"{key} must be true or false, got {value!r}")


class NobubbleWarning(UserWarning):
    """A warning of nobubble's own (the command line shows it as one ``nobubble: warning:``
    line, without Python's source line and code line)."""


@dataclass(frozen=True)
class Range:
    """The values a numeric key or flag accepts: ``low`` to ``high``, each bound open or closed;
    ``why``: why a limit is there, said with a refusal (where the range alone does not say)."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = True
    why: str = ""

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def refusal(self, value: float) -> str | None:
        """``must be <range>, got <value> (<why>)`` for a value out of range, nan or inf; None
        for one it accepts. The one check of every number a setting or a flag takes."""
        if math.isfinite(value) and value in self:
            return None
        finite = " and finite" if isinstance(value, float) and self.high == math.inf else ""
        why = f" ({self.why})" if self.why else ""
        return f"must be {self}{finite}, got {value!r}{why}"

    def within(self, wider: Range) -> bool:
        """Whether every value this range takes, ``wider`` takes too."""
        low = self.low > wider.low or (
            self.low == wider.low and (self.low_open or not wider.low_open)
        )
        high = self.high < wider.high or (
            self.high == wider.high and (self.high_open or not wider.high_open)
        )
        return low and high

    def __str__(self) -> str:
        if self.high == math.inf:
            if self.low == 0 and self.low_open:
                return "positive (> 0)"
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        opening, closing = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {opening}{_number(self.low)}, {_number(self.high)}{closing}"


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
FRACTION = Range(0, 1, high_open=False)  # [0, 1]
DECAY = Range(0, 1)  # [0, 1): a decay of 1 never forgets (and Adam divides by 1 - beta^t)


# What a continued run may do with a setting (``resume``): keep it (the continuation is the same
# run), change it freely (it changes no step's result), or change it as a new parallel layout
# where every parameter keeps its gradient delay (nobubble.runfolder.resume).
KEEP, FREE, LAYOUT = "keep", "free", "layout"

# ``saved_default`` not given: a saved configuration without the key meant the default.
_THE_DEFAULT: Any = object()


def setting(
    default: Any,
    help: str,
    range: Range | None = None,
    *,
    choices: tuple[str, ...] | None = None,
    registry: str | None = None,
    resume: str = KEEP,
    saved_default: Any = _THE_DEFAULT,
) -> Any:
    """A config field. Every numeric field gives ``range``; a field of fixed words gives its
    ``choices``; a field that names a registry's entry gives the registry's name (``preset``,
    ``optim``, ``schedule``, ``correction``), checked above the configuration; ``resume`` says
    whether a continued run may change it (:data:`KEEP`, :data:`FREE`, :data:`LAYOUT`).
    ``saved_default``: what a saved configuration without this key meant (the versions before
    the key existed did what this value does), where that is not ``default``: a default may
    change, a run saved before it had the key still loads as the run it was
    (:func:`nobubble.config.parse.from_saved`)."""
    metadata = {
        "help": help,
        "range": range,
        "choices": choices,
        "registry": registry,
        "resume": resume,
        "saved_default": default if saved_default is _THE_DEFAULT else saved_default,
    }
    return field(default=default, metadata=metadata)


def suggest(name: str, options: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``options``, or nothing."""
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_choice(key: str, value: str, options: Iterable[str]) -> None:
    """Refuse ``value`` of ``key`` unless it is one of ``options``, naming them."""
    options = list(options)
    if value not in options:
        raise ConfigError(
            f"unknown {key} {value!r}{suggest(value, options)}; choose one of: {', '.join(options)}"
        )
