"""Discrete-event simulator of a lowered schedule.

Every rank executes its list in order. F takes ``fwd[s]`` for stage s, B takes ``bwd[s]``; a
split backward's I takes ``bwd[s] - wgrad[s]`` and its W ``wgrad[s]``; an overlapped F&B (FB) the
sum of its halves (their compute does not overlap; what DualPipe overlaps is one half's
communication with the other's compute); STEP, SEND and RECV take no time of their own. A SEND
is buffered (never waits); a RECV waits until its SEND has finished plus the communication
latency. An action starts when its predecessor on the rank has finished and, for a RECV, when its
message has arrived; the times are therefore independent of the order in which ranks are
advanced. When no rank can advance before all are done, the schedule is
deadlocked and :class:`DeadlockError` names the stuck actions.

While executing, each rank also tracks what a real process would hold and reports (rather than
raises) what a real process could not do: a forward or backward using a weight version the
stage has not produced by then, a backward whose forward did not run or used another version, a
W before its I, compute whose input was never received (from another rank, or handed over by a
stage on the same rank), a send before the compute it sends, duplicate work, and messages nobody
receives. A stage releases a weight version after the last action in its rank's list that needs
it (:func:`~nobubble.schedules.ir.version_last_uses`), never the newest one: the least any
runtime executing the list must keep, and what ``weight_versions`` counts. A forward's
activations are held until its B or W.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from nobubble.schedules.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    stage_count,
    stage_ranks,
    version_last_uses,
)

# the most forwards (model stages x microbatches x steps) a command asks one simulation for:
# generating, simulating and drawing them takes about half a minute (`nobubble schedule`, and
# `nobubble bench`, which simulates every run's steps for its bubble)
MAX_SIMULATED_FORWARDS = 200_000

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
        waits = "; ".join(f"stage {a.stage} waits at {a}" for a in stuck)  # one per stuck rank
        super().__init__(f"deadlock: {waits}")


@dataclass(frozen=True)
class TimedAction:
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    timeline: list[list[TimedAction]]  # per rank, in execution order, every action
    # per rank: most forwards whose B (or W) has not yet run, counted per stage (under
    # interleaving a stage holds 1/v of the rank's layers, so its activations are that smaller)
    peak_activations: list[int]
    # per rank: the most activation size held at once, each stage's forwards weighted by its
    # ``activation_sizes`` (all 1: the most forwards held, whichever stages they belong to)
    peak_activation_size: list[float]
    weight_versions: list[int]  # per rank: most versions any of its stages holds at once
    stage_weight_versions: list[int]  # per stage: most weight versions held at once
    violations: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> int:
        return len(self.timeline)

    @property
    def stages(self) -> int:
        return len(self.stage_weight_versions)

    @cached_property
    def rank_stages(self) -> list[list[int]]:
        """The stages each rank runs, in order."""
        return [sorted({t.action.stage for t in rank}) for rank in self.timeline]

    @property
    def one_stage_per_rank(self) -> bool:
        return all(stages == [r] for r, stages in enumerate(self.rank_stages))

    def row_label(self, rank: int, short: bool = False) -> str:
        """ "s2"/"stage 2" when every rank runs one stage, else "r2"/"rank 2 (stages 2, 6)"."""
        if self.one_stage_per_rank:
            return f"s{rank}" if short else f"stage {rank}"
        stages = ", ".join(map(str, self.rank_stages[rank]))
        return f"r{rank}" if short else f"rank {rank} (stages {stages})"

    @property
    def microbatches(self) -> int:
        """Microbatches that went through the pipeline (forwards run at stage 0, alone or as an
        F&B's forward half)."""
        return sum(
            a.kind is ActionKind.F and a.stage == 0
            for rank in self.timeline
            for t in rank
            for a in t.action.parts
        )

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
        """Per rank: the share of the makespan the rank spends idle."""
        return [i / self.makespan if self.makespan else 0.0 for i in self.idle]

    @property
    def bubble_fraction_overall(self) -> float:
        return sum(self.bubble_fraction) / self.ranks

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


def split_rank_times(
    times: float | Sequence[float], actions: Schedule, name: str = "times"
) -> list[float]:
    """Per-stage times from one time per rank (or one for all): a rank's time is its share of
    the model, which its stages split equally (interleaving v stages per rank: each 1/v)."""
    ranks = len(actions)
    per_rank = _per_stage(times, ranks, name) if not isinstance(times, int | float) else None
    rank_of = stage_ranks(actions)
    on_rank = [sum(1 for r in rank_of.values() if r == rank) for rank in range(ranks)]
    return [
        (float(times) if per_rank is None else per_rank[rank_of[s]]) / on_rank[rank_of[s]]
        for s in range(len(rank_of))
    ]


def _message(action: Action) -> tuple[str, int, int, int | None]:
    """(what, from stage, to stage, microbatch): equal for a SEND and its RECV."""
    assert action.peer is not None
    if action.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
        return (_MESSAGE_OF[action.kind], action.stage, action.peer, action.microbatch)
    return (_MESSAGE_OF[action.kind], action.peer, action.stage, action.microbatch)


class _RankState:
    """What one rank holds for its stages while it executes its list; records what it could
    not do."""

    def __init__(
        self,
        actions: list[Action],
        rank_of: dict[int, int],
        last_stage: int,
        violations: list[str],
        activation_sizes: list[float],
    ) -> None:
        self.rank_of = rank_of
        self.last_stage = last_stage
        self.violations = violations
        self.last_use = version_last_uses(actions)
        stages = sorted({a.stage for a in actions})
        self.newest = dict.fromkeys(stages, 0)
        self.held = {s: {0} for s in stages}
        self.stage_peak_versions = dict.fromkeys(stages, 1)
        self.in_flight: dict[tuple[int, int | None], int] = {}  # (stage, mb) -> forward's version
        self.input_done: set[tuple[int, int | None]] = set()  # I ran, W still to run
        self.peak_activations = 0
        self.activation_sizes = activation_sizes
        self.held_per_stage = dict.fromkeys(stages, 0)  # forwards whose B or W has not run
        self.peak_activation_size = 0.0
        self.received: set[tuple[str, int, int | None]] = set()  # (what, stage, microbatch)
        self.done: set[tuple[ActionKind, int, int | None]] = set()

    def execute(self, index: int, a: Action) -> None:
        if a.kind.is_compute:
            for part in a.parts:  # an FB's forward half, then its backward half
                self._compute(part)
        elif a.kind is ActionKind.STEP:
            if a.version != self.newest[a.stage] + 1:
                self.violations.append(
                    f"{a} produces v{a.version} but the stage holds v{self.newest[a.stage]}"
                )
            self.newest[a.stage] = a.version
            self.held[a.stage].add(a.version)
        elif a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
            self.received.add((_MESSAGE_OF[a.kind], a.stage, a.microbatch))
        else:
            source = "F" if a.kind is ActionKind.SEND_ACT else "B or I"
            kinds = (
                (ActionKind.F,) if a.kind is ActionKind.SEND_ACT else (ActionKind.B, ActionKind.I)
            )
            if not any((k, a.stage, a.microbatch) in self.done for k in kinds):
                self.violations.append(f"{a} sends before {source}{a.microbatch} ran")
        for stage, held in self.held.items():
            newest = self.newest[stage]
            self.held[stage] = {
                v for v in held if v == newest or self.last_use.get((stage, v), -1) > index
            }
            self.stage_peak_versions[stage] = max(
                self.stage_peak_versions[stage], len(self.held[stage])
            )

    def _compute(self, a: Action) -> None:
        key = (a.stage, a.microbatch)
        repeated = (a.kind, *key) in self.done or (
            a.kind.makes_input_gradient
            and any((k, *key) in self.done for k in (ActionKind.B, ActionKind.I))
        )
        if repeated:
            self.violations.append(f"{a} runs a second time")
        self.done.add((a.kind, *key))
        if a.version not in self.held[a.stage]:
            newest = self.newest[a.stage]
            state = "not produced yet" if a.version > newest else "skipped by the STEPs"
            self.violations.append(f"{a} needs weight version {a.version}, {state} at this stage")
        if a.kind is ActionKind.F or a.kind.makes_input_gradient:
            needs = "activation" if a.kind is ActionKind.F else "gradient"
            has_peer = a.stage > 0 if a.kind is ActionKind.F else a.stage < self.last_stage
            if has_peer and (needs, *key) not in self.received:
                self.violations.append(f"{a} runs before its {needs} was received")
        if a.kind is ActionKind.F:
            self.in_flight[key] = a.version
            self.peak_activations = max(self.peak_activations, len(self.in_flight))
            self.held_per_stage[a.stage] += 1
            held = sum(n * self.activation_sizes[s] for s, n in self.held_per_stage.items())
            self.peak_activation_size = max(self.peak_activation_size, held)
            self._pass_locally("activation", a.stage + 1, a.microbatch, a.stage)
            return
        if key not in self.in_flight:
            self.violations.append(f"{a} runs without its forward")
            return
        if self.in_flight[key] != a.version:
            self.violations.append(
                f"{a} uses v{a.version} but its forward used v{self.in_flight[key]}"
            )
        if a.kind is ActionKind.I:
            self.input_done.add(key)
        if a.kind is ActionKind.W and key not in self.input_done:
            self.violations.append(f"{a} runs before its I")
        if a.kind.makes_input_gradient:
            self._pass_locally("gradient", a.stage - 1, a.microbatch, a.stage)
        if a.kind.makes_weight_gradient:
            del self.in_flight[key]
            self.held_per_stage[a.stage] -= 1
            self.input_done.discard(key)

    def _pass_locally(self, what: str, to: int, microbatch: int | None, frm: int) -> None:
        """Hand ``what`` to stage ``to`` if it runs on this rank (no message needed)."""
        if 0 <= to <= self.last_stage and self.rank_of[to] == self.rank_of[frm]:
            self.received.add((what, to, microbatch))


def _check_placement(lowered: Schedule) -> tuple[dict[int, int], int]:
    """Each stage's rank and the number of stages; a malformed schedule raises."""
    rank_of = stage_ranks(lowered)
    stages = stage_count(lowered)
    for rank_actions in lowered:
        for a in rank_actions:
            if a.kind.is_comm and (
                a.peer is None or not 0 <= a.peer < stages or rank_of[a.peer] == rank_of[a.stage]
            ):
                raise ScheduleError(f"{a} needs a peer stage on another rank, in 0..{stages - 1}")
    return rank_of, stages


def simulate(
    lowered: Schedule,
    fwd: float | Sequence[float] = 1.0,
    bwd: float | Sequence[float] = 2.0,
    comm: float = 0.0,
    on_progress: Callable[[float], object] | None = None,
    wgrad: float | Sequence[float] | None = None,
    activation_sizes: Sequence[float] | None = None,
) -> SimResult:
    """Run a lowered schedule; ``fwd``/``bwd``/``wgrad`` are one time for all stages or one per
    stage. ``wgrad`` is the W share of a split backward (default: half of ``bwd``).
    ``activation_sizes`` (per stage; default 1 each) weighs a stage's forwards held in
    ``peak_activation_size``.

    ``on_progress`` is called with the share of all actions executed since its last call.
    """
    ranks = len(lowered)
    if ranks == 0:
        raise ScheduleError("the schedule has no ranks")
    rank_of, stages = _check_placement(lowered)
    backward = _per_stage(bwd, stages, "bwd")
    weight = [b / 2 for b in backward] if wgrad is None else _per_stage(wgrad, stages, "wgrad")
    if any(w >= b for w, b in zip(weight, backward, strict=True)):
        raise ScheduleError(
            f"wgrad times {weight} must be below the backward times {backward}: a split "
            "backward's I takes bwd - wgrad"
        )
    durations = {
        ActionKind.F: _per_stage(fwd, stages, "fwd"),
        ActionKind.B: backward,
        ActionKind.I: [b - w for b, w in zip(backward, weight, strict=True)],
        ActionKind.W: weight,
    }
    if not (math.isfinite(comm) and comm >= 0):
        raise ScheduleError(f"comm latency must be >= 0 and finite, got {comm}")

    sizes = [1.0] * stages if activation_sizes is None else list(map(float, activation_sizes))
    if len(sizes) != stages or not all(math.isfinite(v) and v >= 0 for v in sizes):
        raise ScheduleError(
            f"activation_sizes must be {stages} sizes >= 0, one per stage, got {sizes}"
        )
    violations: list[str] = []
    states = [
        _RankState(rank_actions, rank_of, stages - 1, violations, sizes) for rank_actions in lowered
    ]
    arrivals: dict[tuple[str, int, int, int | None], float] = {}
    position = [0] * ranks
    clock = [0.0] * ranks
    timeline: list[list[TimedAction]] = [[] for _ in range(ranks)]
    total, reported = max(sum(map(len, lowered)), 1), 0.0
    progress = True
    while progress:
        progress = False
        for r in range(ranks):
            while position[r] < len(lowered[r]):
                a = lowered[r][position[r]]
                start = clock[r]
                if a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
                    if _message(a) not in arrivals:
                        break
                    start = max(start, arrivals.pop(_message(a)))
                end = start + sum(durations[p.kind][p.stage] for p in a.parts if p.kind.is_compute)
                if a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
                    if _message(a) in arrivals:
                        violations.append(f"{a} sends a message that is already pending")
                    arrivals[_message(a)] = end + comm
                states[r].execute(position[r], a)
                timeline[r].append(TimedAction(a, start, end))
                clock[r] = end
                position[r] += 1
                progress = True
        if on_progress is not None:
            done = sum(position) / total
            on_progress(done - reported)
            reported = done
    stuck = [lowered[r][position[r]] for r in range(ranks) if position[r] < len(lowered[r])]
    if stuck:
        raise DeadlockError(stuck)
    violations += [
        f"{what} {mb} from stage {a} to {b} is never received" for what, a, b, mb in arrivals
    ]
    stage_versions = [0] * stages
    for st in states:
        for stage, peak in st.stage_peak_versions.items():
            stage_versions[stage] = peak
    return SimResult(
        timeline=timeline,
        peak_activations=[st.peak_activations for st in states],
        peak_activation_size=[st.peak_activation_size for st in states],
        weight_versions=[max(st.stage_peak_versions.values()) for st in states],
        stage_weight_versions=stage_versions,
        violations=violations,
    )
