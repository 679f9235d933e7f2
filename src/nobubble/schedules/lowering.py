"""Lowering: add the point-to-point communication that F and B imply.

Assumed p2p semantics (what the simulator models and what the runtime must provide):

* SEND does not wait for the receiver: it is non-blocking or buffered (``isend``; the runtime
  keeps the handle and waits on it before the buffer is reused). A blocking rendezvous send
  would deadlock 1F1B: stage s sends an activation while stage s+1 sends it a gradient.
* RECV blocks until the matching SEND has completed and the communication latency has passed.

Placement: a RECV sits immediately before the F or B that consumes it, so a process never
blocks on data it does not need yet; a SEND sits immediately after the F or B that produced it,
so the peer gets it as early as possible. The stage sends activations to s+1 after F (except the
last stage, which computes the loss) and gradients to s-1 after B (except stage 0).
"""

from __future__ import annotations

import dataclasses

from nobubble.schedules.ir import Action, ActionKind, Schedule, ScheduleError


def _comm(action: Action, kind: ActionKind, peer: int) -> Action:
    return dataclasses.replace(action, kind=kind, peer=peer)


def lower(actions: Schedule) -> Schedule:
    """Return a new schedule with SEND_*/RECV_* actions around every F and B."""
    last = len(actions) - 1
    lowered: Schedule = []
    for stage, stage_actions in enumerate(actions):
        out: list[Action] = []
        for a in stage_actions:
            if a.kind.is_comm:
                raise ScheduleError(
                    f"{a} is a communication action: the schedule is already lowered"
                )
            if a.kind is ActionKind.F and stage > 0:
                out.append(_comm(a, ActionKind.RECV_ACT, stage - 1))
            if a.kind is ActionKind.B and stage < last:
                out.append(_comm(a, ActionKind.RECV_GRAD, stage + 1))
            out.append(a)
            if a.kind is ActionKind.F and stage < last:
                out.append(_comm(a, ActionKind.SEND_ACT, stage + 1))
            if a.kind is ActionKind.B and stage > 0:
                out.append(_comm(a, ActionKind.SEND_GRAD, stage - 1))
        lowered.append(out)
    return lowered


def is_lowered(actions: Schedule) -> bool:
    """Whether the schedule carries its communication (a one-stage schedule needs none)."""
    return len(actions) == 1 or any(a.kind.is_comm for stage in actions for a in stage)
