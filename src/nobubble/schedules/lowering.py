"""Lowering: add the point-to-point communication that F and B imply.

Assumed p2p semantics (what the simulator models and what the runtime must provide):

* SEND does not wait for the receiver: it is non-blocking or buffered (``isend``; the runtime
  keeps the handle and waits on it before the buffer is reused). A blocking rendezvous send
  would deadlock 1F1B: stage s sends an activation while stage s+1 sends it a gradient.
* RECV blocks until the matching SEND has completed and the communication latency has passed.

Placement: a RECV sits immediately before the F or B/I that consumes it, so a process never
blocks on data it does not need yet; a SEND sits immediately after the F or B/I that produced it,
so the peer gets it as early as possible. A stage sends activations to the next stage after F
(except the last stage, which computes the loss) and gradients to the previous one after B or I
(except stage 0); W sends nothing; an overlapped F&B (FB) receives for both halves before it and
sends for both after it. Stages on the same rank hand over in memory: no SEND/RECV (the bottom of
the V placement, stage P-1 to P on rank P-1, is such a hand-off).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from nobubble.schedules.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    stage_count,
    stage_ranks,
)


def _comm(action: Action, kind: ActionKind, peer: int) -> Action:
    return Action(kind, action.stage, action.microbatch, action.version, action.step, peer)


def lower_rank(
    rank_actions: Iterable[Action], rank_of: Mapping[int, int], last: int
) -> Iterator[Action]:
    """One rank's actions with their SEND_*/RECV_*, as lazily as they come; ``rank_of`` places
    every stage 0..``last`` on its rank."""

    def remote(stage: int, other: int) -> bool:
        return 0 <= other <= last and rank_of[other] != rank_of[stage]

    for action in rank_actions:
        if action.kind.is_comm:
            raise ScheduleError(
                f"{action} is a communication action: the schedule is already lowered"
            )
        for a in action.parts:  # an FB receives what either half needs before it runs
            s = a.stage
            if a.kind is ActionKind.F and remote(s, s - 1):
                yield _comm(a, ActionKind.RECV_ACT, s - 1)
            if a.kind.makes_input_gradient and remote(s, s + 1):
                yield _comm(a, ActionKind.RECV_GRAD, s + 1)
        yield action
        for a in action.parts:  # and sends what either half made after it
            s = a.stage
            if a.kind is ActionKind.F and remote(s, s + 1):
                yield _comm(a, ActionKind.SEND_ACT, s + 1)
            if a.kind.makes_input_gradient and remote(s, s - 1):
                yield _comm(a, ActionKind.SEND_GRAD, s - 1)


def lower(actions: Schedule) -> Schedule:
    """Return a new schedule with SEND_*/RECV_* actions around every F and B (or I)."""
    last = stage_count(actions) - 1
    rank_of = stage_ranks(actions)
    return [list(lower_rank(rank_actions, rank_of, last)) for rank_actions in actions]


def is_lowered(actions: Schedule) -> bool:
    """Whether the schedule carries its communication (a one-rank schedule needs none)."""
    return len(actions) == 1 or any(a.kind.is_comm for rank in actions for a in rank)
