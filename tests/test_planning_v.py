"""nobubble plan's rows for the V schedules (zb-v, dualpipev): the step is the simulator's on
the same per-action costs, the turn of the V costs no message, memory holds two stages'
parameters and the activations the simulator holds, the rule on M, and the bubble against the
published formula."""

import dataclasses

import pytest

from nobubble.config.parallel import ParallelSettings
from nobubble.model.presets import ModelConfig
from nobubble.planning.costs import BYTES_GRADIENT, BYTES_OPTIMIZER_STATE, stage_costs
from nobubble.planning.estimate import ClusterPlan, estimate, shape_problem
from nobubble.planning.hardware import DEVICES, LINKS
from nobubble.schedules import ActionKind, generate, lower, simulate

V_SCHEDULES = ("zb-v", "dualpipev")
SHAPE = ModelConfig(d_model=64, n_layers=8, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64,
                    vocab_size=100)  # fmt: skip


def v_plan(stages: int = 4, microbatches: int = 8, **parallel: int) -> ClusterPlan:
    """Eight blocks on 2P model stages, messages on InfiniBand (latency and bandwidth count)."""
    return ClusterPlan(
        model=SHAPE,
        parallel=ParallelSettings(stages=stages, microbatches=microbatches, **parallel),
        microbatch_size=2, seq_len=32, device=DEVICES["h100"], mfu=0.5,
        p2p=LINKS["ib-ndr"], allreduce=LINKS["ib-ndr"],
    )  # fmt: skip


def simulated(plan: ClusterPlan, schedule: str, steps: int, comm: float | None = None):
    """``steps`` steps of ``schedule`` on the 2P model stages' per-action costs, computed here
    from the stage costs as the cost model states them."""
    p = plan.parallel
    costs = stage_costs(plan.model, 2 * p.stages, plan.seq_len, plan.microbatch_size)
    flops_per_s = plan.device.peak_tflops * 1e12 * plan.mfu
    fwd = [c.forward_flops / flops_per_s for c in costs]
    if comm is None:
        comm = plan.p2p.latency_us * 1e-6 + costs[0].message_bytes / (plan.p2p.gb_per_s * 1e9)
    return simulate(
        lower(generate(schedule, p.stages, p.microbatches, steps)),
        fwd=fwd,
        bwd=[2 * f for f in fwd],
        wgrad=[c.weight_flops / flops_per_s for c in costs],
        comm=comm,
        activation_sizes=[c.activation_bytes for c in costs],
    )


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_the_step_is_the_simulators_on_the_same_costs(schedule):
    """The planner's step of a V schedule (dp = 1: nothing exposed) is the steady step of the
    simulator run on the same per-action costs: three steps' makespan minus two's."""
    plan = v_plan()
    step = simulated(plan, schedule, 3).makespan - simulated(plan, schedule, 2).makespan
    predicted = estimate(plan, schedule)
    assert predicted.step_s == pytest.approx(step, rel=1e-12)
    assert predicted.exposed_dp_s == 0.0
    free = simulated(plan, schedule, 3, comm=0.0).makespan
    assert free < simulated(plan, schedule, 3).makespan  # the messages between ranks count


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_the_turn_of_the_v_is_not_a_message(schedule):
    """Stages P-1 and P share rank P-1: no SEND or RECV between them; every other edge has
    its messages (one activation and one gradient a microbatch each way)."""
    p, m = 4, 8
    lowered = lower(generate(schedule, p, m, 1))
    edges: dict[tuple[int, int], int] = {}
    for rank in lowered:
        for a in rank:
            if a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
                edge = (min(a.stage, a.peer), max(a.stage, a.peer))
                edges[edge] = edges.get(edge, 0) + 1
    assert (p - 1, p) not in edges
    assert edges == {(s, s + 1): 2 * m for s in range(2 * p - 1) if s != p - 1}


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_a_rank_holds_two_stages_and_the_activations_the_simulator_holds(schedule):
    """Rank r: stages r and 2P-1-r (rank 0 the embedding and the head), each parameter once
    at 18 bytes (one BF16 version, FP32 gradient, 12 of state), and the peak of its held
    forwards, each at its own stage's activation size, from the simulated action list."""
    plan = v_plan()
    p = plan.parallel.stages
    costs = stage_costs(SHAPE, 2 * p, plan.seq_len, plan.microbatch_size)
    assert costs[0].embedding and costs[2 * p - 1].head
    sim = simulated(plan, schedule, 3)
    predicted = estimate(plan, schedule)
    per_parameter = 2 + BYTES_GRADIENT + BYTES_OPTIMIZER_STATE
    for r in range(p):
        weights = (costs[r].parameters + costs[2 * p - 1 - r].parameters) * per_parameter
        assert predicted.memory_gb[r] == pytest.approx(
            (weights + sim.peak_activation_size[r]) / 1e9, rel=1e-12
        )
        # the weighted peak lies between the rank's forwards at its smaller and larger stage
        sizes = (costs[r].activation_bytes, costs[2 * p - 1 - r].activation_bytes)
        held = sim.peak_activations[r]
        assert min(sizes) * held <= sim.peak_activation_size[r] <= max(sizes) * held


def test_the_weighted_peak_with_unit_sizes_is_the_count_of_forwards_held():
    for schedule in (*V_SCHEDULES, "interleaved-1f1b", "1f1b"):
        result = simulate(lower(generate(schedule, 3, 6, 2)))
        assert result.peak_activation_size == [float(n) for n in result.peak_activations]


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize(("f", "w"), [(1.0, 1.0), (1.0, 0.5), (2.0, 0.3)])
def test_dualpipevs_idle_is_the_published_formula(p, f, w):
    """Per model stage F, W <= F and I = F (B = F + W, DeepSeek's assumption), no message
    time: every rank of DualPipeV idles (P-1)(F&B + B - 3W) a step (F&B = F + B: the halves'
    compute is not overlapped, see docs/schedules.md)."""
    b = f + w
    dual = simulate(lower(generate("dualpipev", p, 2 * p, 1)), fwd=f, bwd=b, wgrad=w)
    assert dual.idle == pytest.approx([(p - 1) * ((f + b) + b - 3 * w)] * p)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_vs_fill_is_paid_once_at_f_equal_i_equal_w(p):
    """F = I = W = 1: a step of ZB-V idles (P-1)·F on every rank, and each further step adds
    exactly its compute (2 stages x M x (F + B)): the planner's steady step has no bubble."""
    m = 2 * p
    steps = [
        simulate(lower(generate("zb-v", p, m, n)), fwd=1.0, bwd=2.0, wgrad=1.0) for n in (1, 2, 3)
    ]
    assert steps[0].idle == pytest.approx([p - 1.0] * p)
    assert steps[2].makespan - steps[1].makespan == pytest.approx(2 * m * 3.0)


def test_dualpipev_below_2p_microbatches_is_not_predicted_and_zb_v_is():
    plan = v_plan(stages=4, microbatches=6)
    assert "dualpipev needs microbatches >= 2 x stages" in shape_problem(plan, "dualpipev")
    assert shape_problem(plan, "zb-v") is None
    assert shape_problem(v_plan(stages=4, microbatches=8), "dualpipev") is None
    deep = dataclasses.replace(plan, model=dataclasses.replace(SHAPE, n_layers=6))
    assert shape_problem(deep, "zb-v") == "6 blocks cannot fill 8 stages"  # 2P model stages


def test_chunks_are_interleaved_1f1bs_and_a_v_schedule_keeps_its_two():
    """--chunks 4 picks interleaved-1f1b's stages per rank; zb-v still runs 2 (the V)."""
    four = v_plan(stages=2, microbatches=4, chunks=4)
    assert shape_problem(four, "zb-v") is None
    assert estimate(four, "zb-v") == estimate(v_plan(stages=2, microbatches=4), "zb-v")
    assert estimate(four, "interleaved-1f1b") != estimate(
        v_plan(stages=2, microbatches=4), "interleaved-1f1b"
    )
