"""The one writer of a Markdown table, for every command that prints or writes one.

It imports nothing of nobubble, so a command at any layer (the report, the bench, the planner,
the schedule tool, the fault campaign, the downstream scores) can use it.
"""

from __future__ import annotations

from collections.abc import Sequence

LEFT, RIGHT = "l", "r"


def markdown_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None
) -> str:
    """``header`` and ``rows`` as a Markdown table; ``align``: one letter per column, ``l``
    (left, the default for every column) or ``r`` (right: numbers)."""
    align = align or LEFT * len(header)
    if len(align) != len(header) or set(align) - {LEFT, RIGHT}:
        raise ValueError(f"align {align!r}: give one of l or r for each of {len(header)} columns")
    rule = "|".join("---:" if side == RIGHT else "---" for side in align)
    lines = ["| " + " | ".join(header) + " |", f"|{rule}|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
