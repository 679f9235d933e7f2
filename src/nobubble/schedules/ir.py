"""The schedule IR: per pipeline rank, an ordered list of :class:`Action`.

Conventions shared by the generators, the simulator, the renderers and the runtime:

* The model is cut into stages; each rank (a process) runs one or more of them. ``stage`` is the
  model stage an action computes for. With one stage per rank (gpipe, 1f1b, 2bw, pipedream) the
  rank is the stage; interleaved schedules put v stages on each rank. Which rank runs a stage is
  read off the lists (:func:`stage_ranks`): every action of a stage sits in one rank's list.
* A backward is either one B, or split in two (zero-bubble schedules): I computes the gradient
  of the stage's input (what the previous stage waits for) and W the gradient of its weights
  (what the STEP needs). The forward's activations are held until B or W.
* An overlapped F&B (``FB``, DualPipeV) is one action made of two halves that run as one: a
  forward of one stage and microbatch and a full backward (B) of another stage and microbatch
  on the same rank, so that one half's communication can hide behind the other's compute. The
  action's own fields are its forward half's; ``paired`` is its backward half. What an action
  computes is read through :attr:`Action.parts` (the two halves of an FB, the action itself
  otherwise); an FB receives what either half needs before it and sends what either makes after.
* ``microbatch`` is a global index over the whole run (0 .. steps*M - 1), not an index within a
  minibatch; ``step`` is the optimizer step (minibatch) the action belongs to. For gpipe, 1f1b and
  2bw ``step == microbatch // M``; for pipedream every microbatch is its own step, so
  ``step == microbatch``.
* Version v at a stage is that stage's weights after v optimizer steps; version 0 is the initial
  weights. F and B carry the version they compute with; a STEP carries the version it *produces*
  (so the STEP of step t at a sync stage has ``version == t + 1``). SEND/RECV actions carry the
  microbatch, step and version of the F or B they belong to.
* ``peer`` is the other stage of a SEND/RECV and ``None`` otherwise. Two stages on the same
  rank hand activations and gradients over in memory, with no SEND/RECV.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ScheduleError(ValueError):
    """A schedule that cannot be built or run; the message says why."""


class ActionKind(enum.StrEnum):
    F = "F"
    B = "B"  # the whole backward: input and weight gradients
    I = "I"  # noqa: E741 - the input-gradient half of a split backward
    W = "W"  # the weight-gradient half
    FB = "FB"  # an overlapped forward and backward of two stages of one rank (DualPipeV)
    STEP = "STEP"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.FB)

    @property
    def is_backward(self) -> bool:
        """B, I, W, or an FB (which holds a B)."""
        return self in (ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.FB)

    @property
    def makes_input_gradient(self) -> bool:
        """B or I: needs the next stage's gradient and produces the one the previous stage needs."""
        return self in (ActionKind.B, ActionKind.I)

    @property
    def makes_weight_gradient(self) -> bool:
        """B or W: the gradient a STEP applies; the last use of the forward's activations."""
        return self in (ActionKind.B, ActionKind.W)

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
    paired: Action | None = None  # an FB's backward half (a B); None for every other kind

    def __post_init__(self) -> None:
        if (self.kind is ActionKind.FB) != (self.paired is not None):
            raise ScheduleError(
                f"{self.kind} with paired={self.paired}: an FB, and only an FB, "
                "pairs its forward with a backward"
            )
        if self.paired is not None and self.paired.kind is not ActionKind.B:
            raise ScheduleError(f"an FB's backward half is a B, got {self.paired}")

    @property
    def parts(self) -> tuple[Action, ...]:
        """What the action computes, as F/B/I/W actions: an FB's forward and backward halves,
        the action itself otherwise."""
        if self.paired is None:
            return (self,)
        forward = Action(ActionKind.F, self.stage, self.microbatch, self.version, self.step)
        return (forward, self.paired)

    def __str__(self) -> str:
        if self.paired is not None:
            return f"{self.parts[0]}&{self.paired}"
        if self.kind is ActionKind.STEP:
            return f"STEP{self.step}->v{self.version}@s{self.stage}"
        arrow = ""
        if self.peer is not None:
            arrow = f"{'->' if self.kind.name.startswith('SEND') else '<-'}s{self.peer}"
        return f"{self.kind}{self.microbatch}v{self.version}@s{self.stage}{arrow}"


Schedule = list[list[Action]]
"""One ordered action list per rank, index = rank."""


def stage_ranks(actions: Schedule) -> dict[int, int]:
    """The rank that runs each stage, read off the lists; every stage must sit on one rank."""
    ranks: dict[int, int] = {}
    for rank, rank_actions in enumerate(actions):
        for a in (part for action in rank_actions for part in action.parts):
            if ranks.setdefault(a.stage, rank) != rank:
                raise ScheduleError(
                    f"stage {a.stage} has actions on ranks {ranks[a.stage]} and {rank}: a stage's "
                    "weights live on one rank"
                )
    return ranks


def stage_count(actions: Schedule) -> int:
    """The number of model stages (0 .. n-1 must each appear)."""
    ranks = stage_ranks(actions)
    if sorted(ranks) != list(range(len(ranks))):
        raise ScheduleError(f"the stages run are {sorted(ranks)}; expected 0..{len(ranks) - 1}")
    return len(ranks)


def version_last_uses(rank_actions: list[Action]) -> dict[tuple[int, int], int]:
    """Index of the last action of one rank's list that needs each (stage, weight version).

    A version is needed by every F/B/I/W computing with it and by the STEP that updates it. A
    runtime may free a stage's version v once ``rank_actions[last]`` has run, unless v is still
    the stage's newest; the simulator counts weight versions held under exactly this rule.
    """
    last: dict[tuple[int, int], int] = {}
    for i, action in enumerate(rank_actions):
        if action.kind is ActionKind.STEP:
            last[action.stage, action.version - 1] = i
        elif action.kind.is_compute:
            for a in action.parts:
                last[a.stage, a.version] = i
    return last
