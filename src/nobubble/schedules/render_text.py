"""Text grid: one row per rank, time running left to right, wrapped to a terminal width.

Each F/B/I/W is drawn as its label (``F5v1``: forward of microbatch 5 with weight version 1;
``F5.6v1`` when ranks run several stages: the same at stage 6; ``F5.0v0&B2.3v0`` an overlapped
forward and backward, DualPipeV's F&B) padded to its duration; ``.`` is
idle time and ``|`` marks a STEP (the end of the cell before it). :func:`render_excerpt` draws a
few columns of the same grid around one action, marked (the pipeline's failures show it).
"""

from __future__ import annotations

import math

from nobubble.schedules.ir import Action, ActionKind
from nobubble.schedules.timing import SimResult, TimedAction

IDLE = "."
STEP_MARK = "|"
MARK = "^"
TICKS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 100_000, 1_000_000)


def cell_label(a: Action, with_stage: bool = False) -> str:
    """``F5v1``, ``F5.6v1`` with the stage; an overlapped F&B as its halves: ``F5.0v0&B2.3v0``."""
    if a.paired is not None:
        return "&".join(cell_label(part, with_stage) for part in a.parts)
    stage = f".{a.stage}" if with_stage else ""
    return f"{a.kind}{a.microbatch}{stage}v{a.version}"


def _overlaps(result: SimResult) -> bool:
    return any(t.action.kind is ActionKind.FB for rank in result.timeline for t in rank)


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


def _legend(result: SimResult, scale: int) -> str:
    return (
        f"F/B/I/W<microbatch>{'' if result.one_stage_per_rank else '.<stage>'}v<weight version>"
        f"{' (F..&B..: overlapped F&B)' if _overlaps(result) else ''}; "
        f"{IDLE} idle; {STEP_MARK} optimizer step; "
        f"{scale} characters per time unit"
    )


def _cell(timed: TimedAction, scale: int) -> tuple[int, int]:
    """The columns [begin, end) where the grid draws ``timed``; an action that takes no time
    gets the one column beside it: a STEP's mark, a RECV the first of the compute it feeds, a
    SEND the last of the compute it follows."""
    begin, end = round(timed.start * scale), round(timed.end * scale)
    if end > begin:
        return begin, end
    if timed.action.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
        return begin, begin + 1
    return max(begin - 1, 0), max(begin, 1)


def _excerpt_row(result: SimResult, rank: int, scale: int, left: int, right: int) -> str:
    """Columns [left, right) of ``rank``'s row; a cell whose label either edge would cut is
    drawn blank (a cell's padding), not with part of its label."""
    row = [IDLE] * (right - left)
    staged = not result.one_stage_per_rank
    for t in result.timeline[rank]:
        a = t.action
        begin, end = round(t.start * scale), round(t.end * scale)
        if a.kind.is_compute and begin < right and end > left:
            text = cell_label(a, staged)
            text = ("" if begin < left or begin + len(text) > right else text).ljust(end - begin)
            shown = range(max(begin, left), min(end, right))
            row[shown.start - left : shown.stop - left] = text[
                shown.start - begin : shown.stop - begin
            ]
        elif a.kind is ActionKind.STEP and left < begin <= right:
            row[begin - 1 - left] = STEP_MARK
    return "".join(row)


def render_excerpt(
    result: SimResult, rank: int, position: int, columns: int = 72, ranks: int = 8
) -> str:
    """About ``columns`` columns of the grid around action ``position`` of ``rank``'s
    timeline, for the (at most ``ranks``) ranks nearest it, the action's cell underlined with
    ``^`` below its rank's row. Its cost is that of the timeline's rows it shows."""
    scale = _time_scale(result)
    total = grid_columns(result)
    begin, end = _cell(result.timeline[rank][position], scale)
    left = max(0, min((begin + end - columns) // 2, total - columns))
    right = min(total, left + columns)
    first = max(0, min(rank - ranks // 2, result.ranks - ranks))
    shown = range(first, min(result.ranks, first + ranks))
    prefix = len(f"{result.row_label(shown[-1], short=True)} ")
    lines = [_legend(result, scale)]
    for r in shown:
        row = _excerpt_row(result, r, scale, left, right)
        lines.append((result.row_label(r, short=True).ljust(prefix) + row).rstrip())
        if r == rank:
            marked = max(begin, left)
            lines.append(" " * (prefix + marked - left) + MARK * (min(end, right) - marked))
    return "\n".join(lines) + "\n"


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
    lines.append(_legend(result, scale))
    for begin in range(0, total, band):
        lines.append("")
        lines.append((" " * prefix + "".join(ruler[begin : begin + band])).rstrip())
        for r, row in enumerate(rows):
            label = result.row_label(r, short=True)
            lines.append(label.ljust(prefix) + "".join(row[begin : begin + band]).rstrip())
    return "\n".join(lines) + "\n"
