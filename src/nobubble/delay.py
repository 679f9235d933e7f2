"""Gradient-delay profiles: which weight version each stage's gradient is computed at.

Version v of a stage is its weights after v optimizer steps (version 0: the initial weights).
With delay d, the gradient of step t is computed at version max(t - d, 0) and applied to version t:

    sync, gpipe, 1f1b:  d = 0 for every stage
    2bw:                d = 1 for every stage (whatever the number of stages)
    pipedream:          d = P-1-s for stage s of P (every microbatch is its own step)

Both backends read these numbers: the simulator keeps that many old versions per stage, the
pipeline runtime's schedule produces exactly these versions (its invariants are checked).
"""

from __future__ import annotations

from nobubble.config import SYNC
from nobubble.schedules.registry import schedule_spec


def stage_delays(schedule: str, stages: int) -> list[int]:
    """The gradient delay, in optimizer steps, of every stage (``sync``: none)."""
    if schedule == SYNC:
        return [0] * stages
    return schedule_spec(schedule).delays(stages)


def gradient_version(step: int, delay: int) -> int:
    """The weight version at which the gradient applied at ``step`` was computed."""
    return max(step - delay, 0)
