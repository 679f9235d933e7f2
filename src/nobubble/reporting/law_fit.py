"""A :class:`nobubble.delay_law.Law` fitted to a ladder's points, with a bootstrap over seeds.

A ladder point is one (non-embedding parameters, tokens) with the quantity's value for each seed.
The law is fitted to each point's mean over seeds (the expected value at that point, which is what
a user will meet) by least squares on logarithms::

    ln mean = ln coef + params_exp ln(params / 1e6) + tokens_exp ln(tokens / 1e6)

A mean at or below 0 has no logarithm: such a point is left out of the fit and listed (a
delayed run that beats sync on average has no gap to scale). Fitting in linear space instead
would keep it, but would weigh each point by the size of its value, so that the largest gaps,
at the smallest models, decide the exponents alone across orders of magnitude; the log fit gives
every point the same weight in relative terms.

An exponent is fitted only where its axis was measured: with one value of the axis among the
points it is 0 and *not measured*; with both axes varying only together (every point on one line
in log space, as a size ladder with a tokens-per-parameter rule), the two cannot be told apart,
and the whole trend is fitted to ``params``, ``tokens`` *not measured*. A fit needs at least two
points along one axis.

The bootstrap resamples the seeds within each point (with replacement, as many as it has),
refits with the same axes, and keeps each sample's three numbers; a sample in which some point's
mean falls to 0 or below drops that point, and one that no longer determines the fit is skipped
and counted. A point with a single seed is the same in every sample.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nobubble.delay_law import UNIT, Law

PARAMS, TOKENS = "params", "tokens"
BOOTSTRAP_SAMPLES = 1000
BOOTSTRAP_SEED = 0  # the bootstrap's random generator: a report is the same every time
LEVEL = 0.9  # the intervals' share of the bootstrap samples


@dataclass(frozen=True)
class Point:
    """One rung of the ladder: its size, its tokens and the quantity for each seed."""

    params: float
    tokens: float
    values: tuple[float, ...]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)


@dataclass(frozen=True)
class Fit:
    """A law fitted to ``used``, or why there is none (``law`` None)."""

    law: Law | None
    used: tuple[Point, ...]
    dropped: tuple[Point, ...]  # mean at or below 0: no logarithm
    confounded: bool  # both axes vary, but only together: the trend is given to params
    scatter: float | None  # exp of the residuals' RMS (log space): ×1.1 is 10% off the line
    skipped_samples: int  # bootstrap samples that did not determine the fit
    why_none: str = ""

    def exponent_interval(self, axis: str, level: float = LEVEL) -> tuple[float, float] | None:
        """The central ``level`` share of the bootstrap samples' exponent of ``axis``; None if
        it was not measured or there are no samples."""
        law = self.law
        if law is None or axis in law.not_measured or not law.samples:
            return None
        column = [s[1] if axis == PARAMS else s[2] for s in law.samples]
        low, high = np.quantile(column, [(1 - level) / 2, (1 + level) / 2])
        return float(low), float(high)


def _axes(points: Sequence[Point]) -> tuple[tuple[str, ...], bool]:
    """The axes a fit to ``points`` can measure, and whether both vary but only together."""
    varies = [axis for axis in (PARAMS, TOKENS) if len({getattr(p, axis) for p in points}) > 1]
    if len(varies) < 2:
        return tuple(varies), False
    logs = np.log([[p.params, p.tokens] for p in points])
    rank = np.linalg.matrix_rank(logs - logs.mean(axis=0))
    return ((PARAMS, TOKENS), False) if rank == 2 else ((PARAMS,), True)


def _design(points: Sequence[tuple[float, float]], axes: Sequence[str]) -> np.ndarray:
    columns = [np.ones(len(points))]
    if PARAMS in axes:
        columns.append(np.log([p / UNIT for p, _ in points]))
    if TOKENS in axes:
        columns.append(np.log([t / UNIT for _, t in points]))
    return np.column_stack(columns)


def _solve(
    xy: Sequence[tuple[float, float]], means: Sequence[float], axes: Sequence[str]
) -> tuple[tuple[float, float, float], np.ndarray] | None:
    """(coef, params_exp, tokens_exp) and the log residuals; None if the points do not
    determine the axes (too few, or on one line)."""
    design = _design(xy, axes)
    if np.linalg.matrix_rank(design) < design.shape[1]:
        return None
    y = np.log(means)
    beta, *_ = np.linalg.lstsq(design, y, rcond=None)
    exps = dict(zip(axes, beta[1:], strict=True))
    numbers = (math.exp(beta[0]), float(exps.get(PARAMS, 0.0)), float(exps.get(TOKENS, 0.0)))
    return numbers, y - design @ beta


def _bootstrap(
    points: Sequence[Point], axes: Sequence[str], samples: int, seed: int
) -> tuple[list[tuple[float, float, float]], int]:
    rng = np.random.default_rng(seed)
    kept, skipped = [], 0
    for _ in range(samples):
        xy, means = [], []
        for p in points:
            drawn = rng.choice(p.values, size=len(p.values), replace=True)
            if drawn.mean() > 0:
                xy.append((p.params, p.tokens))
                means.append(float(drawn.mean()))
        solved = _solve(xy, means, axes) if xy else None
        if solved is None:
            skipped += 1
        else:
            kept.append(solved[0])
    return kept, skipped


def fit_law(
    quantity: str,
    optim: str,
    setup: str,
    points: Sequence[Point],
    samples: int = BOOTSTRAP_SAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> Fit:
    """The law of ``quantity`` for ``optim`` and ``setup`` over ``points``, with ``samples``
    bootstrap samples drawn with ``seed``."""
    used = tuple(p for p in points if p.mean > 0)
    dropped = tuple(p for p in points if p.mean <= 0)
    axes, confounded = _axes(used)
    xy = [(p.params, p.tokens) for p in used]
    solved = _solve(xy, [p.mean for p in used], axes) if axes else None
    if solved is None:
        why = (
            f"{optim} {setup} {quantity}: {len(used)} point(s) with a positive mean, none "
            "varying in size or tokens"
        )
        return Fit(None, used, dropped, confounded, None, 0, why)
    (coef, p_exp, t_exp), residuals = solved
    dof = len(used) - (1 + len(axes))
    scatter = math.exp(math.sqrt(float(residuals @ residuals) / dof)) if dof > 0 else None
    kept, skipped = _bootstrap(used, axes, samples, seed)
    law = Law(
        quantity=quantity,
        optim=optim,
        setup=setup,
        coef=coef,
        params_exp=p_exp,
        tokens_exp=t_exp,
        samples=tuple(kept),
        params_range=(min(p.params for p in used), max(p.params for p in used)),
        tokens_range=(min(p.tokens for p in used), max(p.tokens for p in used)),
        points=sum(len(p.values) for p in used),
        not_measured=tuple(a for a in (PARAMS, TOKENS) if a not in axes),
    )
    return Fit(law, used, dropped, confounded, scatter, skipped)
