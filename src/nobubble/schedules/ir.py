"""The schedule IR: per pipeline stage, an ordered list of :class:`Action`.

Conventions shared by the generators, the simulator, the renderers and the runtime:

* ``microbatch`` is a global index over the whole run (0 .. steps*M - 1), not an index within a
  minibatch; ``step`` is the optimizer step (minibatch) the action belongs to. For gpipe, 1f1b and
  2bw ``step == microbatch // M``; for pipedream every microbatch is its own step, so
  ``step == microbatch``.
* Version v at a stage is that stage's weights after v optimizer steps; version 0 is the initial
  weights. F and B carry the version they compute with; a STEP carries the version it *produces*
  (so the STEP of step t at a sync stage has ``version == t + 1``). SEND/RECV actions carry the
  microbatch, step and version of the F or B they belong to.
* ``peer`` is the other stage of a SEND/RECV and ``None`` otherwise.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ScheduleError(ValueError):
    """A schedule that cannot be built or run; the message says why."""


class ActionKind(enum.StrEnum):
    F = "F"
    B = "B"
    STEP = "STEP"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.F, ActionKind.B)

    @property
    def is_comm(self) -> bool:
        return self in COMM_KINDS


COMM_KINDS = frozenset(
    {ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD}
)


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    stage: int
    microbatch: int | None  # None for STEP
    version: int
    step: int
    peer: int | None = None

    def __str__(self) -> str:
        if self.kind is ActionKind.STEP:
            return f"STEP{self.step}->v{self.version}@s{self.stage}"
        arrow = ""
        if self.peer is not None:
            arrow = f"{'->' if self.kind.name.startswith('SEND') else '<-'}s{self.peer}"
        return f"{self.kind}{self.microbatch}v{self.version}@s{self.stage}{arrow}"


Schedule = list[list[Action]]
"""One ordered action list per stage, index = stage."""


def version_last_uses(stage_actions: list[Action]) -> dict[int, int]:
    """Index of the last action of one stage's list that needs each weight version.

    A version is needed by every F/B computing with it and by the STEP that updates it. A
    runtime may free version v once ``stage_actions[last][...]`` has run, unless v is still the
    newest; the simulator counts weight versions held under exactly this rule.
    """
    last: dict[int, int] = {}
    for i, a in enumerate(stage_actions):
        if a.kind.is_compute:
            last[a.version] = i
        elif a.kind is ActionKind.STEP:
            last[a.version - 1] = i
    return last
