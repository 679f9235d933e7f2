"""PNG figures, one panel per optimizer: validation loss against steps and against training time
(mean over seeds, the seeds' min-max as a band), and final loss against a setting (mean ± std).

A run that diverged without a non-finite loss (its loss rising far above where it started) would
flatten every other curve if the axis took it in: the axis is kept to the runs that stay below
the highest loss any run started from (:func:`ceiling`), and a line that leaves it is labelled
"off the scale" with the highest value it reached.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nobubble.config.extras import require
from nobubble.reporting.groups import Group, varied_keys
from nobubble.reporting.table import COLUMN_KEYS, settings_label

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
PALETTE += ("tab:pink", "tab:gray", "tab:olive", "tab:cyan")


def panels(groups: Sequence[Group]) -> dict[str, list[Group]]:
    by_optim: dict[str, list[Group]] = {}
    for group in groups:
        by_optim.setdefault(group.optim, []).append(group)
    return by_optim


def line_label(group: Group, panel: Sequence[Group], hide: Sequence[str] = ()) -> str:
    """The setup plus whatever else varies within the panel."""
    keys = varied_keys(panel, exclude=(*COLUMN_KEYS, *hide))
    return " ".join(filter(None, [group.setup, settings_label(group, keys)]))


class Colors:
    """The same label gets the same color in every panel."""

    def __init__(self) -> None:
        self.assigned: dict[str, str] = {}

    def __call__(self, label: str) -> str:
        if label not in self.assigned:
            self.assigned[label] = PALETTE[len(self.assigned) % len(PALETTE)]
        return self.assigned[label]


def figure_with_panels(names: Sequence[str]) -> tuple[Figure, list[Axes]]:
    cols = min(4, len(names))
    rows = math.ceil(len(names) / cols)
    figure = require("matplotlib.figure", "drawing the report's figures")
    fig = figure.Figure(figsize=(4.2 * cols, 3.4 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True).ravel().tolist()
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    for ax, name in zip(axes, names, strict=False):
        ax.set_title(name)
        ax.grid(alpha=0.3)
    return fig, axes[: len(names)]


@dataclass(frozen=True)
class Curve:
    """A group's validation loss over seeds, at the steps every seed evaluated."""

    steps: list[int]
    times: list[float]  # mean training time at each step
    mean: list[float]
    low: list[float]
    high: list[float]

    @classmethod
    def of(cls, group: Group) -> Curve:
        """Over the group's finished runs (it has at least one): a diverged one has no curve."""
        by_step = [{p.step: p for p in run.evals} for run in group.finished]
        steps = sorted(set.intersection(*(set(points) for points in by_step)))
        curve = cls(steps, [], [], [], [])
        for step in steps:
            losses = [points[step].val_loss for points in by_step]
            curve.times.append(sum(points[step].train_time_s for points in by_step) / len(by_step))
            curve.mean.append(sum(losses) / len(losses))
            curve.low.append(min(losses))
            curve.high.append(max(losses))
        return curve


def ceiling(groups: Sequence[Group]) -> float | None:
    """The highest validation loss any run had at its first evaluation (step 0: the untrained
    model). A run above it after the first fifth of training has diverged, finite or not."""
    firsts = [run.evals[0].val_loss for g in groups for run in g.finished if run.evals]
    return max(firsts) if firsts else None


def _late(curve: Curve) -> list[float]:
    """The curve after the first fifth of training, where the loss is far above the rest."""
    return [m for s, m in zip(curve.steps, curve.mean, strict=True) if s >= 0.2 * curve.steps[-1]]


def off_scale(curve: Curve, top: float | None) -> bool:
    """Whether ``curve`` rises above ``top`` (see :func:`ceiling`) after the first fifth."""
    return top is not None and bool(curve.steps) and max(_late(curve)) > top


def loss_limits(curves: Sequence[Curve], top: float | None = None) -> tuple[float, float] | None:
    """Leave out the first fifth of training, so that the differences near the end stay
    visible, and the curves that rise above ``top`` (diverged), unless every one does."""
    drawn = [c for c in curves if c.steps]
    shown = [c for c in drawn if not off_scale(c, top)] or drawn
    if not shown:
        return None
    low = min(min(c.mean) for c in shown)
    high = max(max(_late(c)) for c in shown)
    pad = 0.05 * (high - low) or 0.05
    return low - pad, high + pad


def off_scale_note(peak: float) -> str:
    return f" (off the scale: up to {peak:.3g})"


def plot_curves(groups: Sequence[Group], x: str, path: Path) -> Figure:
    """Validation loss against ``x`` ("step" or "time"), saved to ``path``; the figure."""
    by_optim = panels(groups)
    fig, axes = figure_with_panels(list(by_optim))
    colors = Colors()
    curves = {id(g): Curve.of(g) for g in groups if g.finished}
    top = ceiling(groups)
    limits = loss_limits(list(curves.values()), top)
    for ax, panel in zip(axes, by_optim.values(), strict=True):
        for group in panel:
            label = line_label(group, panel)
            color = colors(label)
            if group.diverged:
                label += f" ({group.diverged} of {len(group.runs)} diverged)"
            if not group.finished:  # only its legend entry
                ax.plot([], [], color=color, label=label, lw=1.5)
                continue
            curve = curves[id(group)]
            if limits and off_scale(curve, limits[1]):
                label += off_scale_note(max(curve.mean))
            xs = curve.steps if x == "step" else curve.times
            ax.plot(xs, curve.mean, color=color, label=label, lw=1.5)
            if len(group.finished) > 1:
                ax.fill_between(xs, curve.low, curve.high, color=color, alpha=0.2, lw=0)
        ax.set_xlabel("step" if x == "step" else "training time (s)")
        ax.legend(fontsize="small")
    if limits:
        axes[0].set_ylim(*limits)
    axes[0].set_ylabel("validation loss")
    fig.savefig(path, dpi=120)
    return fig


def final_limits(groups: Sequence[Group]) -> tuple[float, float] | None:
    """The final-loss axis when some finite final loss lies above :func:`ceiling` (a run that
    diverged without a non-finite loss): the other groups' range; None (matplotlib's own) when
    none does, or every one does."""
    top = ceiling(groups)
    finite = [g.loss for g in groups if math.isfinite(g.loss.mean)]
    shown = [s for s in finite if top is None or s.mean <= top]
    if len(shown) in (0, len(finite)):
        return None
    spread = [0.0 if math.isnan(s.std) else s.std for s in shown]
    low = min(s.mean - d for s, d in zip(shown, spread, strict=True))
    high = max(s.mean + d for s, d in zip(shown, spread, strict=True))
    pad = 0.05 * (high - low) or 0.05
    return low - pad, high + pad


def _x_key(panel: Sequence[Group], keys: Sequence[str]) -> str | None:
    varied = set(varied_keys(panel))
    return next((k for k in keys if k in varied), None)


def _log_scale(key: str, values: Sequence[object]) -> bool:
    numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    spread = bool(numbers) and min(numbers) > 0 and max(numbers) >= 10 * min(numbers)
    return key == "lr" or spread


def plot_final_vs(groups: Sequence[Group], keys: Sequence[str], path: Path) -> bool:
    """Final validation loss against the first of ``keys`` that varies in each optimizer's
    panel; panels where none varies are left out. False (and no file) if nothing is left."""
    chosen = {
        optim: (key, panel)
        for optim, panel in panels(groups).items()
        if (key := _x_key(panel, keys)) is not None
    }
    if not chosen:
        return False
    fig, axes = figure_with_panels(list(chosen))
    colors = Colors()
    limits = final_limits(groups)
    for ax, (key, panel) in zip(axes, chosen.values(), strict=True):
        lines: dict[str, list[Group]] = {}
        for group in (g for g in panel if math.isfinite(g.loss.mean)):  # diverged: no point
            lines.setdefault(line_label(group, panel, hide=[key]), []).append(group)
        for label, members in lines.items():
            members.sort(key=lambda g: g.settings[key])
            stats = [g.loss for g in members]
            peak = max(s.mean for s in stats)
            ax.errorbar(
                [g.settings[key] for g in members],
                [s.mean for s in stats],
                yerr=[0.0 if math.isnan(s.std) else s.std for s in stats],
                marker="o",
                capsize=3,
                color=colors(label),
                label=label + (off_scale_note(peak) if limits and peak > limits[1] else ""),
            )
        if _log_scale(key, [g.settings[key] for g in panel]):
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.legend(fontsize="small")
    if limits:
        axes[0].set_ylim(*limits)
    axes[0].set_ylabel("final validation loss")
    fig.savefig(path, dpi=120)
    return True
