"""The delay's penalty in steps, from two validation curves: a synchronous run's and a delayed
run's with the same settings and seed.

A curve is the run's evaluations as (step, validation loss), by step; its *final loss* is its
last point's. Where a curve first reaches a loss is interpolated linearly between the two
evaluations around it (a curve that starts at or below the loss reaches it at its first step).

- ``sync_steps`` (s): the steps sync needed to reach the delayed run's final loss;
- ``delayed_steps``: the inverse, the steps the delayed run needed to reach sync's final loss
  (None where it never does, the usual case);
- ``excess_steps`` = S / s − 1, S being the delayed run's last step: the share of extra steps
  the delay costs (:data:`nobubble.delay_law.QUANTITIES`).

A delayed run that ends *below* sync's final loss beats sync: sync never reaches that loss at
its end, s is not measured and ``excess_steps`` (it would be negative) is None; such a run is
counted as one that beats sync, never fitted. A delayed run no better than sync's first
evaluation (s = 0) has no ``excess_steps`` either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Curve = Sequence[tuple[float, float]]  # (step, validation loss), by step


def first_reach(curve: Curve, target: float) -> float | None:
    """Where ``curve`` first falls to ``target`` or below (its first coordinate: a step, or a
    time), interpolated linearly between evaluations; None if it never does."""
    previous: tuple[float, float] | None = None
    for step, loss in curve:
        if loss <= target:
            if previous is None:
                return float(step)
            before_step, before_loss = previous
            fraction = (before_loss - target) / (before_loss - loss)
            return before_step + fraction * (step - before_step)
        previous = (step, loss)
    return None


@dataclass(frozen=True)
class Penalty:
    """What the delay costs in steps, one delayed run against its synchronous partner."""

    steps: float  # S: the delayed run's last step
    sync_steps: float | None  # s: sync's steps to the delayed final loss (None: beats sync)
    delayed_steps: float | None  # the delayed run's steps to sync's final loss (None: never)
    beats_sync: bool  # the delayed run ends below sync's final loss

    @property
    def excess_steps(self) -> float | None:
        """S / s − 1; None when the delayed run beats sync or sync got there at once (s = 0)."""
        if not self.sync_steps:
            return None
        return self.steps / self.sync_steps - 1


def penalty(sync: Curve, delayed: Curve) -> Penalty:
    """The penalty of ``delayed`` against ``sync`` (both non-empty)."""
    if not sync or not delayed:
        raise ValueError("a penalty needs two curves with at least one evaluation each")
    sync_final, delayed_final = sync[-1][1], delayed[-1][1]
    beats = delayed_final < sync_final
    return Penalty(
        steps=float(delayed[-1][0]),
        sync_steps=None if beats else first_reach(sync, delayed_final),
        delayed_steps=first_reach(delayed, sync_final),
        beats_sync=beats,
    )
