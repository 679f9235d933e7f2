"""Schedule IR: generators, lowering, simulator and invariants (pure Python, no process group)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nobubble.layout import ParallelLayout
from nobubble.schedules import (
    SCHEDULE_NAMES,
    Action,
    ActionKind,
    DeadlockError,
    ScheduleError,
    check_invariants,
    generate,
    is_lowered,
    lower,
    schedule_spec,
    simulate,
    version_last_uses,
)
from nobubble.schedules.ir import stage_ranks

K = ActionKind


def F(s: int, k: int, v: int, t: int) -> Action:
    return Action(K.F, s, k, v, t)


def B(s: int, k: int, v: int, t: int) -> Action:
    return Action(K.B, s, k, v, t)


def STEP(s: int, t: int, produces: int) -> Action:
    return Action(K.STEP, s, None, produces, t)


def comm(kind: ActionKind, s: int, k: int, peer: int) -> Action:
    return Action(kind, s, k, 0, 0, peer)


def run(schedule: str, p: int, m: int, steps: int, **times: float):
    return simulate(lower(generate(schedule, p, m, steps)), **times)


# --- generators: exact, hand-checked action lists --------------------------------------------


def test_gpipe_p2_m2_by_hand():
    assert generate("gpipe", 2, 2, 1) == [
        [F(s, 0, 0, 0), F(s, 1, 0, 0), B(s, 0, 0, 0), B(s, 1, 0, 0), STEP(s, 0, 1)]
        for s in range(2)
    ]


def test_1f1b_p2_m2_by_hand():
    assert generate("1f1b", 2, 2, 2) == [
        [
            F(0, 0, 0, 0), F(0, 1, 0, 0), B(0, 0, 0, 0), B(0, 1, 0, 0), STEP(0, 0, 1),
            F(0, 2, 1, 1), F(0, 3, 1, 1), B(0, 2, 1, 1), B(0, 3, 1, 1), STEP(0, 1, 2),
        ],
        [
            F(1, 0, 0, 0), B(1, 0, 0, 0), F(1, 1, 0, 0), B(1, 1, 0, 0), STEP(1, 0, 1),
            F(1, 2, 1, 1), B(1, 2, 1, 1), F(1, 3, 1, 1), B(1, 3, 1, 1), STEP(1, 1, 2),
        ],
    ]  # fmt: skip


def test_2bw_p2_m2_by_hand():
    # Minibatch t (microbatches 2t, 2t+1) computes with version max(t-1, 0); stage 0's forward
    # of microbatch 4 (minibatch 2, version 1) comes right after the STEP that made version 1.
    assert generate("2bw", 2, 2, 3) == [
        [
            F(0, 0, 0, 0),
            F(0, 1, 0, 0), B(0, 0, 0, 0),
            F(0, 2, 0, 1), B(0, 1, 0, 0), STEP(0, 0, 1),
            F(0, 3, 0, 1), B(0, 2, 0, 1),
            F(0, 4, 1, 2), B(0, 3, 0, 1), STEP(0, 1, 2),
            F(0, 5, 1, 2), B(0, 4, 1, 2),
            B(0, 5, 1, 2), STEP(0, 2, 3),
        ],
        [
            F(1, 0, 0, 0), B(1, 0, 0, 0), F(1, 1, 0, 0), B(1, 1, 0, 0), STEP(1, 0, 1),
            F(1, 2, 0, 1), B(1, 2, 0, 1), F(1, 3, 0, 1), B(1, 3, 0, 1), STEP(1, 1, 2),
            F(1, 4, 1, 2), B(1, 4, 1, 2), F(1, 5, 1, 2), B(1, 5, 1, 2), STEP(1, 2, 3),
        ],
    ]  # fmt: skip


def test_pipedream_p2_by_hand():
    # A STEP after every backward; a forward uses the newest version, its backward the stash.
    assert generate("pipedream", 2, 1, 3) == [
        [
            F(0, 0, 0, 0),
            F(0, 1, 0, 1), B(0, 0, 0, 0), STEP(0, 0, 1),
            F(0, 2, 1, 2), B(0, 1, 0, 1), STEP(0, 1, 2),
            B(0, 2, 1, 2), STEP(0, 2, 3),
        ],
        [
            F(1, 0, 0, 0), B(1, 0, 0, 0), STEP(1, 0, 1),
            F(1, 1, 1, 1), B(1, 1, 1, 1), STEP(1, 1, 2),
            F(1, 2, 2, 2), B(1, 2, 2, 2), STEP(1, 2, 3),
        ],
    ]  # fmt: skip


def test_pipedream_runs_m_times_steps_updates():
    actions = generate("pipedream", 3, 4, 2)
    for stage in actions:
        steps = [a for a in stage if a.kind is K.STEP]
        assert [a.version for a in steps] == list(range(1, 9))
        assert [a.step for a in steps] == list(range(8))


def test_one_stage_is_plain_training():
    assert generate("1f1b", 1, 2, 1) == [
        [F(0, 0, 0, 0), B(0, 0, 0, 0), F(0, 1, 0, 0), B(0, 1, 0, 0), STEP(0, 0, 1)]
    ]


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("1f1b", 0, 2, 1), "stages must be at least 1, got 0"),
        (("1f1b", 2, 0, 1), "microbatches must be at least 1, got 0"),
        (("gpipe", 2, 2, 0), "steps must be at least 1, got 0"),
        (("2bw", 4, 3, 1), "2bw needs microbatches >= stages (got M=3, P=4)"),
        (("2BW", 4, 8, 1), "unknown schedule '2BW'"),
    ],
)
def test_generate_errors(args, message):
    with pytest.raises(ScheduleError) as info:
        generate(*args)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_errors_explain_themselves():
    with pytest.raises(ScheduleError, match="use 4 or more microbatches") as info:
        generate("2bw", 4, 2, 1)
    assert "weight version" in str(info.value)
    with pytest.raises(ScheduleError, match="gpipe, 1f1b, 2bw, pipedream"):
        generate("zero-bubble", 2, 2, 1)
    with pytest.raises(ScheduleError, match="did you mean 'gpipe'"):
        generate("gpip", 2, 2, 1)


def test_simulate_errors():
    lowered = lower(generate("gpipe", 2, 2, 1))
    with pytest.raises(ScheduleError, match="fwd lists 3 times but the schedule has 2 stages"):
        simulate(lowered, fwd=[1, 1, 1])
    with pytest.raises(ScheduleError, match="bwd times must be positive"):
        simulate(lowered, bwd=0)
    with pytest.raises(ScheduleError, match="comm latency must be >= 0"):
        simulate(lowered, comm=-1)
    for bad in (math.nan, math.inf):  # a time must be a finite number
        with pytest.raises(ScheduleError, match="fwd times must be positive and finite"):
            simulate(lowered, fwd=[1, bad])
        with pytest.raises(ScheduleError, match="comm latency must be >= 0 and finite"):
            simulate(lowered, comm=bad)
    with pytest.raises(ScheduleError, match="already lowered"):
        lower(lowered)


# --- lowering --------------------------------------------------------------------------------


def test_lowering_1f1b_p2_m2_by_hand():
    lowered = lower(generate("1f1b", 2, 2, 1))
    assert [[(str(a.kind), a.microbatch, a.peer) for a in stage] for stage in lowered] == [
        [
            ("F", 0, None), ("SEND_ACT", 0, 1), ("F", 1, None), ("SEND_ACT", 1, 1),
            ("RECV_GRAD", 0, 1), ("B", 0, None), ("RECV_GRAD", 1, 1), ("B", 1, None),
            ("STEP", None, None),
        ],
        [
            ("RECV_ACT", 0, 0), ("F", 0, None), ("B", 0, None), ("SEND_GRAD", 0, 0),
            ("RECV_ACT", 1, 0), ("F", 1, None), ("B", 1, None), ("SEND_GRAD", 1, 0),
            ("STEP", None, None),
        ],
    ]  # fmt: skip
    # communication actions carry the version and step of the compute they belong to
    assert lowered[1][0] == Action(K.RECV_ACT, 1, 0, 0, 0, peer=0)


def test_is_lowered():
    assert not is_lowered(generate("1f1b", 2, 2, 1))
    assert is_lowered(lower(generate("1f1b", 2, 2, 1)))
    assert is_lowered(generate("1f1b", 1, 2, 1))  # one stage: nothing to communicate


# --- simulator: exact timings ----------------------------------------------------------------


def test_1f1b_p2_m2_timeline_by_hand():
    result = run("1f1b", 2, 2, 1)
    compute = [
        [(str(t.action.kind), t.action.microbatch, t.start, t.end) for t in stage]
        for stage in result.timeline
    ]
    compute = [[c for c in stage if c[0] in ("F", "B")] for stage in compute]
    assert compute == [
        [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 4, 6), ("B", 1, 7, 9)],
        [("F", 0, 1, 2), ("B", 0, 2, 4), ("F", 1, 4, 5), ("B", 1, 5, 7)],
    ]
    assert result.makespan == 9
    assert result.busy == [6, 6]
    assert result.idle == [3, 3]


def test_gpipe_makespan_p4_m8():
    p, m, f, b = 4, 8, 1.0, 2.0
    assert run("gpipe", p, m, 1).makespan == (m + p - 1) * (f + b) == 33
    assert run("gpipe", p, m, 3).makespan == 3 * 33  # a flush before every step


def test_comm_latency_and_per_stage_times():
    # F0 at stage 0, message, F0 at stage 1, B0 at stage 1, message, B0 at stage 0
    assert run("gpipe", 2, 1, 1, comm=0.5).makespan == 1 + 0.5 + 1 + 2 + 0.5 + 2
    result = run("gpipe", 2, 1, 1, fwd=[1, 2], bwd=[2, 4])
    assert result.makespan == 1 + 2 + 4 + 2
    assert result.busy == [3, 6]
    assert result.bubble_fraction == pytest.approx([6 / 9, 3 / 9])


def test_summary_figures():
    result = run("2bw", 4, 8, 3)
    summary = result.summary()
    assert summary["makespan"] == 81
    assert summary["microbatches_total"] == 24
    assert summary["throughput"] == pytest.approx(24 / 81)
    assert summary["bubble_fraction"]["overall"] == pytest.approx(3 / 27)
    assert summary["bubble_fraction"]["per_stage"] == pytest.approx([3 / 27] * 4)
    assert summary["peak_activations"] == [4, 3, 2, 1]
    assert summary["weight_versions"] == [2, 2, 2, 2]


# --- analytic bubbles and memory -------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 1), (2, 4), (4, 4), (4, 8), (4, 16), (8, 3)])
def test_sync_bubble_is_analytic(schedule, p, m):
    for steps in (1, 3):
        result = run(schedule, p, m, steps)
        expected = (p - 1) / (m + p - 1)
        assert result.bubble_fraction_overall == pytest.approx(expected)
        assert result.bubble_fraction == pytest.approx([expected] * p)
        assert result.makespan == steps * (m + p - 1) * 3


@pytest.mark.parametrize("schedule", ["2bw", "pipedream"])
def test_async_bubble_is_paid_once_per_run(schedule):
    p, m = 4, 4
    bubbles = [run(schedule, p, m, steps).bubble_fraction_overall for steps in (1, 2, 4, 8, 32)]
    assert bubbles == pytest.approx([(p - 1) / (m * s + p - 1) for s in (1, 2, 4, 8, 32)])
    assert bubbles == sorted(bubbles, reverse=True)
    assert bubbles[-1] < 0.025


def test_2bw_beats_1f1b_from_the_second_step():
    assert run("2bw", 4, 8, 1).makespan == run("1f1b", 4, 8, 1).makespan
    assert run("2bw", 4, 8, 2).makespan < run("1f1b", 4, 8, 2).makespan


@pytest.mark.parametrize(
    ("schedule", "activations", "versions"),
    [
        ("gpipe", [8, 8, 8, 8], [1, 1, 1, 1]),
        ("1f1b", [4, 3, 2, 1], [1, 1, 1, 1]),
        ("2bw", [4, 3, 2, 1], [2, 2, 2, 2]),
        ("pipedream", [4, 3, 2, 1], [4, 3, 2, 1]),
    ],
)
def test_memory(schedule, activations, versions):
    result = run(schedule, 4, 8, 3)
    assert result.peak_activations == activations
    assert result.weight_versions == versions


def test_version_last_uses():
    # 2bw stage 1: v0 is used until minibatch 1's last backward, v1 until the STEP that
    # updates it, v2 (minibatch 2's weights) until that minibatch's last backward
    stage = generate("2bw", 2, 2, 3)[1]
    last = version_last_uses(stage)  # keyed by (stage, version): a rank may run several stages
    assert stage[last[1, 0]] == B(1, 3, 0, 1)
    assert stage[last[1, 1]] == B(1, 5, 1, 2)
    assert stage[last[1, 2]] == STEP(1, 2, 3)


# --- invariants over a property-based grid ---------------------------------------------------

shapes = st.tuples(
    st.sampled_from(SCHEDULE_NAMES),
    st.integers(1, 8),  # P
    st.integers(1, 10),  # M
    st.integers(1, 4),  # steps
).filter(lambda x: schedule_spec(x[0]).microbatch_problem(x[1], x[2]) is None)


@settings(max_examples=150, deadline=None)
@given(shapes)
def test_invariants_hold(shape):
    schedule, p, m, steps = shape
    actions = generate(schedule, p, m, steps)
    assert check_invariants(actions, schedule) == []
    n = m * steps
    chunks = schedule_spec(schedule).default_chunks
    layout = ParallelLayout(p, chunks=chunks, placement=schedule_spec(schedule).placement)
    for s in range(p * chunks):
        # interleaved: stage c·P + r on rank r; the V: stages r and 2P-1-r
        assert stage_ranks(actions)[s] == layout.rank_of(s)
        forwards = {  # an F, or an overlapped F&B's forward half (dualpipev)
            f.microbatch: f
            for rank in actions
            for a in rank
            for f in a.parts
            if f.kind is K.F and f.stage == s
        }
        assert sorted(forwards) == list(range(n))
        for k, a in forwards.items():
            if schedule == "pipedream":  # stage s lags P-1-s versions behind (clamped at 0)
                assert (a.version, a.step) == (max(k - (p - 1 - s), 0), k)
            elif schedule == "2bw":  # one version old, the same at every stage
                assert (a.version, a.step) == (max(k // m - 1, 0), k // m)
            else:
                assert (a.version, a.step) == (k // m, k // m)


@settings(max_examples=60, deadline=None)
@given(
    shapes,
    st.lists(st.sampled_from([0.5, 1.0, 1.5, 3.0]), min_size=16, max_size=16),
    st.lists(st.sampled_from([1.0, 2.0, 2.5, 4.0]), min_size=16, max_size=16),
    st.sampled_from([0.0, 0.25, 1.0]),
)
def test_simulation_respects_dependencies(shape, fwd, bwd, comm):
    schedule, p, m, steps = shape
    stages = p * schedule_spec(schedule).default_chunks
    result = simulate(lower(generate(schedule, p, m, steps)), fwd[:stages], bwd[:stages], comm)
    assert result.violations == []
    sends = {
        (t.action.kind, t.action.stage, t.action.microbatch): t.end
        for stage in result.timeline
        for t in stage
        if t.action.kind in (K.SEND_ACT, K.SEND_GRAD)
    }
    for stage in result.timeline:
        for before, after in itertools.pairwise(stage):
            assert before.end <= after.start  # one action at a time per stage
        for t in stage:
            a = t.action
            if a.kind in (K.RECV_ACT, K.RECV_GRAD):
                send_kind = K.SEND_ACT if a.kind is K.RECV_ACT else K.SEND_GRAD
                assert t.start >= sends[(send_kind, a.peer, a.microbatch)] + comm
    assert result.makespan >= max(result.busy)
    assert 0 <= result.bubble_fraction_overall < 1


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(0, 6), st.integers(1, 5))
def test_2bw_is_one_version_old_for_every_m_at_least_p(p, extra, steps):
    m = p + extra
    actions = generate("2bw", p, m, steps)
    assert check_invariants(actions, "2bw") == []
    for stage in actions:
        for i, a in enumerate(stage):
            if a.kind is K.STEP:  # the backward right before it belongs to the same step
                assert stage[i - 1].kind is K.B and stage[i - 1].step == a.step
                assert stage[i - 1].version == max(a.version - 2, 0)


# --- violations and deadlocks on hand-broken schedules ---------------------------------------


def test_deadlock_names_the_stuck_actions():
    lowered = lower(generate("1f1b", 2, 1, 1))
    stage0 = lowered[0]  # F0, SEND_ACT0, RECV_GRAD0, B0, STEP
    assert [a.kind for a in stage0] == [K.F, K.SEND_ACT, K.RECV_GRAD, K.B, K.STEP]
    lowered[0] = [stage0[0], stage0[2], stage0[1], *stage0[3:]]  # wait for the gradient first
    with pytest.raises(DeadlockError) as info:
        simulate(lowered)
    assert info.value.stuck == [
        Action(K.RECV_GRAD, 0, 0, 0, 0, peer=1),
        Action(K.RECV_ACT, 1, 0, 0, 0, peer=0),
    ]
    assert "stage 0 waits at RECV_GRAD0v0@s0<-s1" in str(info.value)
    assert "stage 1 waits at RECV_ACT0v0@s1<-s0" in str(info.value)
    problems = check_invariants(lowered, "1f1b")
    assert len(problems) == 1 and problems[0].startswith("deadlock:")


def test_missing_send_is_a_deadlock():
    lowered = lower(generate("gpipe", 3, 2, 1))
    lowered[1] = [a for a in lowered[1] if not (a.kind is K.SEND_ACT and a.microbatch == 1)]
    with pytest.raises(DeadlockError) as info:
        simulate(lowered)
    # stage 2 waits for the activation that never comes, stages 0 and 1 for gradients
    assert info.value.stuck == [
        Action(K.RECV_GRAD, 0, 0, 0, 0, peer=1),
        Action(K.RECV_GRAD, 1, 0, 0, 0, peer=2),
        Action(K.RECV_ACT, 2, 1, 0, 0, peer=1),
    ]


def test_messages_received_out_of_send_order_are_reported():
    # gloo's tags would pair them; NCCL pairs the n-th send with the n-th receive
    lowered = lower(generate("gpipe", 2, 2, 1))
    stage1 = lowered[1]  # RECV_ACT0, F0, RECV_ACT1, F1, then the backwards
    assert [a.kind for a in stage1[:4]] == [K.RECV_ACT, K.F, K.RECV_ACT, K.F]
    lowered[1] = [*stage1[2:4], *stage1[0:2], *stage1[4:]]  # forwards of microbatch 1 first
    simulate(lowered)  # runs: tags pair the messages
    assert check_invariants(lowered, "gpipe") == [
        "stage 0 sends its act messages to stage 1 for microbatches [0, 1], stage 1 receives "
        "them as [1, 0]: a transport without tags (NCCL) would pair them wrongly"
    ]


def test_wrong_delay_is_reported():
    # 1F1B's actions claimed as 2bw: the gradients are fresh, not one version old
    problems = check_invariants(generate("1f1b", 2, 2, 2), "2bw")
    assert "STEP1->v2@s0 updates v1 with gradients from v1; expected v0 (a delay of 1)" in problems
    # PipeDream's stashes break 2bw's two-version budget at stage 0 of a 4-stage pipeline
    problems = check_invariants(generate("pipedream", 4, 1, 6), "2bw")
    assert "stage 0 holds 4 weight versions; 2bw allows 2" in problems
    assert "stage 1 holds 3 weight versions; 2bw allows 2" in problems
    assert check_invariants(generate("pipedream", 4, 1, 6), "pipedream") == []


def test_invariants_find_the_same_in_a_simulation_already_run_with_other_timings():
    actions = generate("pipedream", 4, 1, 6)
    timed = simulate(lower(actions), fwd=[1, 3, 2, 1], bwd=5.0, comm=0.5)
    assert check_invariants(actions, "2bw", timed) == check_invariants(actions, "2bw") != []


def test_backward_with_another_version_than_its_forward():
    actions = generate("1f1b", 2, 2, 2)
    i = actions[1].index(B(1, 2, 1, 1))
    actions[1][i] = B(1, 2, 0, 1)
    problems = check_invariants(actions, "1f1b")
    assert "B2v0@s1 uses v0 but its forward used v1" in problems
    assert "STEP1->v2@s1 updates v1 with gradients from v0, v1; expected v1 (a delay of 0)" in (
        problems
    )


def test_forward_before_its_version_exists():
    actions = generate("1f1b", 2, 2, 2)
    stage0 = actions[0]
    step = stage0.index(STEP(0, 0, 1))
    # move minibatch 1's first forward (version 1) ahead of the STEP that produces version 1
    forward = stage0.pop(step + 1)
    stage0.insert(step, forward)
    problems = check_invariants(actions, "1f1b")
    assert "F2v1@s0 needs weight version 1, not produced yet at this stage" in problems


def test_structural_violations():
    actions = generate("gpipe", 2, 2, 1)
    actions[1] = [a for a in actions[1] if a != B(1, 1, 0, 0)]
    problems = check_invariants(actions, "gpipe")
    assert problems == [
        "stage 1 never runs B of microbatches [1]",
        "deadlock: stage 0 waits at RECV_GRAD1v0@s0<-s1",  # the gradient B1 would have sent
    ]

    actions = generate("gpipe", 1, 2, 1)
    actions[0].append(F(0, 0, 1, 0))
    problems = check_invariants(actions, "gpipe")
    assert "F0v1@s0 runs a second time" in problems

    lowered = lower(generate("gpipe", 2, 1, 1))
    lowered[0] = [lowered[0][1], lowered[0][0], *lowered[0][2:]]  # SEND_ACT before its F
    assert "SEND_ACT0v0@s0->s1 sends before F0 ran" in simulate(lowered).violations


def test_misplaced_actions_are_rejected():
    lowered = lower(generate("gpipe", 2, 1, 1))
    lowered[0][1] = dataclasses.replace(lowered[0][1], peer=0)
    with pytest.raises(ScheduleError, match="needs a peer stage on another rank"):
        simulate(lowered)
    lowered = lower(generate("gpipe", 2, 1, 1))
    lowered[0].append(F(1, 5, 0, 0))
    with pytest.raises(ScheduleError, match="stage 1 has actions on ranks 0 and 1"):
        simulate(lowered)
