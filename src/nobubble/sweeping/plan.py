"""From grid points to planned runs: ``best:`` values resolved, full configs built and checked."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nobubble.config import ConfigError, build_config
from nobubble.sweeping.best import Choice, Pending, resolve_best
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


def _planned_run(sweep: Sweep, phase: Phase, point: Point, values: dict[str, Any]) -> PlannedRun:
    path = sweep.run_dir(phase, point)
    try:
        config = build_config({"progress": False, **values, "out": str(path)})
    except ConfigError as exc:
        where = f"{phase.name}/{point.name}" if phase.name else point.name
        raise SweepError(f"{where}: {exc}") from None
    return PlannedRun(phase.name, point.name, path, config, phase.launcher)


def check_phase(sweep: Sweep, phase: Phase) -> None:
    """Build every run's config now, each best: value stood in for by a value its phase tries,
    so that a bad combination stops the sweep before it starts rather than hours into it."""
    stand_ins = {
        key: sweep.phase(ref.phase).values_of(key)[0] for key, ref in phase.best_refs().items()
    }
    for point in phase.points():
        _planned_run(sweep, phase, point, {**point.settings, **stand_ins})
