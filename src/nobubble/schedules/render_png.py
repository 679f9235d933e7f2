"""PNG timeline (matplotlib): one panel per schedule, one row per stage, time to the right.

Forwards are blue and backwards orange (split ones red and green, DualPipeV's overlapped F&B
purple, labelled with both halves' microbatches and stages), in alternating shades per optimizer
step; each box shows its microbatch and, below it, the weight version it computes with (or, where
a rank runs several stages, the stage). Black bars are optimizer steps; grey is idle time (the
bubble). Panels share the time axis so they compare at a glance.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from nobubble.config.extras import require
from nobubble.schedules.ir import ActionKind
from nobubble.schedules.timing import SimResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

COLORS = {  # (even step, odd step)
    ActionKind.F: ("#3b6fb6", "#86aee0"),
    ActionKind.B: ("#e07b39", "#f3b27f"),
    ActionKind.I: ("#c0392b", "#e8968c"),
    ActionKind.W: ("#2e8b57", "#8fd1a8"),
    ActionKind.FB: ("#7d3c98", "#c39bd3"),
}
IDLE_COLOR = "#e4e4e4"
INCHES_PER_UNIT = 0.3
MAX_WIDTH = 60.0


def _draw_panel(ax: Axes, title: str, result: SimResult, xmax: float) -> None:
    rows = result.ranks
    for s, stage in enumerate(result.timeline):
        ax.barh(s, result.makespan, left=0, height=0.8, color=IDLE_COLOR, zorder=0)
        for t in stage:
            a = t.action
            if a.kind is ActionKind.STEP:
                ax.plot([t.end, t.end], [s - 0.45, s + 0.45], color="black", lw=2.5, zorder=3)
                continue
            if not a.kind.is_compute:
                continue
            color = COLORS[a.kind][a.step % 2]
            ax.barh(s, t.end - t.start, left=t.start, height=0.8, color=color, ec="white", lw=0.6)
            mid = (t.start + t.end) / 2
            ax.text(
                mid,
                s - 0.1,
                "&".join(str(part.microbatch) for part in a.parts),
                ha="center",
                va="center",
                fontsize=7.5,
                color="white" if a.step % 2 == 0 else "black",
                fontweight="bold",
            )
            ax.text(
                mid,
                s + 0.25,
                f"v{a.version}"
                if result.one_stage_per_rank
                else "&".join(f"s{part.stage}" for part in a.parts),
                ha="center",
                va="center",
                fontsize=6,
                color="white" if a.step % 2 == 0 else "#333333",
            )
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_yticks(range(rows), [result.row_label(r) for r in range(rows)])
    ax.set_xlim(0, xmax)
    ax.set_title(
        f"{title}    makespan {result.makespan:g}, bubble {result.bubble_fraction_overall:.1%}, "
        f"weight versions per rank {result.weight_versions}",
        loc="left",
        fontsize=10,
    )
    ax.tick_params(axis="both", labelsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def render_png(panels: Sequence[tuple[str, SimResult]], path: str | Path) -> None:
    """Write one figure with a panel per (title, result), sharing the time axis."""
    Figure = require("matplotlib.figure", "a PNG timeline (--png)").Figure
    Patch = require("matplotlib.patches", "a PNG timeline (--png)").Patch

    xmax = max(result.makespan for _, result in panels)
    rows = sum(result.ranks for _, result in panels)
    width = min(max(xmax * INCHES_PER_UNIT + 1.5, 8.0), MAX_WIDTH)
    height = 0.45 * rows + 0.9 * len(panels) + 0.6
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(
        len(panels), 1, squeeze=False, sharex=True, height_ratios=[r.ranks for _, r in panels]
    )[:, 0]
    for ax, (title, result) in zip(axes, panels, strict=True):
        _draw_panel(ax, title, result, xmax)
    axes[-1].set_xlabel("time (simulated units)", fontsize=8)
    kinds = {t.action.kind for _, r in panels for rank in r.timeline for t in rank}
    labels = {
        ActionKind.F: "forward (microbatch / weight version, or stage)",
        ActionKind.B: "backward",
        ActionKind.I: "input-gradient backward",
        ActionKind.W: "weight-gradient backward",
        ActionKind.FB: "overlapped forward & backward (F&B)",
    }
    handles = [Patch(color=COLORS[k][0], label=text) for k, text in labels.items() if k in kinds]
    handles += [
        Patch(color="black", label="optimizer step"),
        Patch(color=IDLE_COLOR, label="idle (bubble)"),
    ]
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncols=min(len(handles), 3),
        fontsize=8,
        frameon=False,
    )
    fig.savefig(path, dpi=110)
