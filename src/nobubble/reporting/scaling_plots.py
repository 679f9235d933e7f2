"""Log-log figures of the fitted laws, one panel per optimizer, a color per delayed setup: each
ladder point's mean over seeds with the seeds' standard deviation as error bars, the law's line
and its bootstrap band.

A law has two axes; a figure against one of them holds the other at its geometric mean over the
fitted points and moves each point there along the law (its value times ``(other_ref /
other) ** other_exp``), so that every point and the line share one axis. Where the other axis is
the same at every point (a pure size or length ladder) nothing moves. A point whose mean is at or
below 0 has no place on a log scale and is only counted in the legend.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nobubble.reporting.law_fit import LEVEL, PARAMS, TOKENS, Fit
from nobubble.reporting.plots import Colors, figure_with_panels

if TYPE_CHECKING:
    from matplotlib.axes import Axes

LABELS = {
    "gap": "gap (final loss − sync's)",
    "relative_gap": "relative gap (gap / sync's loss)",
    "excess_steps": "excess steps (S / s − 1)",
}
AXIS_LABELS = {PARAMS: "non-embedding parameters", TOKENS: "tokens"}
GRID = 50


def _coords(fit: Fit, axis: str) -> tuple[list[float], list[float], list[float], float]:
    """The points' x, moved means and moved standard deviations, and the other axis's value
    they are moved to."""
    law = fit.law
    assert law is not None
    other = TOKENS if axis == PARAMS else PARAMS
    exp = law.tokens_exp if other == TOKENS else law.params_exp
    others = [getattr(p, other) for p in fit.used]
    ref = math.exp(statistics.fmean(math.log(v) for v in others))
    xs, ys, sds = [], [], []
    for point, value in zip(fit.used, others, strict=True):
        scale = (ref / value) ** exp
        sd = statistics.stdev(point.values) if len(point.values) > 1 else 0.0
        xs.append(getattr(point, axis))
        ys.append(point.mean * scale)
        sds.append(sd * scale)
    return xs, ys, sds, ref


def _law_at(fit: Fit, axis: str, x: float, ref: float) -> tuple[float, float, float]:
    law = fit.law
    assert law is not None
    params, tokens = (x, ref) if axis == PARAMS else (ref, x)
    low, high = law.interval(params, tokens, LEVEL)
    return law.value(params, tokens), low, high


def plot_law(fits: Sequence[Fit], axis: str, path: Path) -> bool:
    """One quantity's laws against ``axis``; False (and no file) if no law measured it."""
    drawn = [f for f in fits if f.law is not None and axis not in f.law.not_measured]
    if not drawn:
        return False
    by_optim: dict[str, list[Fit]] = {}
    for fit in drawn:
        by_optim.setdefault(fit.law.optim, []).append(fit)
    fig, axes = figure_with_panels(list(by_optim))
    colors = Colors()
    for ax, panel in zip(axes, by_optim.values(), strict=True):
        for fit in panel:
            _draw(ax, fit, axis, colors(fit.law.setup))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(AXIS_LABELS[axis])
        ax.legend(fontsize="small")
    axes[0].set_ylabel(LABELS[drawn[0].law.quantity])
    fig.savefig(path, dpi=120)
    return True


def _draw(ax: Axes, fit: Fit, axis: str, color: str) -> None:
    law = fit.law
    assert law is not None
    xs, ys, sds, ref = _coords(fit, axis)
    below = [min(sd, 0.9 * y) for sd, y in zip(sds, ys, strict=True)]  # stay above 0
    label = law.setup
    if len({getattr(p, TOKENS if axis == PARAMS else PARAMS) for p in fit.used}) > 1:
        label += f" (moved to {ref / 1e6:.3g} M {TOKENS if axis == PARAMS else PARAMS})"
    if fit.dropped:
        label += f" ({len(fit.dropped)} point(s) ≤ 0 not drawn)"
    ax.errorbar(xs, ys, yerr=[below, sds], fmt="o", capsize=3, color=color, label=label)
    low, high = law.params_range if axis == PARAMS else law.tokens_range
    grid = np.geomspace(low, high, GRID)
    values = [_law_at(fit, axis, float(x), ref) for x in grid]
    ax.plot(grid, [v[0] for v in values], color=color, lw=1.5)
    ax.fill_between(grid, [v[1] for v in values], [v[2] for v in values], color=color, alpha=0.2)


def draw_scaling_plots(fits: Sequence[Fit], quantities: Sequence[str], out: Path) -> list[str]:
    """``<quantity>_vs_<axis>.png`` for each quantity and axis some law measured; the names."""
    names = []
    for quantity in quantities:
        mine = [f for f in fits if f.law is not None and f.law.quantity == quantity]
        for axis in (PARAMS, TOKENS):
            name = f"{quantity}_vs_{axis}.png"
            if plot_law(mine, axis, out / name):
                names.append(name)
    return names
