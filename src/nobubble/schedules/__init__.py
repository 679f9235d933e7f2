"""Pipeline schedules as data: one IR that the simulator, the renderers and the runtime read.

    actions = generate("2bw", stages=4, microbatches=8, steps=3)   # per stage: F, B, STEP
    lowered = lower(actions)                                        # + SEND/RECV
    result = simulate(lowered, fwd=1.0, bwd=2.0, comm=0.0)
    assert check_invariants(actions, "2bw") == []
    print(render_text(result))

See docs/schedules.md.
"""

from nobubble.schedules.generators import generate, rank_actions, until_step
from nobubble.schedules.invariants import check_invariants
from nobubble.schedules.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    version_last_uses,
)
from nobubble.schedules.lowering import is_lowered, lower, lower_rank
from nobubble.schedules.registry import SCHEDULE_NAMES, SCHEDULES, ScheduleSpec, schedule_spec
from nobubble.schedules.render_png import render_png
from nobubble.schedules.render_text import render_text
from nobubble.schedules.timing import DeadlockError, SimResult, TimedAction, simulate
from nobubble.schedules.trace import chrome_trace, write_trace

__all__ = [
    "SCHEDULES",
    "SCHEDULE_NAMES",
    "Action",
    "ActionKind",
    "DeadlockError",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "SimResult",
    "TimedAction",
    "check_invariants",
    "chrome_trace",
    "generate",
    "is_lowered",
    "lower",
    "lower_rank",
    "rank_actions",
    "render_png",
    "render_text",
    "schedule_spec",
    "simulate",
    "until_step",
    "version_last_uses",
    "write_trace",
]
