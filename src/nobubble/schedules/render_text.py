"""Text grid: one row per stage, time running left to right, wrapped to a terminal width.

Each F/B is drawn as its label (``F5v1``: forward of microbatch 5 with weight version 1) padded
to its duration; ``.`` is idle time and ``|`` marks a STEP (the end of the cell before it).
"""

from __future__ import annotations

import math

from nobubble.schedules.ir import ActionKind
from nobubble.schedules.simulator import SimResult

IDLE = "."
STEP_MARK = "|"
TICKS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 100_000, 1_000_000)


def cell_label(kind: ActionKind, microbatch: int | None, version: int) -> str:
    return f"{kind}{microbatch}v{version}"


def _time_scale(result: SimResult) -> int:
    """Characters per time unit: enough for the shortest F/B to show its label and a space."""
    compute = [t for stage in result.timeline for t in stage if t.action.kind.is_compute]
    shortest = min(t.end - t.start for t in compute)
    widest = max(
        len(cell_label(t.action.kind, t.action.microbatch, t.action.version)) for t in compute
    )
    return max(1, math.ceil((widest + 1) / shortest))


def _stage_row(result: SimResult, stage: int, scale: int, width: int) -> list[str]:
    row = [IDLE] * width
    for t in result.timeline[stage]:
        a = t.action
        begin, end = round(t.start * scale), round(t.end * scale)
        if a.kind.is_compute:
            text = cell_label(a.kind, a.microbatch, a.version).ljust(end - begin)
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
    total = round(result.makespan * scale)
    prefix = len(f"s{result.stages - 1} ")
    band = max((width - prefix) // (tick * scale), 1) * tick * scale
    ruler = _ruler(result, scale, total, tick)
    rows = [_stage_row(result, s, scale, total) for s in range(result.stages)]
    lines = [title] if title else []
    lines.append(
        f"F/B<microbatch>v<weight version>; {IDLE} idle; {STEP_MARK} optimizer step; "
        f"{scale} characters per time unit"
    )
    for begin in range(0, total, band):
        lines.append("")
        lines.append((" " * prefix + "".join(ruler[begin : begin + band])).rstrip())
        for s, row in enumerate(rows):
            lines.append(f"s{s}".ljust(prefix) + "".join(row[begin : begin + band]).rstrip())
    return "\n".join(lines) + "\n"
