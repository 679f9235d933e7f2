"""The numbers a command's flags take: one rule for every command.

A numeric flag declares what it accepts as a :class:`~nobubble.config.fields.Range` (with why
its limit is there, where it has one), as a setting of the training configuration does, and
takes its argparse type from :func:`whole`, :func:`real` or their list forms here. Text that is
no number of the kind, nan, inf or a value out of range is then refused while the command line
is read, before any work, in one line (:class:`OneLineParser`) that names the flag, what it
accepts and why: ``nobubble corrections: error: argument --terms: must be in [1, 1000], got
100000000 (...)``. A limit on several flags together (a product of counts) is checked by the
command with the same :meth:`Range.refusal`.

A command's flag for a setting of the training configuration (``--stages``, ``--dp``, ...) is
not declared by hand: :func:`add_setting_flags` makes it from the setting's field, with train's
name, help, range and choices, so a setting reads and is checked alike in every command. A
command may give its own default (``schedule`` draws 4 stages, not one), a narrower range (the
planner's counts stop at 2^53) or take a list of values (the bench's zero levels), each value
checked as the field checks one.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

from nobubble.config.fields import POSITIVE, ConfigError, Range, check_choice
from nobubble.config.parse import base_type, coerce
from nobubble.config.schema import FIELDS, HINTS

COUNT = Range(1)  # a count of anything: at least one
Section = TypeVar("Section")  # a section of the configuration (config/parallel.py, ...)


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


# -- flags made from the configuration's fields --------------------------------------------------


class SettingFlag(argparse.Action):
    """A flag made from a configuration field by :func:`add_setting_flags` (what a test holds
    every command's flag of a setting to)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)


class SettingSwitch(argparse.BooleanOptionalAction):
    """``--name``/``--no-name``: a boolean field's flag, made by :func:`add_setting_flags`."""


class SettingValue:
    """The argparse type of a setting's flag: a number as :func:`whole` or :func:`real` reads it,
    within the field's range (or ``accepted``, a narrower one a command needs); a word among the
    field's choices (or ``names``: a registry's); anything else as a ``key=value`` word reads
    it. ``many``: comma-separated values, each read so."""

    def __init__(
        self,
        name: str,
        accepted: Range | None = None,
        names: Sequence[str] | None = None,
        many: bool = False,
    ) -> None:
        field = FIELDS[name]
        own = field.metadata["range"]
        if accepted is not None and not (own is not None and accepted.within(own)):
            raise ValueError(
                f"{name}: a command's range {accepted} must lie within the field's {own}"
            )
        self.name, self.many = name, many
        self.accepted = accepted or own
        self.names = names if names is not None else field.metadata["choices"]
        self.hint, _ = base_type(HINTS[name])

    def __call__(self, text: str) -> Any:
        if not self.many:
            return self._one(text)
        parts = [part for part in text.split(",") if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"must be values like 1,2, got {text!r}")
        return [self._one(part) for part in parts]

    def _one(self, text: str) -> Any:
        if self.hint in (int, float):
            return self.hint(_checked(self.hint, self.accepted, text))
        try:
            value = coerce(self.name, text)
            if self.names is not None:
                check_choice(self.name, value, self.names)
        except ConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return value


def flag_of(name: str) -> str:
    """The flag of setting ``name``: ``--batch-size`` for ``batch_size``."""
    return "--" + name.replace("_", "-")


def add_setting_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    names: Iterable[str],
    *,
    defaults: Mapping[str, Any] | None = None,
    limits: Mapping[str, Range | tuple[str, ...]] | None = None,
    lists: Collection[str] = (),
    names_of: Mapping[str, Sequence[str]] | None = None,
    notes: Mapping[str, str] | None = None,
    shown: Mapping[str, str] | None = None,
    layer: bool = False,
) -> None:
    """A flag for each setting of ``names``, from its field: ``--name``, dest the setting's
    name, the field's help, choices and range.

    ``defaults``: the command's own, where it differs from the field's. ``limits``: a narrower
    range a command needs (within the field's), or fewer of the field's words. ``lists``:
    settings taken as comma-separated values. ``names_of``: a registry's names by registry
    (``schedule``, ``preset``, ...), for a field that takes them. ``notes``: more help.
    ``shown``: the default the help names where the command fills it in later (the flag's
    default is then None). ``layer`` (train): a flag given is one layer of the configuration,
    read and checked with the ``--config`` file and the ``key=value`` words; one not given is
    absent from the namespace."""
    defaults, limits, names_of = defaults or {}, limits or {}, names_of or {}
    notes, shown = notes or {}, shown or {}
    for name in names:
        field = FIELDS[name]
        registry, limit = field.metadata["registry"], limits.get(name)
        choices = names_of[registry] if registry else field.metadata["choices"]
        if isinstance(limit, tuple):
            if choices is None or set(limit) - set(choices):
                raise ValueError(f"{name}: a command's words {limit} must be among {choices}")
            choices, limit = limit, None
        default = defaults.get(name, field.default)
        said = [f"one of: {', '.join(choices)}" if choices else ""]
        said += [f"default: {shown.get(name, default)}", notes.get(name, "")]
        help_text = f"{field.metadata['help']} ({'; '.join(part for part in said if part)})"
        common: dict[str, Any] = dict(
            dest=name, default=argparse.SUPPRESS if layer else default, help=help_text
        )
        if HINTS[name] in (bool, bool | None):
            parser.add_argument(flag_of(name), action=SettingSwitch, **common)
            continue
        many = name in lists
        metavar = f"{name.upper()},..." if many else name.upper()
        if not layer:
            common["type"] = SettingValue(name, limit, choices, many)
        parser.add_argument(flag_of(name), action=SettingFlag, metavar=metavar, **common)


def section_of(section: type[Section], args: argparse.Namespace) -> Section:
    """The configuration section ``section`` (a dataclass of fields) from the flags in ``args``
    named as its fields; the fields without a flag at their defaults."""
    return section(
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(section)
            if hasattr(args, f.name)
        }
    )
