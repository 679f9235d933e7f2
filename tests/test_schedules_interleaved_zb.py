"""Interleaved 1F1B and ZB-H1: hand-checked action lists, the bubble and memory their papers
give, and the IR pieces they need (several stages per rank, I/W backwards, in-memory hand-over)."""

import pytest

from nobubble.layout import ParallelLayout
from nobubble.schedules import (
    Action,
    ActionKind,
    ScheduleError,
    check_invariants,
    generate,
    is_lowered,
    lower,
    simulate,
)
from nobubble.schedules.ir import stage_ranks
from nobubble.schedules.timing import split_rank_times

K = ActionKind


def act(kind: ActionKind, s: int, k: int, v: int = 0, t: int = 0) -> Action:
    return Action(kind, s, k, v, t)


def step(s: int, t: int = 0, produces: int = 1) -> Action:
    return Action(K.STEP, s, None, produces, t)


# --- ZB-H1 -----------------------------------------------------------------------------------


def test_zb_h1_p2_m2_by_hand():
    """Rank 0 keeps no W pending (runs each right after its I); rank 1 keeps one."""
    F, I, W = K.F, K.I, K.W  # noqa: E741
    assert generate("zb-h1", 2, 2, 1) == [
        [act(F, 0, 0), act(F, 0, 1), act(I, 0, 0), act(W, 0, 0), act(I, 0, 1), act(W, 0, 1),
         step(0)],
        [act(F, 1, 0), act(I, 1, 0), act(F, 1, 1), act(I, 1, 1), act(W, 1, 0), act(W, 1, 1),
         step(1)],
    ]  # fmt: skip


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 4), (4, 8), (8, 16), (3, 7)])
def test_zb_h1_bubble_and_memory_are_the_papers(p, m):
    """With F = I = W = 1 a step takes 3M + (P-1) (1F1B: 3(M + P - 1)), a bubble of
    (P-1)/(3M) of the compute, and every rank holds at most P microbatches' activations, as
    1F1B's first rank does (Qi et al. 2024, table of schedules)."""
    steps = 2
    zb = simulate(lower(generate("zb-h1", p, m, steps)), fwd=1, bwd=2, wgrad=1)
    one = simulate(lower(generate("1f1b", p, m, steps)), fwd=1, bwd=2)
    assert zb.makespan == steps * (3 * m + p - 1)
    assert one.makespan == steps * 3 * (m + p - 1)
    assert sum(zb.idle) / sum(zb.busy) == pytest.approx((p - 1) / (3 * m))
    assert max(zb.peak_activations) == max(one.peak_activations) == min(p, m)
    assert check_invariants(generate("zb-h1", p, m, steps), "zb-h1", zb) == []


# --- interleaved 1F1B ------------------------------------------------------------------------


def test_interleaved_p2_v2_m2_by_hand():
    """Stages 0, 2 on rank 0 and 1, 3 on rank 1; rank 0 warms up with all four forwards
    (2·(P-1-r) + (v-1)·P = 4), rank 1 with two, then one forward and one backward."""
    F, B = K.F, K.B
    assert generate("interleaved-1f1b", 2, 2, 1) == [
        [act(F, 0, 0), act(F, 0, 1), act(F, 2, 0), act(F, 2, 1),
         act(B, 2, 0), act(B, 2, 1), step(2), act(B, 0, 0), act(B, 0, 1), step(0)],
        [act(F, 1, 0), act(F, 1, 1), act(F, 3, 0), act(B, 3, 0), act(F, 3, 1), act(B, 3, 1),
         step(3), act(B, 1, 0), act(B, 1, 1), step(1)],
    ]  # fmt: skip


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 2), (4, 2, 8), (4, 4, 8), (3, 3, 6), (8, 2, 8)])
def test_interleaved_bubble_shrinks_by_the_chunks(p, v, m):
    """A rank's F takes 1 and its B 2 in all, split over its v stages: a step takes
    3M + 3(P-1)/v against 1F1B's 3(M + P - 1) (Narayanan et al. 2021)."""
    actions = generate("interleaved-1f1b", p, m, 2, chunks=v)
    assert stage_ranks(actions) == {s: s % p for s in range(p * v)}
    result = simulate(
        lower(actions), fwd=split_rank_times(1, actions), bwd=split_rank_times(2, actions)
    )
    assert result.makespan == pytest.approx(2 * (3 * m + 3 * (p - 1) / v))
    assert check_invariants(actions, "interleaved-1f1b", result) == []
    assert result.stages == p * v and result.ranks == p


def test_interleaved_rules_are_explained():
    with pytest.raises(ScheduleError, match=r"M must be a multiple of P \(got M=6, P=4\); use 8"):
        generate("interleaved-1f1b", 4, 6, 1)
    with pytest.raises(ScheduleError, match="needs at least 2 stages per rank"):
        generate("interleaved-1f1b", 2, 2, 1, chunks=1)
    with pytest.raises(ScheduleError, match="1f1b runs one stage per rank"):
        generate("1f1b", 2, 2, 1, chunks=2)


# --- the IR pieces ---------------------------------------------------------------------------


def test_stages_on_one_rank_hand_over_without_messages():
    """Two stages on one rank (as ZB-V's turn puts them): no SEND/RECV, and the simulator
    still sees that stage 1's forward needs stage 0's first."""
    F, B = K.F, K.B
    good = [[act(F, 0, 0), act(F, 1, 0), act(B, 1, 0), act(B, 0, 0), step(1), step(0)]]
    assert lower(good) == good and is_lowered(good)
    assert simulate(good).violations == []
    bad = [[act(F, 1, 0), act(F, 0, 0), act(B, 0, 0), act(B, 1, 0), step(1), step(0)]]
    problems = simulate(bad).violations
    assert "F0v0@s1 runs before its activation was received" in problems
    assert "B0v0@s0 runs before its gradient was received" in problems


def test_a_weight_gradient_before_its_input_gradient_is_caught():
    F, I, W = K.F, K.I, K.W  # noqa: E741
    actions = [[act(F, 0, 0), act(W, 0, 0), act(I, 0, 0), step(0)]]
    assert "W0v0@s0 runs before its I" in simulate(actions).violations
    missing = [[act(F, 0, 0), act(I, 0, 0), step(0)]]
    assert any("never runs W" in p for p in check_invariants(missing, "zb-h1"))


def test_holding_more_activations_than_the_schedule_allows_is_caught():
    gpipe = generate("gpipe", 2, 4, 1)  # 4 forwards in flight on rank 0; 1f1b allows 2
    problems = check_invariants(gpipe, "1f1b")
    assert "rank 0 holds 4 microbatches' activations; 1f1b allows 2" in problems
    assert check_invariants(gpipe, "gpipe") == []


def test_split_rank_times_share_a_rank_equally_between_its_stages():
    actions = generate("interleaved-1f1b", 2, 2, 1, chunks=2)
    assert split_rank_times([1.0, 3.0], actions) == [0.5, 1.5, 0.5, 1.5]
    assert split_rank_times(2, generate("1f1b", 2, 2, 1)) == [2.0, 2.0]


@pytest.mark.parametrize(("ranks", "chunks"), [(2, 2), (3, 2), (2, 3), (4, 4)])
def test_the_generator_places_stages_where_the_runtime_layout_does(ranks, chunks):
    """The IR's placement (read off its lists) and the training layout's are one rule."""
    placed = stage_ranks(generate("interleaved-1f1b", ranks, ranks, 1, chunks))
    layout = ParallelLayout(ranks, chunks=chunks)
    assert placed == {stage: layout.rank_of(stage) for stage in range(ranks * chunks)}
    for rank in range(ranks):
        assert layout.stages_of(rank) == tuple(sorted(s for s, r in placed.items() if r == rank))
