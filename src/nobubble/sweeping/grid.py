"""The grid file: a ``[base]`` config, phases of cartesian grids, and ``best:PHASE`` values.

    [sweep]                       # optional
    name = "paper_cpu"            # default: the file name
    out = "runs/paper_cpu"        # default: runs/<name>

    [base]                        # any TrainConfig key
    preset = "tiny"

    [[phase]]
    name = "lr_sweep"
    set = { schedule = "sync" }   # fixed in this phase
    [phase.grid]                  # cartesian product, in this order
    optim = ["adamw", "muon"]     # a list: values of a config key
    lr = [1e-3, 3e-3]
    [phase.grid.setup]            # a table: named variants, each setting several keys
    sync = { schedule = "sync" }
    "2bw+ef" = { schedule = "2bw", correction = "ef" }

Several ``[[phase.grid]]`` tables instead of one ``[phase.grid]`` make the phase the union of
their grids (e.g. another learning-rate range for one optimizer).

A value ``"best:PHASE"`` in a phase's ``set`` takes, for each run, the value that gave the lowest
mean final validation loss over the runs of the earlier phase PHASE that agree with this run on
every other key PHASE's grid varies (seeds aside). Without ``[[phase]]`` blocks, a top-level
``[grid]`` (and ``[set]``) is the one phase, and its runs go straight into ``out``.
"""

from __future__ import annotations

import collections
import difflib
import itertools
import math
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nobubble.config import (
    FIELDS,
    OLD_EF,
    ConfigError,
    Range,
    coerce,
    fold_ef,
    unknown_key_error,
)

LAUNCHERS = ("python", "torchrun")
BEST_PREFIX = "best:"
LOGS_DIR = "_sweep"  # per-run config files and logs, beside the phase folders
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
# the runs of one phase (the sizes of its grids' axes multiplied, summed over its grids)
RUNS = Range(
    1,
    10_000,
    high_open=False,
    why="each is a training run, whose folder the sweep checks before the first one starts",
)


class SweepError(ConfigError):
    """A grid file or run folder problem; the message says how to fix it."""


@dataclass(frozen=True)
class BestOf:
    """A setting whose value is the best one found by an earlier phase."""

    phase: str


@dataclass(frozen=True)
class Axis:
    """One dimension of a grid: a label and the config keys it sets for each of its values."""

    key: str
    labels: tuple[str, ...]
    settings: tuple[dict[str, Any], ...]

    def config_keys(self) -> set[str]:
        return {k for s in self.settings for k in s}


@dataclass(frozen=True)
class Point:
    name: str  # the run folder's name: axis=label pairs
    settings: dict[str, Any]  # may hold BestOf values


Grid = tuple[Axis, ...]  # a cartesian product of its axes


def grid_points(grid: Grid, base: dict[str, Any]) -> list[Point]:
    points = []
    for combo in itertools.product(*(range(len(axis.labels)) for axis in grid)):
        settings = dict(base)
        for axis, i in zip(grid, combo, strict=True):
            settings.update(axis.settings[i])
        parts = [f"{axis.key}={axis.labels[i]}" for axis, i in zip(grid, combo, strict=True)]
        points.append(Point(",".join(parts) or "run", settings))
    return points


@dataclass(frozen=True)
class Phase:
    name: str  # "" for the single phase of a file without [[phase]] blocks
    settings: dict[str, Any]  # [base] and the phase's `set`
    grids: tuple[Grid, ...]  # the phase runs the union of these grids
    launcher: str

    def varied_keys(self) -> set[str]:
        return {key for grid in self.grids for axis in grid for key in axis.config_keys()}

    def points(self) -> list[Point]:
        return [point for grid in self.grids for point in grid_points(grid, self.settings)]

    def best_refs(self) -> dict[str, BestOf]:
        return {k: v for k, v in self.settings.items() if isinstance(v, BestOf)}


@dataclass(frozen=True)
class Sweep:
    name: str
    out: Path
    phases: tuple[Phase, ...]

    def phase(self, name: str) -> Phase:
        for phase in self.phases:
            if phase.name == name:
                return phase
        names = [p.name for p in self.phases]
        raise SweepError(f"no phase {name!r}{_suggest(name, names)}; phases: {', '.join(names)}")

    def run_dir(self, phase: Phase, point: Point) -> Path:
        return self.out / phase.name / point.name

    def logs_dir(self, phase: Phase) -> Path:
        return self.out / LOGS_DIR / phase.name


def _suggest(name: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_keys(where: str, table: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for key in table:
        if key not in allowed:
            hint = _suggest(key, allowed)
            raise SweepError(f"{where}: unknown key {key!r}{hint}; allowed: {', '.join(allowed)}")


def label(value: Any) -> str:
    """A value as it appears in a run folder's name."""
    if isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, list):
        text = "x".join(map(str, value))
    else:
        text = str(value)
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", text)


def _config_values(where: str, table: Any, allow_best: bool = False) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise SweepError(f"{where} must be a table of config keys, got {table!r}")
    values = {}
    try:
        table = fold_ef({key.replace("-", "_"): value for key, value in table.items()}, warn=True)
    except ConfigError as exc:
        raise SweepError(f"{where}: {exc}") from None
    for key, value in table.items():
        if key == "out":
            raise SweepError(f"{where}: the sweep names each run's folder; set [sweep] out instead")
        if allow_best and isinstance(value, str) and value.startswith(BEST_PREFIX):
            if key not in FIELDS:
                raise SweepError(f"{where}: {unknown_key_error(key)}")
            values[key] = BestOf(value.removeprefix(BEST_PREFIX))
            continue
        try:
            values[key] = coerce(key, value)
        except ConfigError as exc:
            raise SweepError(f"{where}: {exc}") from None
    return values


def _axis(where: str, key: str, spec: Any) -> Axis:
    if isinstance(spec, list):
        if not spec:
            raise SweepError(f"{where}.{key} is an empty list; give at least one value")
        key = key.replace("-", "_")
        if key == OLD_EF:
            raise SweepError(
                f"{where}.ef: ef is the old spelling of error feedback; make the axis "
                "correction = ['none', 'ef']"
            )
        values = [_config_values(where, {key: v})[key] for v in spec]
        settings = tuple({key: v} for v in values)
        labels = tuple(label(v) for v in values)
    elif isinstance(spec, dict) and spec:
        labels = tuple(spec)
        for name in labels:
            if not _SAFE_NAME.match(name):
                raise SweepError(f"{where}.{key}: variant name {name!r} is not a plain name")
        settings = tuple(_config_values(f"{where}.{key}.{n}", spec[n]) for n in labels)
    else:
        raise SweepError(
            f"{where}.{key} must be a list of values or a table of named variants, got {spec!r}"
        )
    if len(set(labels)) != len(labels):
        raise SweepError(f"{where}.{key} lists a value twice: {', '.join(labels)}")
    return Axis(key, labels, settings)


def _grid(where: str, table: Any, fixed: dict[str, Any]) -> Grid:
    if not isinstance(table, dict):
        raise SweepError(f"{where} must be a table of key = [values] or named variants")
    grid = tuple(_axis(where, key, spec) for key, spec in table.items())
    for axis in grid:
        both = axis.config_keys() & fixed.keys()
        if both:
            raise SweepError(f"{where}: {', '.join(sorted(both))} is both in set and in the grid")
    return grid


def _phase(raw: dict[str, Any], base: dict[str, Any], where: str, name: str) -> Phase:
    fixed = _config_values(f"{where}.set", raw.get("set", {}), allow_best=True)
    tables = raw.get("grid", {})
    tables = tables if isinstance(tables, list) else [tables]  # [[phase.grid]]: a union
    grids = tuple(_grid(f"{where}.grid", table, fixed) for table in tables)
    launcher = raw.get("launcher", "python")
    if launcher not in LAUNCHERS:
        choices = ", ".join(LAUNCHERS)
        raise SweepError(f"{where}.launcher must be one of {choices}, got {launcher!r}")
    runs = sum(math.prod(len(axis.labels) for axis in grid) for grid in grids)
    refusal = RUNS.refusal(runs)
    if refusal:  # counted before any run is listed
        raise SweepError(f"{where}: the runs of its grids {refusal}")
    phase = Phase(name, {**base, **fixed}, grids, launcher)
    counts = collections.Counter(point.name for point in phase.points())
    repeated = sorted(name for name, count in counts.items() if count > 1)
    if repeated:
        raise SweepError(f"{where}: its grids give these runs twice: {', '.join(repeated)}")
    return phase


def _check_best(phases: list[Phase]) -> None:
    earlier: dict[str, Phase] = {}
    for phase in phases:
        for key, ref in phase.best_refs().items():
            source = earlier.get(ref.phase)
            if source is None:
                raise SweepError(
                    f"phase {phase.name!r}: {key} = 'best:{ref.phase}' must name an earlier phase"
                    f"{_suggest(ref.phase, earlier)}"
                )
            if key not in source.varied_keys():
                raise SweepError(
                    f"phase {phase.name!r}: {key} = 'best:{ref.phase}', but phase {ref.phase!r} "
                    f"does not vary {key} in its grid"
                )
        earlier[phase.name] = phase


def load_sweep(path: str | Path, out: str | None = None) -> Sweep:
    """Read and check a grid file; ``out`` replaces its output root."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SweepError(f"grid file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SweepError(f"cannot read grid file {path}: {exc}") from None
    _check_keys(str(path), raw, ("sweep", "base", "phase", "grid", "set"))
    header = raw.get("sweep", {})
    _check_keys(f"{path} [sweep]", header, ("name", "out"))
    name = header.get("name", path.stem)
    base = _config_values(f"{path} [base]", raw.get("base", {}))
    if "phase" in raw:
        if "grid" in raw or "set" in raw:
            raise SweepError(f"{path}: with [[phase]] blocks, put [grid] and [set] in a phase")
        phases = []
        for i, table in enumerate(raw["phase"]):
            _check_keys(f"{path} phase {i + 1}", table, ("name", "set", "grid", "launcher"))
            phase_name = table.get("name", "")
            if not isinstance(phase_name, str) or not _SAFE_NAME.match(phase_name):
                raise SweepError(
                    f"{path} phase {i + 1}: needs a name of letters, digits, '_', '.', '+' or "
                    f"'-' (it names the phase's folder), got {phase_name!r}"
                )
            phases.append(_phase(table, base, f"{path} phase {phase_name!r}", phase_name))
        names = [p.name for p in phases]
        if len(set(names)) != len(names):
            raise SweepError(f"{path}: phase names must differ, got {', '.join(names)}")
    else:
        phases = [_phase(raw, base, str(path), "")]
    _check_best(phases)
    return Sweep(name, Path(out or header.get("out", f"runs/{name}")), tuple(phases))
