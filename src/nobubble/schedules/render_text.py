"""Text grid: one row per rank, time running left to right, wrapped to a terminal width.

Each F/B/I/W is drawn as its label (``F5v1``: forward of microbatch 5 with weight version 1;
``F5.6v1`` when ranks run several stages: the same at stage 6) padded to its duration; ``.`` is
idle time and ``|`` marks a STEP (the end of the cell before it).
"""

from __future__ import annotations

import math

from nobubble.schedules.ir import Action, ActionKind
from nobubble.schedules.timing import SimResult

IDLE = "."
STEP_MARK = "|"
TICKS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 100_000, 1_000_000)


def cell_label(a: Action, with_stage: bool = False) -> str:
    stage = f".{a.stage}" if with_stage else ""
    return f"{a.kind}{a.microbatch}{stage}v{a.version}"


def _time_scale(result: SimResult) -> int:
    """Characters per time unit: enough for the shortest compute to show its label and a space."""
    compute = [t for rank in result.timeline for t in rank if t.action.kind.is_compute]
    shortest = min(t.end - t.start for t in compute)
    staged = not result.one_stage_per_rank
    widest = max(len(cell_label(t.action, staged)) for t in compute)
    return max(1, math.ceil((widest + 1) / shortest))


def grid_columns(result: SimResult) -> int:
    """How many characters wide the grid of the whole timeline is (before it is wrapped): one
    row of that many per rank is drawn."""
    return round(result.makespan * _time_scale(result))


def _rank_row(result: SimResult, rank: int, scale: int, width: int) -> list[str]:
    row = [IDLE] * width
    staged = not result.one_stage_per_rank
    for t in result.timeline[rank]:
        a = t.action
        begin, end = round(t.start * scale), round(t.end * scale)
        if a.kind.is_compute:
            text = cell_label(a, staged).ljust(end - begin)
            row[begin:end] = text[: end - begin]
        elif a.kind is ActionKind.STEP and begin > 0:
            row[begin - 1] = STEP_MARK
    return row


def _ruler(result: SimResult, scale: int, width: int, tick: int) -> list[str]:
    ruler = [" "] * width
    for time in range(0, math.ceil(result.makespan) + 1, tick):
        mark = str(time)
        col = round(time * scale)
        ruler[col : col + len(mark)] = mark
    return ruler[:width]


def render_text(result: SimResult, title: str = "", width: int = 120) -> str:
    """The timeline as text, in bands of at most ``width`` characters (at least one tick)."""
    scale = _time_scale(result)
    tick = next(t for t in TICKS if t * scale >= 6)
    total = grid_columns(result)
    prefix = len(f"{result.row_label(result.ranks - 1, short=True)} ")
    band = max((width - prefix) // (tick * scale), 1) * tick * scale
    ruler = _ruler(result, scale, total, tick)
    rows = [_rank_row(result, r, scale, total) for r in range(result.ranks)]
    lines = [title] if title else []
    lines.append(
        f"F/B/I/W<microbatch>{'' if result.one_stage_per_rank else '.<stage>'}v<weight version>; "
        f"{IDLE} idle; {STEP_MARK} optimizer step; "
        f"{scale} characters per time unit"
    )
    for begin in range(0, total, band):
        lines.append("")
        lines.append((" " * prefix + "".join(ruler[begin : begin + band])).rstrip())
        for r, row in enumerate(rows):
            label = result.row_label(r, short=True)
            lines.append(label.ljust(prefix) + "".join(row[begin : begin + band]).rstrip())
    return "\n".join(lines) + "\n"
