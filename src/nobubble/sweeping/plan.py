"""From grid points to planned runs: ``best:`` values resolved, full configs built and checked."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nobubble.config import ConfigError, TrainConfig
from nobubble.configure import build_config
from nobubble.sweeping.best import Choice, Pending, possible_values, resolve_best
from nobubble.sweeping.grid import Phase, Point, Sweep, SweepError
from nobubble.sweeping.planned import LossOf, PlannedRun


@dataclass(frozen=True)
class PhasePlan:
    runs: list[PlannedRun]
    choices: list[Choice]  # every best: value it took, once per group


def plan_phase(
    sweep: Sweep,
    phase: Phase,
    planned: dict[str, list[PlannedRun]],
    loss_of: LossOf,
    threads: Callable[[int], int],
) -> PhasePlan:
    """Every run of ``phase`` with its full config; raises Pending while a best: value is unknown.

    ``planned`` holds the runs of earlier phases; ``threads(processes)`` the torch threads of each
    process when the grid does not set them.
    """
    runs: list[PlannedRun] = []
    choices: dict[str, Choice] = {}
    for point in phase.points():
        values = dict(point.settings)
        for key, ref in phase.best_refs().items():
            if ref.phase not in planned:
                raise Pending(f"waits for phase {ref.phase!r}")
            source = sweep.phase(ref.phase)
            choice = resolve_best(key, point, source, planned[ref.phase], loss_of)
            choices.setdefault(repr((key, choice.among)), choice)
            values[key] = choice.value
        run = _planned_run(sweep, phase, point, values)
        if "threads" not in values:
            run.config.threads = threads(run.processes)
        runs.append(run)
    return PhasePlan(runs, list(choices.values()))


def _where(phase: Phase, point: Point) -> str:
    return f"{phase.name}/{point.name}" if phase.name else point.name


def _config(sweep: Sweep, phase: Phase, point: Point, values: dict[str, Any]) -> TrainConfig:
    return build_config({"progress": False, **values, "out": str(sweep.run_dir(phase, point))})


def _planned_run(sweep: Sweep, phase: Phase, point: Point, values: dict[str, Any]) -> PlannedRun:
    try:
        config = _config(sweep, phase, point, values)
    except ConfigError as exc:
        raise SweepError(f"{_where(phase, point)}: {exc}") from None
    return PlannedRun(phase.name, point.name, sweep.run_dir(phase, point), config, phase.launcher)


def _problem(sweep: Sweep, phase: Phase, point: Point) -> str | None:
    """Why ``point`` cannot run with some value its best: settings may take, or None."""
    refs = phase.best_refs()
    options = [
        [(key, v) for v in possible_values(key, point, sweep.phase(ref.phase))]
        for key, ref in refs.items()
    ]
    combinations = list(itertools.product(*options))
    failures: dict[str, str] = {}  # the best: values tried -> what is wrong
    for chosen in combinations:
        try:
            _config(sweep, phase, point, {**point.settings, **dict(chosen)})
        except ConfigError as exc:
            note = "".join(f" with {k} = {v!r} (from best:{refs[k].phase})" for k, v in chosen)
            failures[note] = str(exc)
    if not failures:
        return None
    if len(failures) == len(combinations) and len(set(failures.values())) == 1:
        return f"{_where(phase, point)}: {failures.popitem()[1]}"  # whatever the best: values
    note, why = next(iter(failures.items()))
    return f"{_where(phase, point)}{note}: {why}"


SHOWN_PROBLEMS = 20


def check_sweep(sweep: Sweep) -> None:
    """Build the config of every run of every phase now, each best: value tried with every value
    it may take, so that a bad value stops the sweep before anything trains, not hours into it."""
    problems, total = [], 0
    for phase in sweep.phases:
        for point in phase.points():
            total += 1
            try:
                problem = _problem(sweep, phase, point)
            except SweepError as exc:  # a best: value that no run can give
                problem = f"{_where(phase, point)}: {exc}"
            if problem:
                problems.append(problem)
    if problems:
        listed = "\n  ".join(problems[:SHOWN_PROBLEMS])
        more = len(problems) - SHOWN_PROBLEMS
        listed += f"\n  ... and {more} more" if more > 0 else ""
        raise SweepError(
            f"{len(problems)} of the grid's {total} runs have an invalid config; nothing was "
            f"started:\n  {listed}"
        )
