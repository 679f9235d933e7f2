"""Generators: (schedule, P ranks, M microbatches, steps) -> per-rank F/B/I/W/STEP action lists.

Every schedule is a microbatch order per rank, applied either to one minibatch at a time (flush
before every step) or to the whole run at once (no flush), plus a rule for where STEPs go and
which weight version each forward uses (the schedule's registry spec says which):

* gpipe: all forwards, then all backwards.
* 1f1b: P-1-s warm-up forwards, then alternate forward/backward, then the remaining backwards.
* interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): v stages per rank, stage c·P + r on
  rank r; forwards go through the rank's stages in groups of P microbatches, with a longer
  warm-up, so the bubble shrinks by v at the cost of v times the messages.
* ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with each backward
  split into I (input gradient, on the critical path) and W (weight gradient, which can wait);
  rank r keeps up to r W's pending and runs them while it would otherwise wait for a gradient,
  so at most P microbatches are in flight on any rank, as on 1F1B's first rank.
* ZB-H2 (same paper): 2(P-1-r)+1 warm-up forwards and up to 2r W's pending, so every rank holds
  up to 2P microbatches. With F = I = W its steady step is 3M, no bubble, once M >= 2P: a
  stage's STEP waits for its own W's only, so the first stages start the next step's forwards
  while the last ones still run the W's they kept back, and those fill the wait for them.
* ZB-V (Qi et al., section 6 of the zero-bubble paper's later version): the V placement, rank r
  holding stages r (down) and 2P-1-r (up), I and W split. Warm-up: 2(P-r)-1 forwards of the
  first stage, then r pairs (a forward of the second, one of the first), then P-r times a
  forward, I and W of the second; steady: F, I, W of the first stage, then of the second, while
  forwards remain; cool-down: r pairs of I's (first, second stage), then P-r times an I and the
  oldest pending W of the first stage, then every W left, the second stage's first. With F = I
  = W and enough microbatches every rank is busy but for the fill; fewer than 2P-1 microbatches
  run the order of 2P-1 with the missing ones left out (as torch's ScheduleZBVZeroBubble).
* DualPipeV (DeepSeek-V3's DualPipe folded onto P ranks, as in DeepSeek's dualpipev and torch's
  ScheduleDualPipeV): the V placement; on rank r, with stages a = r and b = 2P-1-r, eight phases:
  (1) 2(P-1-r) forwards of a; (2) r+1 pairs F a, F b; (3) P-1-r times I b, the oldest pending
  W, F b; (4) M-2P+r+1 times an overlapped F a & B b then F b & B a (the last rank runs its very
  first F a and B b apart); (5) P-1-r times B b, then F b & B a; (6) r+1 pairs of backwards of b
  and a, full B's until half way, I's after (the odd ranks switch one action earlier); (7)
  P-1-r times the oldest pending W and a backward of a; (8) the r+1 W's left.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain

from nobubble.schedules.ir import Action, ActionKind, Schedule, ScheduleError
from nobubble.schedules.registry import ScheduleSpec, schedule_spec
from nobubble.schedules.v_wave import wave_order

# (kind, stage, microbatch), produced lazily; an FB is (FB, forward stage, forward microbatch,
# backward stage, backward microbatch)
Task = tuple[ActionKind, int, int] | tuple[ActionKind, int, int, int, int]
Order = Iterator[Task]
F, B, I, W, FB = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.FB  # noqa: E741


def gpipe_order(stage: int, microbatches: range) -> Order:
    yield from ((F, stage, k) for k in microbatches)
    yield from ((B, stage, k) for k in microbatches)


def one_f_one_b_order(stage: int, stages: int, microbatches: range) -> Order:
    """1F1B: stage s runs P-1-s forwards ahead, so at most P-s activations are in flight."""
    n = len(microbatches)
    warmup = min(stages - 1 - stage, n)
    for i in range(warmup):
        yield F, stage, microbatches[i]
    for i in range(n - warmup):
        yield F, stage, microbatches[i + warmup]
        yield B, stage, microbatches[i]
    for i in range(n - warmup, n):
        yield B, stage, microbatches[i]


def interleaved_order(rank: int, ranks: int, chunks: int, microbatches: range) -> Order:
    """Interleaved 1F1B on rank r of P with v chunks (stages r, P + r, ..., (v-1)·P + r).

    The rank's i-th forward is microbatch (i // (P·v))·P + i % P of its chunk (i // P) % v; its
    i-th backward the same microbatch of chunk v-1 - (i // P) % v. It runs 2·(P-1-r) + (v-1)·P
    forwards ahead (all of them if fewer), then one forward and one backward at a time.
    """
    total = len(microbatches) * chunks

    def task(i: int, backward: bool) -> tuple[int, int]:
        chunk = (i // ranks) % chunks
        if backward:
            chunk = chunks - 1 - chunk
        k = (i // (ranks * chunks)) * ranks + i % ranks
        return chunk * ranks + rank, microbatches[k]

    warmup = min(2 * (ranks - 1 - rank) + (chunks - 1) * ranks, total)
    for i in range(warmup):
        yield F, *task(i, False)
    for i in range(total - warmup):
        yield F, *task(i + warmup, False)
        yield B, *task(i, True)
    for i in range(total - warmup, total):
        yield B, *task(i, True)


def zero_bubble_order(stage: int, microbatches: range, warmup: int, pending: int) -> Order:
    """``warmup`` forwards, then one forward and one I at a time, each W after the I that makes
    it pending beyond ``pending`` W's, the last ones at the end of the step."""
    n = len(microbatches)
    warmup = min(warmup, n)
    for i in range(warmup):
        yield F, stage, microbatches[i]
    waiting: list[int] = []
    for i in range(n):
        if i + warmup < n:
            yield F, stage, microbatches[i + warmup]
        yield I, stage, microbatches[i]
        waiting.append(microbatches[i])
        while len(waiting) > pending:
            yield W, stage, waiting.pop(0)
    yield from ((W, stage, k) for k in waiting)


def zero_bubble_h1_order(stage: int, stages: int, microbatches: range) -> Order:
    """ZB-H1 at stage s (one stage per rank): 1F1B's F/I order, s W's kept pending."""
    return zero_bubble_order(stage, microbatches, stages - 1 - stage, stage)


def zero_bubble_h2_order(stage: int, stages: int, microbatches: range) -> Order:
    """ZB-H2 at stage s: 2(P-1-s)+1 warm-up forwards, 2s W's kept pending."""
    return zero_bubble_order(stage, microbatches, 2 * (stages - 1 - stage) + 1, 2 * stage)


def zero_bubble_v_order(rank: int, ranks: int, microbatches: range) -> Order:
    """ZB-V on rank r of P (module docstring): stages r and 2P-1-r."""
    down, up = rank, 2 * ranks - 1 - rank
    n = max(len(microbatches), 2 * ranks - 1)  # the order of at least 2P-1 microbatches
    made = {(kind, stage): 0 for kind in (F, I, W) for stage in (down, up)}

    def run(kind: ActionKind, stage: int) -> Iterator[tuple[ActionKind, int, int]]:
        i = made[kind, stage]
        made[kind, stage] += 1
        if i < len(microbatches):  # one of the microbatches that exist
            yield kind, stage, microbatches[i]

    for _ in range(2 * (ranks - rank) - 1):
        yield from run(F, down)
    for _ in range(rank):
        yield from chain(run(F, up), run(F, down))
    for _ in range(ranks - rank):
        yield from chain(run(F, up), run(I, up), run(W, up))
    while made[F, down] < n or made[F, up] < made[F, down]:
        if made[F, down] < n:
            yield from run(F, down)
        yield from chain(run(I, down), run(W, down), run(F, up), run(I, up), run(W, up))
    for _ in range(rank):
        yield from chain(run(I, down), run(I, up))
    for _ in range(ranks - rank):
        yield from chain(run(I, down), run(W, down))
    for stage in (up, down):
        while made[W, stage] < made[I, stage]:
            yield from run(W, stage)


def dualpipev_order(rank: int, ranks: int, microbatches: range) -> Order:
    """DualPipeV on rank r of P (module docstring): stages r and 2P-1-r, M >= 2P."""
    a, b = rank, 2 * ranks - 1 - rank
    made: dict[tuple[int, bool], int] = {}  # (stage, backward?) -> microbatches begun
    pending: list[tuple[int, int]] = []  # (stage, microbatch) of the I's whose W waits

    def take(stage: int, backward: bool) -> int:
        i = made.get((stage, backward), 0)
        made[stage, backward] = i + 1
        return microbatches[i]

    def forward(stage: int) -> Task:
        return F, stage, take(stage, False)

    def backward(stage: int, split: bool = False) -> Task:
        k = take(stage, True)
        if split:
            pending.append((stage, k))
        return (I if split else B), stage, k

    def overlapped(forward_stage: int, backward_stage: int) -> Task:
        return FB, *forward(forward_stage)[1:], *backward(backward_stage)[1:]

    def weight() -> Task:
        return W, *pending.pop(0)

    for _ in range(2 * (ranks - 1 - rank)):
        yield forward(a)
    for _ in range(rank + 1):
        yield forward(a)
        yield forward(b)
    for _ in range(ranks - 1 - rank):
        yield backward(b, split=True)
        yield weight()
        yield forward(b)
    for i in range(len(microbatches) - 2 * ranks + rank + 1):
        if i == 0 and rank == ranks - 1:  # the first pair at the bottom runs apart
            yield forward(a)
            yield backward(b)
        else:
            yield overlapped(a, b)
        yield overlapped(b, a)
    for _ in range(ranks - 1 - rank):
        yield backward(b)
        yield overlapped(b, a)
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        yield backward(b, split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        yield backward(a, split)
    for _ in range(ranks - 1 - rank):
        if pending:
            yield weight()
        yield backward(a, split)
    while pending:
        yield weight()


def two_bw_v_order(rank: int, ranks: int, microbatches: range) -> Order:
    """2bw-v on rank r of P (a candidate, nobubble.schedules.v_wave): stages r and 2P-1-r, each
    rank's actions in the order of the unflushed V's steady wave, the whole run at once."""
    for kind, stage, i in wave_order(rank, ranks, len(microbatches)):
        yield kind, stage, microbatches[i]


def _emit(
    rank_order: Iterable[Task],
    microbatches: int,
    *,
    step_per_microbatch: bool,
    delayed: bool,
) -> Iterator[Action]:
    """Turn one rank's order into actions, as lazily as the order comes.

    A stage's STEP follows its last weight gradient (B or W) of each step (every one if
    ``step_per_microbatch``). A forward uses the newest version of its stage, or with
    ``delayed`` (2bw) version max(t-1, 0) for minibatch t. A backward (B, I, W) uses the version
    its forward used (weight stashing). What it remembers is the microbatches in flight and the
    steps not complete yet, so its memory does not grow with the steps.
    """
    per_step = 1 if step_per_microbatch else microbatches

    def step_of(k: int) -> int:
        return k if step_per_microbatch else k // microbatches

    stashed: dict[tuple[int, int], int] = {}
    produced: dict[int, int] = {}
    applied: dict[tuple[int, int], int] = {}  # (stage, step) -> weight gradients so far

    def compute(kind: ActionKind, stage: int, k: int) -> Action:
        t = step_of(k)
        if kind is F:
            version = max(t - 1, 0) if delayed else produced.get(stage, 0)
            stashed[stage, k] = version
        else:
            version = stashed[stage, k] if kind is I else stashed.pop((stage, k))
        return Action(kind, stage, k, version, t)

    for kind, stage, k, *backward in rank_order:
        if kind is FB:
            forward, last = compute(F, stage, k), compute(B, *backward)
            yield Action(FB, stage, k, forward.version, forward.step, paired=last)
        else:
            last = compute(kind, stage, k)
            yield last
        if last.kind.makes_weight_gradient:
            key = (last.stage, last.step)
            applied[key] = applied.get(key, 0) + 1
            if applied[key] == per_step:
                del applied[key]
                produced[last.stage] = produced.get(last.stage, 0) + 1
                yield Action(ActionKind.STEP, last.stage, None, produced[last.stage], last.step)


def _checked(
    schedule: str | ScheduleSpec, stages: int, microbatches: int, steps: int, chunks: int | None
) -> tuple[ScheduleSpec, int]:
    """The schedule's spec (a name in the registry, or a candidate's spec itself) and its
    stages per rank, once the shape is known to run."""
    spec = schedule if isinstance(schedule, ScheduleSpec) else schedule_spec(schedule)
    chunks = spec.default_chunks if chunks is None else chunks
    for name, value in (("stages", stages), ("microbatches", microbatches), ("steps", steps)):
        if value < 1:
            raise ScheduleError(f"{name} must be at least 1, got {value}")
    problem = spec.microbatch_problem(stages, microbatches) or spec.chunk_problem(chunks)
    if problem:
        raise ScheduleError(problem)
    return spec, chunks


def _rank_order(
    spec: ScheduleSpec, rank: int, ranks: int, chunks: int, microbatches: range
) -> Order:
    if spec.order == "gpipe":
        return gpipe_order(rank, microbatches)
    if spec.order == "interleaved":
        return interleaved_order(rank, ranks, chunks, microbatches)
    if spec.order == "zb-h1":
        return zero_bubble_h1_order(rank, ranks, microbatches)
    if spec.order == "zb-h2":
        return zero_bubble_h2_order(rank, ranks, microbatches)
    if spec.order == "zb-v":
        return zero_bubble_v_order(rank, ranks, microbatches)
    if spec.order == "dualpipev":
        return dualpipev_order(rank, ranks, microbatches)
    if spec.order == "2bw-v":
        return two_bw_v_order(rank, ranks, microbatches)
    return one_f_one_b_order(rank, ranks, microbatches)


def rank_actions(
    schedule: str | ScheduleSpec,
    stages: int,
    microbatches: int,
    steps: int,
    rank: int,
    chunks: int | None = None,
) -> Iterator[Action]:
    """The actions of ``rank`` in :func:`generate`'s list, made one at a time as they are read.

    Taking the first actions of a run of any length costs what those actions cost: a
    synchronous schedule is planned a step at a time, and 2bw's and pipedream's single run of
    1F1B (warm-up in the first step, cool-down in the last, the state in between carried over)
    a microbatch at a time. The arguments are checked here, before the first action is asked for.
    """
    spec, chunks = _checked(schedule, stages, microbatches, steps, chunks)
    if not 0 <= rank < stages:
        raise ScheduleError(f"rank must be in 0..{stages - 1}, got {rank}")
    if spec.flushes:
        order = chain.from_iterable(
            _rank_order(spec, rank, stages, chunks, range(t * microbatches, (t + 1) * microbatches))
            for t in range(steps)
        )
    else:  # the whole run at once
        order = _rank_order(spec, rank, stages, chunks, range(microbatches * steps))
    return _emit(
        order,
        microbatches,
        step_per_microbatch=spec.step_per_microbatch,
        delayed=spec.forwards_use_previous_step,
    )


def until_step(actions: Iterable[Action], step: int) -> Iterator[Action]:
    """The actions of the steps before ``step``: a rank's list of the same schedule run for
    ``step`` steps (cool-down included), read off the list of a longer run.

    Every rank runs its backwards in step order, and once it has run a backward of some step it
    only runs actions of that step or later; so the longer list is read no further than its
    first backward of ``step`` (the rest of a long run is never made).
    """
    for action in actions:
        if action.step < step:
            yield action
        elif action.kind.is_backward:
            return


def generate(
    schedule: str | ScheduleSpec,
    stages: int,
    microbatches: int,
    steps: int,
    chunks: int | None = None,
) -> Schedule:
    """Per-rank action lists for ``steps`` optimizer steps of ``microbatches`` each, on
    ``stages`` ranks (pipeline stages); ``chunks`` stages per rank where the schedule takes
    several (default: the spec's), so the model is cut into ``stages * chunks`` stages.

    pipedream steps after every microbatch, so it runs ``microbatches * steps`` optimizer steps
    (the training config uses M=1 for it).
    """
    _checked(schedule, stages, microbatches, steps, chunks)  # also with no rank to list
    return [
        list(rank_actions(schedule, stages, microbatches, steps, rank, chunks))
        for rank in range(stages)
    ]
