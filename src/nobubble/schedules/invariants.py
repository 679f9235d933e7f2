"""Invariants a schedule must satisfy, checked on the IR itself.

* Every stage runs one F and one backward (a B, or an I and a W) of every microbatch (and, from
  the simulator: in an order that can run, i.e. no deadlock, inputs received before use, each
  backward with its own F's version, every W after its I, every weight version held when used).
* The gradient a STEP applies is exactly as old as the schedule promises (its registry spec): a
  STEP producing v+1 from v applies gradients computed at version max(v - d, 0), with d = 0 for
  the flushing schedules, d = 1 for 2bw (w[t+1] = w[t] - Δ(g(w[t-1])), w[-1] = w[0]) and
  d = P-1-s at stage s for pipedream. The max() is the start of the run, where the older version
  does not exist.
* Every model stage runs on the rank its schedule's placement puts it (``loop``: stage c·P + r on
  rank r; ``v``: stages r and 2P-1-r on rank r), the map the training layout uses.
* Between two model stages on different ranks, the messages of each kind (activations,
  gradients) are received in the order they are sent: what a transport without tags (NCCL)
  needs, since it pairs the n-th send with the n-th receive (``nobubble.pipeline.links``). Two
  stages on one rank (the bottom of the V) hand over in memory: no message, nothing to pair.
* A stage holds at most d + 1 weight versions (its weight stash), and a rank at most the
  activations its schedule's registry spec allows (activation_budget).
"""

from __future__ import annotations

from nobubble.layout import ParallelLayout
from nobubble.schedules.ir import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    stage_count,
    stage_ranks,
)
from nobubble.schedules.lowering import is_lowered, lower
from nobubble.schedules.registry import ScheduleSpec, schedule_spec
from nobubble.schedules.timing import SimResult, simulate


def _computed(actions: Schedule) -> list[Action]:
    """Every F/B/I/W of the schedule, an FB's halves apart."""
    return [p for rank in actions for a in rank if a.kind.is_compute for p in a.parts]


def _coverage(actions: Schedule) -> list[str]:
    computed = _computed(actions)
    expected = {a.microbatch for a in computed}
    done: dict[int, dict[ActionKind, set[int | None]]] = {}
    for a in computed:
        done.setdefault(a.stage, {}).setdefault(a.kind, set()).add(a.microbatch)
    problems = []
    for stage in sorted(done):
        ran = done[stage]
        whole, split = ran.get(ActionKind.B, set()), ran.get(ActionKind.I, set())
        for kind, missing in (
            (ActionKind.F, expected - ran.get(ActionKind.F, set())),
            # a microbatch's backward is a B or an I and a W (DualPipeV mixes both)
            (ActionKind.B, expected - whole - split - ran.get(ActionKind.W, set())),
            (ActionKind.I, ran.get(ActionKind.W, set()) - split),
            (ActionKind.W, split - ran.get(ActionKind.W, set())),
        ):
            if missing:
                problems.append(
                    f"stage {stage} never runs {kind} of microbatches {sorted(missing)}"
                )
    return problems


def _placement(actions: Schedule, stages: int, placement: str) -> list[str]:
    """Every model stage on the rank its schedule's placement (the layout's map) puts it."""
    ranks = len(actions)
    if stages % ranks:
        return [f"{stages} model stages do not split evenly over {ranks} ranks"]
    layout = ParallelLayout(ranks, chunks=stages // ranks, placement=placement)
    return [
        f"stage {stage} runs on rank {rank}; the {placement} placement puts it on rank "
        f"{layout.rank_of(stage)}"
        for stage, rank in sorted(stage_ranks(actions).items())
        if rank != layout.rank_of(stage)
    ]


def _gradient_delays(stage_actions: list[Action], delay: int) -> list[str]:
    """Check every STEP of one stage against the promised gradient delay."""
    problems = []
    pending: dict[int, set[int]] = {}  # step -> versions its weight gradients computed with
    stepped: set[int] = set()
    for a in stage_actions:
        if a.kind.makes_weight_gradient:
            if a.step in stepped:
                problems.append(f"{a} runs after the STEP of its step {a.step}")
            pending.setdefault(a.step, set()).add(a.version)
        elif a.kind is ActionKind.STEP:
            stepped.add(a.step)
            versions = pending.pop(a.step, set())
            base, expected = a.version - 1, max(a.version - 1 - delay, 0)
            if versions != {expected}:
                found = ", ".join(f"v{v}" for v in sorted(versions)) or "no gradient"
                problems.append(
                    f"{a} updates v{base} with gradients from {found}; expected v{expected} "
                    f"(a delay of {delay})"
                )
    problems += [
        f"stage {stage_actions[0].stage}: backwards of step {t} are never applied by a STEP"
        for t in sorted(pending)
    ]
    return problems


def _edge_order(lowered: Schedule) -> list[str]:
    """Every stage edge's messages of each kind received in the order they are sent."""
    sent: dict[tuple[str, int, int], list[int | None]] = {}
    received: dict[tuple[str, int, int], list[int | None]] = {}
    for rank in lowered:
        for a in rank:
            if a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
                sent.setdefault((a.kind.removeprefix("SEND_"), a.stage, a.peer), []).append(
                    a.microbatch
                )
            elif a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
                received.setdefault((a.kind.removeprefix("RECV_"), a.peer, a.stage), []).append(
                    a.microbatch
                )
    return [
        f"stage {sender} sends its {what.lower()} messages to stage {receiver} for microbatches "
        f"{order}, stage {receiver} receives them as {received.get(edge)}: a transport "
        "without tags (NCCL) would pair them wrongly"
        for edge, order in sent.items()
        for what, sender, receiver in [edge]
        # the same messages in another order (a missing one is the simulator's deadlock)
        if received.get(edge) != order and sorted(received.get(edge, [])) == sorted(order)
    ]


def check_invariants(
    actions: Schedule, schedule: str | ScheduleSpec, result: SimResult | None = None
) -> list[str]:
    """All violations of ``schedule``'s invariants in ``actions`` (lowered or not); [] if none.
    ``schedule`` is a name in the registry or a candidate's spec itself.

    ``result`` is a simulation of ``actions`` already run, with any timings (what it finds does
    not depend on them); without it the check simulates ``actions`` itself.
    """
    spec = schedule if isinstance(schedule, ScheduleSpec) else schedule_spec(schedule)
    try:
        stages = stage_count(actions)
    except ScheduleError as exc:
        return [str(exc)]
    problems = _coverage(actions) + _placement(actions, stages, spec.placement)
    for s in range(stages):
        stage_actions = [
            p for rank in actions for a in rank for p in a.parts if p.stage == s
        ]  # in each rank's order (a stage's actions all sit on one rank)
        problems += _gradient_delays(stage_actions, spec.delay(s, stages))
    try:
        lowered = actions if is_lowered(actions) else lower(actions)
        problems += _edge_order(lowered)
        if result is None:
            result = simulate(lowered)
    except ScheduleError as exc:  # deadlock or malformed
        return [*problems, str(exc)]
    problems += result.violations
    ranks = len(actions)
    per_step = sum(
        a.kind is ActionKind.F and a.stage == 0 and a.step == 0 for a in _computed(actions)
    )
    for r, held in enumerate(result.peak_activations):
        budget = spec.activation_budget(r, ranks, per_step, stages // ranks)
        if held > budget:
            problems.append(
                f"rank {r} holds {held} microbatches' activations; {spec.name} allows {budget}"
            )
    for s, held in enumerate(result.stage_weight_versions):
        budget = spec.version_budget(s, stages)
        if held > budget:
            problems.append(f"stage {s} holds {held} weight versions; {spec.name} allows {budget}")
    return problems
