"""Generators: (schedule, P stages, M microbatches, steps) -> per-stage F/B/STEP action lists.

All four schedules are one of two microbatch orders (GPipe: all forwards then all backwards;
1F1B: P-1-s warm-up forwards, then alternate forward/backward, then the remaining backwards)
applied to either one minibatch at a time (flush before every step) or to the whole run at once
(no flush), plus a rule for where STEPs go and which weight version each forward uses.
"""

from __future__ import annotations

from nobubble.schedules.ir import Action, ActionKind, Schedule, ScheduleError
from nobubble.schedules.registry import ScheduleSpec, schedule_spec

Order = list[tuple[ActionKind, int]]


def gpipe_order(microbatches: range) -> Order:
    return [(ActionKind.F, k) for k in microbatches] + [(ActionKind.B, k) for k in microbatches]


def one_f_one_b_order(stage: int, stages: int, microbatches: range) -> Order:
    """1F1B: stage s runs P-1-s forwards ahead, so at most P-s activations are in flight."""
    n = len(microbatches)
    warmup = min(stages - 1 - stage, n)
    order: Order = [(ActionKind.F, microbatches[i]) for i in range(warmup)]
    for i in range(n - warmup):
        order += [(ActionKind.F, microbatches[i + warmup]), (ActionKind.B, microbatches[i])]
    order += [(ActionKind.B, microbatches[i]) for i in range(n - warmup, n)]
    return order


def _emit(
    stage: int, order: Order, microbatches: int, *, step_per_microbatch: bool, delayed: bool
) -> list[Action]:
    """Turn a microbatch order into actions.

    A STEP follows the last backward of each step (every backward if ``step_per_microbatch``). A
    forward uses the newest version at this stage, or with ``delayed`` (2bw) version
    max(t-1, 0) for minibatch t. A backward uses the version its forward used (weight stashing).
    """

    def step_of(k: int) -> int:
        return k if step_per_microbatch else k // microbatches

    actions: list[Action] = []
    stashed: dict[int, int] = {}
    produced = 0
    for kind, k in order:
        if kind is ActionKind.F:
            stashed[k] = max(step_of(k) - 1, 0) if delayed else produced
            actions.append(Action(ActionKind.F, stage, k, stashed[k], step_of(k)))
            continue
        actions.append(Action(ActionKind.B, stage, k, stashed.pop(k), step_of(k)))
        if step_per_microbatch or k % microbatches == microbatches - 1:
            produced += 1
            actions.append(Action(ActionKind.STEP, stage, None, produced, step_of(k)))
    return actions


def _validate(spec: ScheduleSpec, stages: int, microbatches: int, steps: int) -> None:
    for name, value in (("stages", stages), ("microbatches", microbatches), ("steps", steps)):
        if value < 1:
            raise ScheduleError(f"{name} must be at least 1, got {value}")
    problem = spec.microbatch_problem(stages, microbatches)
    if problem:
        raise ScheduleError(problem)


def _stage_order(
    spec: ScheduleSpec, stage: int, stages: int, microbatches: int, steps: int
) -> Order:
    if spec.flushes:  # one minibatch at a time
        order: Order = []
        for t in range(steps):
            block = range(t * microbatches, (t + 1) * microbatches)
            if spec.order == "gpipe":
                order += gpipe_order(block)
            else:
                order += one_f_one_b_order(stage, stages, block)
        return order
    return one_f_one_b_order(stage, stages, range(microbatches * steps))  # no flush


def generate(schedule: str, stages: int, microbatches: int, steps: int) -> Schedule:
    """Per-stage F/B/STEP lists for ``steps`` optimizer steps of ``microbatches`` each.

    pipedream steps after every microbatch, so it runs ``microbatches * steps`` optimizer steps
    (the training config uses M=1 for it).
    """
    spec = schedule_spec(schedule)
    _validate(spec, stages, microbatches, steps)
    return [
        _emit(
            s,
            _stage_order(spec, s, stages, microbatches, steps),
            microbatches,
            step_per_microbatch=spec.step_per_microbatch,
            delayed=spec.forwards_use_previous_step,
        )
        for s in range(stages)
    ]
