"""Discrete-event simulator of a lowered schedule.

Every stage executes its list in order. F takes ``fwd[s]``, B takes ``bwd[s]``; STEP, SEND and
RECV take no time of their own. A SEND is buffered (never waits); a RECV waits until its SEND has
finished plus the communication latency. An action starts when its predecessor on the stage has
finished and, for a RECV, when its message has arrived; the times are therefore independent of
the order in which stages are advanced. When no stage can advance before all are done, the
schedule is deadlocked and :class:`DeadlockError` names the stuck actions.

While executing, each stage also tracks what a real process would hold and reports (rather than
raises) what a real process could not do: a forward or backward using a weight version the
stage has not produced by then, a backward whose forward did not run or used another version,
compute whose input was never received, a send before the compute it sends, duplicate work, and
messages nobody receives. A stage releases a weight version after the last action in its list
that needs it (:func:`~nobubble.schedules.ir.version_last_uses`), never the newest one: the
least any runtime executing the list must keep, and what ``weight_versions`` counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from nobubble.schedules.ir import Action, ActionKind, Schedule, ScheduleError, version_last_uses

_MESSAGE_OF = {
    ActionKind.SEND_ACT: "activation",
    ActionKind.RECV_ACT: "activation",
    ActionKind.SEND_GRAD: "gradient",
    ActionKind.RECV_GRAD: "gradient",
}


class DeadlockError(ScheduleError):
    """No stage can make progress; ``stuck`` holds the action each unfinished stage waits on."""

    def __init__(self, stuck: list[Action]) -> None:
        self.stuck = stuck
        waits = "; ".join(f"stage {a.stage} waits at {a}" for a in stuck)
        super().__init__(f"deadlock: {waits}")


@dataclass(frozen=True)
class TimedAction:
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    timeline: list[list[TimedAction]]  # per stage, in execution order, every action
    peak_activations: list[int]  # per stage: most forwards whose backward has not yet run
    weight_versions: list[int]  # per stage: most weight versions held at once
    violations: list[str] = field(default_factory=list)

    @property
    def stages(self) -> int:
        return len(self.timeline)

    @property
    def microbatches(self) -> int:
        """Microbatches that went through the pipeline (forwards run at stage 0)."""
        return sum(t.action.kind is ActionKind.F for t in self.timeline[0])

    @cached_property
    def makespan(self) -> float:
        return max((t.end for stage in self.timeline for t in stage), default=0.0)

    @cached_property
    def busy(self) -> list[float]:
        return [sum(t.end - t.start for t in stage) for stage in self.timeline]

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_fraction(self) -> list[float]:
        """Per stage: the share of the makespan the stage spends idle."""
        return [i / self.makespan if self.makespan else 0.0 for i in self.idle]

    @property
    def bubble_fraction_overall(self) -> float:
        return sum(self.bubble_fraction) / self.stages

    @property
    def throughput(self) -> float:
        """Microbatches per time unit."""
        return self.microbatches / self.makespan if self.makespan else 0.0

    def summary(self) -> dict[str, object]:
        """The JSON-ready figures of ``nobubble schedule --json``."""
        return {
            "makespan": self.makespan,
            "microbatches_total": self.microbatches,
            "throughput": self.throughput,
            "bubble_fraction": {
                "overall": self.bubble_fraction_overall,
                "per_stage": self.bubble_fraction,
            },
            "busy": self.busy,
            "idle": self.idle,
            "peak_activations": self.peak_activations,
            "weight_versions": self.weight_versions,
        }


def _per_stage(value: float | Sequence[float], stages: int, name: str) -> list[float]:
    values = [float(value)] * stages if isinstance(value, int | float) else list(map(float, value))
    if len(values) != stages:
        raise ScheduleError(
            f"{name} lists {len(values)} times but the schedule has {stages} stages"
        )
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise ScheduleError(f"{name} times must be positive and finite, got {values}")
    return values


def _message(action: Action) -> tuple[str, int, int, int | None]:
    """(what, from stage, to stage, microbatch): equal for a SEND and its RECV."""
    assert action.peer is not None
    if action.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
        return (_MESSAGE_OF[action.kind], action.stage, action.peer, action.microbatch)
    return (_MESSAGE_OF[action.kind], action.peer, action.stage, action.microbatch)


class _StageState:
    """What one stage holds while it executes its list; records what it could not do."""

    def __init__(self, actions: list[Action], last_stage: int, violations: list[str]) -> None:
        self.last_stage = last_stage
        self.violations = violations
        self.last_use = version_last_uses(actions)
        self.newest = 0
        self.held = {0}
        self.peak_versions = 1
        self.in_flight: dict[int | None, int] = {}  # microbatch -> version of its forward
        self.peak_activations = 0
        self.received: set[tuple[str, int | None]] = set()
        self.done: set[tuple[ActionKind, int | None]] = set()

    def execute(self, index: int, a: Action) -> None:
        if a.kind.is_compute:
            self._compute(a)
        elif a.kind is ActionKind.STEP:
            if a.version != self.newest + 1:
                self.violations.append(
                    f"{a} produces v{a.version} but the stage holds v{self.newest}"
                )
            self.newest = a.version
            self.held.add(a.version)
        elif a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
            self.received.add((_MESSAGE_OF[a.kind], a.microbatch))
        else:
            source = ActionKind.F if a.kind is ActionKind.SEND_ACT else ActionKind.B
            if (source, a.microbatch) not in self.done:
                self.violations.append(f"{a} sends before {source}{a.microbatch} ran")
        self.held = {v for v in self.held if v == self.newest or self.last_use.get(v, -1) > index}
        self.peak_versions = max(self.peak_versions, len(self.held))

    def _compute(self, a: Action) -> None:
        if (a.kind, a.microbatch) in self.done:
            self.violations.append(f"{a} runs a second time")
        self.done.add((a.kind, a.microbatch))
        if a.version not in self.held:
            state = "not produced yet" if a.version > self.newest else "skipped by the STEPs"
            self.violations.append(f"{a} needs weight version {a.version}, {state} at this stage")
        needs = "activation" if a.kind is ActionKind.F else "gradient"
        has_peer = a.stage > 0 if a.kind is ActionKind.F else a.stage < self.last_stage
        if has_peer and (needs, a.microbatch) not in self.received:
            self.violations.append(f"{a} runs before its {needs} was received")
        if a.kind is ActionKind.F:
            self.in_flight[a.microbatch] = a.version
            self.peak_activations = max(self.peak_activations, len(self.in_flight))
        elif a.microbatch not in self.in_flight:
            self.violations.append(f"{a} runs without its forward")
        elif (forward_version := self.in_flight.pop(a.microbatch)) != a.version:
            self.violations.append(f"{a} uses v{a.version} but its forward used v{forward_version}")


def simulate(
    lowered: Schedule,
    fwd: float | Sequence[float] = 1.0,
    bwd: float | Sequence[float] = 2.0,
    comm: float = 0.0,
    on_progress: Callable[[float], object] | None = None,
) -> SimResult:
    """Run a lowered schedule; ``fwd``/``bwd`` are one time for all stages or one per stage.

    ``on_progress`` is called with the share of all actions executed since its last call.
    """
    stages = len(lowered)
    if stages == 0:
        raise ScheduleError("the schedule has no stages")
    durations = {
        ActionKind.F: _per_stage(fwd, stages, "fwd"),
        ActionKind.B: _per_stage(bwd, stages, "bwd"),
    }
    if not (math.isfinite(comm) and comm >= 0):
        raise ScheduleError(f"comm latency must be >= 0 and finite, got {comm}")
    for s, stage_actions in enumerate(lowered):
        for a in stage_actions:
            if a.stage != s:
                raise ScheduleError(f"{a} is listed under stage {s}")
            if a.kind.is_comm and (a.peer is None or not 0 <= a.peer < stages or a.peer == s):
                raise ScheduleError(f"{a} needs a peer stage other than {s} in 0..{stages - 1}")

    violations: list[str] = []
    states = [_StageState(stage_actions, stages - 1, violations) for stage_actions in lowered]
    arrivals: dict[tuple[str, int, int, int | None], float] = {}
    position = [0] * stages
    clock = [0.0] * stages
    timeline: list[list[TimedAction]] = [[] for _ in range(stages)]
    total, reported = max(sum(map(len, lowered)), 1), 0.0
    progress = True
    while progress:
        progress = False
        for s in range(stages):
            while position[s] < len(lowered[s]):
                a = lowered[s][position[s]]
                start = clock[s]
                if a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
                    if _message(a) not in arrivals:
                        break
                    start = max(start, arrivals.pop(_message(a)))
                end = start + durations[a.kind][s] if a.kind.is_compute else start
                if a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
                    if _message(a) in arrivals:
                        violations.append(f"{a} sends a message that is already pending")
                    arrivals[_message(a)] = end + comm
                states[s].execute(position[s], a)
                timeline[s].append(TimedAction(a, start, end))
                clock[s] = end
                position[s] += 1
                progress = True
        if on_progress is not None:
            done = sum(position) / total
            on_progress(done - reported)
            reported = done
    stuck = [lowered[s][position[s]] for s in range(stages) if position[s] < len(lowered[s])]
    if stuck:
        raise DeadlockError(stuck)
    violations += [
        f"{what} {mb} from stage {a} to {b} is never received" for what, a, b, mb in arrivals
    ]
    return SimResult(
        timeline=timeline,
        peak_activations=[st.peak_activations for st in states],
        weight_versions=[st.peak_versions for st in states],
        violations=violations,
    )
