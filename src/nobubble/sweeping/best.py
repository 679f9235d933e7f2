"""``best:PHASE`` values: the setting that did best in an earlier phase, per matching group."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nobubble.config import FIELDS
from nobubble.sweeping.grid import BestOf, Phase, Point, SweepError
from nobubble.sweeping.planned import LossOf, PlannedRun


class Pending(SweepError):
    """A ``best:`` value cannot be known yet: its phase has unfinished runs."""


@dataclass(frozen=True)
class Choice:
    key: str
    source: str  # the phase it was chosen from
    among: dict[str, Any]  # the settings of the source runs it was chosen among
    value: Any
    mean_loss: float
    runs: int
    at_edge: bool  # the smallest or largest of three or more numbers tried

    def describe(self) -> str:
        among = ", ".join(f"{k}={v}" for k, v in self.among.items()) or "all runs"
        text = (
            f"{self.key} = best of {self.source} for {among}: {self.value} "
            f"(mean final val loss {self.mean_loss:.4f} over {self.runs} runs)"
        )
        if self.at_edge:
            text += "; warning: at the edge of the values tried, a better one may lie beyond"
        return text


def _at_edge(best: Any, values: Sequence[Any]) -> bool:
    numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return len(numbers) == len(values) >= 3 and best in (min(numbers), max(numbers))


def group_of(key: str, point: Point, source: Phase) -> dict[str, Any]:
    """The settings a source run must share with ``point`` to decide its ``key``: every other
    key the source phase varies, seeds aside."""
    match_keys = sorted(source.varied_keys() - {key, "seed"})
    wanted = {k: point.settings.get(k, FIELDS[k].default) for k in match_keys}
    chained = [k for k, v in wanted.items() if isinstance(v, BestOf)]
    if chained:
        raise SweepError(
            f"{key} = 'best:{source.name}' depends on {', '.join(chained)}, itself a best: "
            "value; give it a fixed value"
        )
    return wanted


def no_run_error(key: str, source: Phase, wanted: dict[str, Any]) -> SweepError:
    return SweepError(
        f"{key} = 'best:{source.name}': phase {source.name!r} has no run with {wanted}; add "
        "those settings to its grid"
    )


def possible_values(key: str, point: Point, source: Phase) -> list[Any]:
    """Every value ``best:`` may give ``point``'s ``key``: those its group in ``source`` tries."""
    wanted = group_of(key, point, source)
    values: list[Any] = []
    for run in source.points():
        setting = {k: run.settings.get(k, FIELDS[k].default) for k in [key, *wanted]}
        if all(setting[k] == v for k, v in wanted.items()) and setting[key] not in values:
            values.append(setting[key])
    if not values:
        raise no_run_error(key, source, wanted)
    return values


def resolve_best(
    key: str, point: Point, source: Phase, source_runs: Sequence[PlannedRun], loss_of: LossOf
) -> Choice:
    """The value of ``key`` with the lowest mean final loss among the source phase's runs in
    ``point``'s group (:func:`group_of`); a failed or diverged run counts as an infinite loss."""
    wanted = group_of(key, point, source)
    candidates = [r for r in source_runs if all(getattr(r.config, k) == wanted[k] for k in wanted)]
    if not candidates:
        raise no_run_error(key, source, wanted)
    losses: dict[str, tuple[Any, list[float]]] = {}
    unfinished = 0
    for run in candidates:
        value = getattr(run.config, key)
        loss = loss_of(run)
        if loss is None:
            unfinished += 1
            continue
        losses.setdefault(repr(value), (value, []))[1].append(loss)
    if unfinished:
        raise Pending(
            f"phase {source.name!r} has {unfinished} unfinished runs that decide {key} for {wanted}"
        )
    means = {k: sum(ls) / len(ls) for k, (_, ls) in losses.items()}
    best = min(means, key=means.__getitem__)
    if means[best] == math.inf:
        raise SweepError(f"every {key} of phase {source.name!r} failed or diverged for {wanted}")
    value, best_losses = losses[best]
    tried = [v for v, _ in losses.values()]
    return Choice(
        key, source.name, wanted, value, means[best], len(best_losses), _at_edge(value, tried)
    )
