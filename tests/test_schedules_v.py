"""The V placement (rank r holds model stages r and 2P-1-r) and its two schedules, ZB-V and
DualPipeV: hand-drawn action lists, torch's orders as a facts check, the invariants over a grid,
the bubble their papers give, the pictures, and the one-process engine's run of them (the
pipeline runtime's: tests/test_pipeline_parity.py, tests/test_emulated_nccl.py)."""

import dataclasses
import itertools
import json

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from nobubble.cli import main
from nobubble.config import ConfigError, TrainConfig
from nobubble.configure import build_config, resolve_config
from nobubble.layout import ParallelLayout, V
from nobubble.one_process import OneProcessEngine
from nobubble.run.torchrun import check_model, launch_layout
from nobubble.schedules import (
    Action,
    ActionKind,
    ScheduleError,
    check_invariants,
    generate,
    lower,
    rank_actions,
    simulate,
    until_step,
)
from nobubble.schedules.invariants import _edge_order
from nobubble.schedules.ir import stage_ranks
from nobubble.schedules.registry import PIPELINE_SCHEDULES, schedule_spec

K = ActionKind
F, B, I, W = K.F, K.B, K.I, K.W  # noqa: E741


def a(kind: ActionKind, k: int, s: int) -> Action:
    """``kind`` of microbatch ``k`` at stage ``s``, in step 0 at version 0."""
    return Action(kind, s, k, 0, 0)


def fb(k: int, s: int, back_k: int, back_s: int) -> Action:
    """An overlapped forward of ``k`` at ``s`` and backward of ``back_k`` at ``back_s``."""
    return Action(K.FB, s, k, 0, 0, paired=a(B, back_k, back_s))


def step(s: int) -> Action:
    return Action(K.STEP, s, None, 1, 0)


def times(p: int, f: float, b: float, w: float) -> dict[str, list[float]]:
    """One model stage's (a chunk's) forward, whole backward and weight-gradient times."""
    return {"fwd": [f] * 2 * p, "bwd": [b] * 2 * p, "wgrad": [w] * 2 * p}


# --- the placement ---------------------------------------------------------------------------


def test_the_v_places_stages_r_and_2p_minus_1_minus_r():
    layout = ParallelLayout(3, chunks=2, placement=V)
    assert [layout.stages_of(r) for r in range(3)] == [(0, 5), (1, 4), (2, 3)]
    assert [layout.rank_of(s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [layout.chunk_of(s) for s in range(6)] == [0, 0, 0, 1, 1, 1]
    first, bottom = ParallelLayout(3, rank=0, chunks=2, placement=V), layout.stages_of(2)
    assert first.is_first_stage and first.is_last_stage  # embedding and head on one rank
    assert not ParallelLayout(3, rank=2, chunks=2, placement=V).is_last_stage
    assert layout.rank_of(bottom[0]) == layout.rank_of(bottom[1])  # the turn is local
    assert layout.same_process(2, 3) and layout.same_process(0, 5)
    assert not layout.same_process(1, 2) and not layout.same_process(3, 4)
    assert first.holds(0) and first.holds(5) and not first.holds(1)
    # with dp the replicas stay innermost
    assert ParallelLayout(2, dp=2, rank=1, chunks=2, placement=V).rank_of(3) == 1
    with pytest.raises(ValueError, match="exactly 2 model stages on each pipeline position"):
        ParallelLayout(2, chunks=3, placement=V)
    with pytest.raises(ValueError, match="unknown placement 'w'"):
        ParallelLayout(2, chunks=2, placement="w")


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_the_generators_place_stages_where_the_layout_does(name, p):
    placed = stage_ranks(generate(name, p, 2 * p, 1))
    layout = ParallelLayout(p, chunks=2, placement=V)
    assert placed == {stage: layout.rank_of(stage) for stage in range(2 * p)}


def test_a_schedule_on_another_placement_is_caught():
    """interleaved-1f1b's lists put stage 2 on rank 0; the V puts it on rank 1."""
    problems = check_invariants(generate("interleaved-1f1b", 2, 4, 1), "zb-v")
    assert "stage 2 runs on rank 0; the v placement puts it on rank 1" in problems


def test_the_bottom_of_the_v_hands_over_in_memory_and_other_edges_keep_their_order():
    """Stage P-1 to P sits on rank P-1: no message either way; every other edge's messages
    are received in the order they are sent, and a swap on a V edge is caught."""
    p = 3
    lowered = lower(generate("zb-v", p, 6, 2))
    edges = {(x.stage, x.peer) for rank in lowered for x in rank if x.kind.is_comm}
    assert (p - 1, p) not in edges and (p, p - 1) not in edges
    assert edges == {(s, s + 1) for s in range(2 * p - 1) if s != p - 1} | {
        (s + 1, s) for s in range(2 * p - 1) if s != p - 1
    }
    assert _edge_order(lowered) == []
    rank = lowered[0]  # rank 0 receives stage 5's activations from stage 4 (rank 1)
    first, second = [i for i, x in enumerate(rank) if x.kind is K.RECV_ACT and x.stage == 5][:2]
    rank[first], rank[second] = rank[second], rank[first]
    assert any("stage 4 sends its act messages to stage 5" in x for x in _edge_order(lowered))


# --- hand-drawn small cases (P = 2, M = 4; stages 0 and 3 on rank 0, 1 and 2 on rank 1) -----


def test_zb_v_p2_m4_by_hand():
    """ZB-V rank r: 2(P-r)-1 forwards of stage r, r pairs (F of 2P-1-r, F of r), P-r times F, I,
    W of 2P-1-r; then F, I, W of r and of 2P-1-r while forwards remain; then r pairs of I's, P-r
    times I and the oldest W of stage r, and the W's left (stage 2P-1-r's first)."""
    assert generate("zb-v", 2, 4, 1) == [
        [a(F, 0, 0), a(F, 1, 0), a(F, 2, 0),                            # warm-up: 3 of stage 0
         a(F, 0, 3), a(I, 0, 3), a(W, 0, 3), a(F, 1, 3), a(I, 1, 3), a(W, 1, 3),  # 2 at the top
         a(F, 3, 0), a(I, 0, 0), a(W, 0, 0), a(F, 2, 3), a(I, 2, 3), a(W, 2, 3),  # steady
         a(I, 1, 0), a(W, 1, 0), a(F, 3, 3), a(I, 3, 3), a(W, 3, 3), step(3),     # no F left
         a(I, 2, 0), a(W, 2, 0), a(I, 3, 0), a(W, 3, 0), step(0)],                # cool-down
        [a(F, 0, 1),                                                    # warm-up: 1 of stage 1
         a(F, 0, 2), a(F, 1, 1),                                        # 1 pair
         a(F, 1, 2), a(I, 0, 2), a(W, 0, 2),                            # 1 at the turn
         a(F, 2, 1), a(I, 0, 1), a(W, 0, 1), a(F, 2, 2), a(I, 1, 2), a(W, 1, 2),  # steady
         a(F, 3, 1), a(I, 1, 1), a(W, 1, 1), a(F, 3, 2), a(I, 2, 2), a(W, 2, 2),
         a(I, 2, 1), a(I, 3, 2),                                        # 1 pair of I's
         a(I, 3, 1), a(W, 2, 1),                                        # I and the oldest W
         a(W, 3, 2), step(2), a(W, 3, 1), step(1)],                     # the W's left
    ]  # fmt: skip


def test_dualpipev_p2_m4_by_hand():
    """DualPipeV rank r, stages a = r and b = 2P-1-r: 2(P-1-r) F a; r+1 pairs F a, F b; P-1-r
    times I b, W, F b; M-2P+r+1 times F a & B b, F b & B a (the bottom rank's first pair
    apart); P-1-r times B b, F b & B a; r+1 pairs of backwards of b and a (I's from half way,
    the odd ranks one action earlier); P-1-r times W, backward of a; the W's left."""
    assert generate("dualpipev", 2, 4, 1) == [
        [a(F, 0, 0), a(F, 1, 0),                                        # (1) 2 F of stage 0
         a(F, 2, 0), a(F, 0, 3),                                        # (2) 1 pair
         a(I, 0, 3), a(W, 0, 3), a(F, 1, 3),                            # (3) zero bubble once
         fb(3, 0, 1, 3), fb(2, 3, 0, 0),                                # (4) M-2P+1 = 1 round
         a(B, 2, 3), fb(3, 3, 1, 0),                                    # (5) once
         a(B, 3, 3), step(3), a(I, 2, 0),                               # (6) 1 pair, I half way
         a(W, 2, 0), a(I, 3, 0),                                        # (7) once
         a(W, 3, 0), step(0)],                                          # (8) the W left
        [a(F, 0, 1), a(F, 0, 2), a(F, 1, 1), a(F, 1, 2),                # (2) 2 pairs
         a(F, 2, 1), a(B, 0, 2), fb(2, 2, 0, 1),                        # (4) first pair apart
         fb(3, 1, 1, 2), fb(3, 2, 1, 1),                                # (4) second round
         a(B, 2, 2), a(B, 2, 1), a(I, 3, 2), a(I, 3, 1),                # (6) odd rank: I's sooner
         a(W, 3, 2), step(2), a(W, 3, 1), step(1)],                     # (8)
    ]  # fmt: skip


def _torch_order(schedule: type, p: int, m: int) -> list[list[tuple]]:
    """torch's per-rank order (its planning step only, no process group), in our terms."""
    planner = schedule.__new__(schedule)
    planner.pp_group_size, planner._n_microbatches = p, m
    planner.num_stages = planner._num_stages = 2 * p
    names = {"FORWARD": F, "FULL_BACKWARD": B, "BACKWARD_INPUT": I, "BACKWARD_WEIGHT": W}
    ranks = []
    for rank in range(p):
        order = []
        for action in filter(None, planner._calculate_single_rank_operations(rank)):
            parts = action.sub_actions or (action,)
            order.append(
                tuple(
                    (names[x.computation_type.name], x.stage_index, x.microbatch_index)
                    for x in parts
                )
            )
        ranks.append(order)
    return ranks


def _our_order(name: str, p: int, m: int) -> list[list[tuple]]:
    return [
        [tuple((x.kind, x.stage, x.microbatch) for x in y.parts) for y in rank if y.kind.is_compute]
        for rank in generate(name, p, m, 1)
    ]


@pytest.mark.parametrize(("p", "m"), [(1, 2), (2, 3), (2, 4), (3, 6), (3, 7), (4, 8), (4, 13)])
def test_the_orders_are_torchs(p, m):
    """A facts check against torch 2.13's ScheduleZBVZeroBubble and ScheduleDualPipeV (the
    published orders): every rank's F/B/I/W sequence and F&B pairs are the same, so a bench
    against torch's runs one order."""
    assert _our_order("zb-v", p, m) == _torch_order(torch_schedules.ScheduleZBVZeroBubble, p, m)
    if m >= 2 * p:
        expected = _torch_order(torch_schedules.ScheduleDualPipeV, p, m)
        assert _our_order("dualpipev", p, m) == expected


# --- the invariants, the bubble, the memory --------------------------------------------------


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_the_invariants_hold_over_a_grid(name):
    spec = schedule_spec(name)
    for p, m, steps in itertools.product(range(1, 6), range(1, 13), (1, 3)):
        if spec.microbatch_problem(p, m):
            continue
        actions = generate(name, p, m, steps)
        result = simulate(lower(actions), **times(p, 1.0, 2.5, 1.0), comm=0.3)
        assert check_invariants(actions, name, result) == [], (p, m, steps)
        budgets = [spec.activation_budget(r, p, m, 2) for r in range(p)]
        assert result.peak_activations == budgets, (p, m)  # the budget is tight
        assert result.stage_weight_versions == [1] * 2 * p  # synchronous: one version


def test_activation_memory_evens_out_across_ranks():
    """With M >= 2P every rank holds 2P forwards of its stages (ZB-V: P of a whole rank's, as
    1F1B's first rank, where 1F1B's last holds one) and DualPipeV one more."""
    p, m = 4, 16
    assert simulate(lower(generate("zb-v", p, m, 1))).peak_activations == [2 * p] * p
    assert simulate(lower(generate("dualpipev", p, m, 1))).peak_activations == [2 * p + 1] * p
    assert simulate(lower(generate("1f1b", p, m, 1))).peak_activations == [4, 3, 2, 1]


@pytest.mark.parametrize(("f", "w"), [(1.0, 1.0), (2.0, 1.0), (1.0, 0.5), (1.5, 0.25)])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 7), (4, 8), (6, 24)])
def test_dualpipev_bubble_is_deepseeks(f, w, p, m):
    """DeepSeek-V3's bubble (P-1)(F&B + B - 3W) of a step on every rank, with F&B = F + B (the
    halves' compute does not overlap) and its zero-bubble costs: an input gradient takes a
    forward's time (B = F + W). Other costs give about that (not exactly: docs/schedules.md)."""
    b = f + w
    result = simulate(lower(generate("dualpipev", p, m, 1)), **times(p, f, b, w))
    bubble = (p - 1) * ((f + b) + b - 3 * w)
    assert result.idle == pytest.approx([bubble] * p)
    assert result.makespan == pytest.approx(2 * m * (f + b) + bubble)


@pytest.mark.parametrize(("p", "m"), [(2, 3), (3, 6), (4, 8), (4, 16), (8, 15)])
def test_zb_v_has_no_bubble_in_the_steady_state(p, m):
    """With F = I = W and M >= 2P-1, each step after the first adds exactly its compute, 6M
    chunk-forwards (the next step's forwards fill this one's cool-down): a zero bubble; the
    first step pays a fill of (P-1)F once, half of ZB-H1's (P-1)·(a rank's F)."""

    def makespan(steps: int) -> float:
        return simulate(lower(generate("zb-v", p, m, steps)), **times(p, 1, 2, 1)).makespan

    assert makespan(3) - makespan(2) == 6 * m
    assert makespan(1) == 6 * m + (p - 1)
    zb_h1 = simulate(lower(generate("zb-h1", p, m, 1)), fwd=2, bwd=4, wgrad=2)
    assert zb_h1.makespan == 6 * m + 2 * (p - 1)


# --- the rules, and where they run ------------------------------------------------------------


def test_the_rules_on_m_and_chunks_are_explained():
    with pytest.raises(
        ScheduleError,
        match=r"dualpipev needs microbatches >= 2 x stages \(got "
        r"M=5, P=3\).*use 6 or more microbatches",
    ):
        generate("dualpipev", 3, 5, 1)
    with pytest.raises(ScheduleError, match="zb-v places exactly 2 stages on each rank"):
        generate("zb-v", 2, 4, 1, chunks=3)
    assert schedule_spec("zb-v").microbatch_problem(4, 1) is None  # any M, bubbly below 2P-1


def test_an_overlapped_action_pairs_a_forward_with_a_whole_backward():
    with pytest.raises(ScheduleError, match="an FB, and only an FB"):
        Action(K.FB, 0, 0, 0, 0)
    with pytest.raises(ScheduleError, match="an FB's backward half is a B"):
        Action(K.FB, 0, 0, 0, 0, paired=a(I, 1, 3))
    pair = fb(3, 0, 1, 3)
    assert [str(x) for x in pair.parts] == ["F3v0@s0", "B1v0@s3"] and str(pair) == "F3v0@s0&B1v0@s3"


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_a_stopped_run_is_the_shorter_runs_lists(name):
    """Planned a step at a time, like every flushing schedule: a long run stopped at step t is
    the run of t steps."""
    for t, rank in itertools.product(range(1, 4), range(3)):
        stopped = list(until_step(rank_actions(name, 3, 6, 10**9, rank), t))
        assert stopped == generate(name, 3, 6, t)[rank]


def one_process_run(mc, **settings) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Five steps of the one-process engine: the losses and the final weights."""
    base = dict(batch_size=8, microbatches=4, seq_len=16, lr=1e-2, warmup_steps=2, steps=5)
    cfg = resolve_config(TrainConfig(**{**base, **settings}))
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, mc.vocab_size, (8, 17), generator=gen) for _ in range(5)]
    engine, losses, feed = OneProcessEngine(cfg, mc, torch.device("cpu")), [], iter(data)
    engine.run_steps(len(data), lambda: next(feed), lambda s: losses.append(s.loss))
    return losses, engine.named_weights()


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_the_one_process_engine_trains_them_as_sync_on_their_model_stages(tiny_mc, name):
    """Synchronous, so the one-process engine's run of a V schedule on P = 2 (4 model stages,
    tied embedding over the first and the last) is the sync run on 4 stages, bit for bit: the
    same partition, per-stage clipping and updates; the order only matters to the runtime."""
    tied = {"tie_embeddings": True, "optim": "muon"}
    losses, weights = one_process_run(tiny_mc, schedule=name, stages=2, **tied)
    sync_losses, sync_weights = one_process_run(tiny_mc, schedule="sync", stages=4, **tied)
    assert losses == sync_losses
    assert weights.keys() == sync_weights.keys()
    assert all(torch.equal(weights[n], sync_weights[n]) for n in weights)


def test_a_launch_places_them_by_their_registry_entry(monkeypatch):
    """torchrun's layout takes the schedule's placement: the head's process is rank 0."""
    assert {"zb-v", "dualpipev"} <= set(PIPELINE_SCHEDULES)  # the planner's rows, the GPU check
    assert not schedule_spec("zb-v").pipeline_can_tie(4) and schedule_spec("zb-v").can_tie(4)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    cfg = build_config({"schedule": "dualpipev", "stages": 2, "dp": 2, "microbatches": 4})
    layout = launch_layout(cfg)
    assert (layout.placement, layout.pp_rank, layout.replica, layout.stages) == (V, 1, 0, (1, 2))
    assert ParallelLayout.of(cfg, placement=V).rank_of(3) == 0
    cfg = build_config({"schedule": "zb-h1", "stages": 2, "dp": 2, "microbatches": 4})
    assert launch_layout(cfg).placement == "loop"


def test_tied_embeddings_under_v_are_refused_with_the_fix(tiny_mc):
    """The embedding and the head share process 0 under V: refused before the engine is built,
    naming the setting to change (the loop placements run them: tests/test_tied_embeddings.py)."""
    cfg = build_config({"schedule": "zb-v", "stages": 2, "microbatches": 4})
    tied, untied = (dataclasses.replace(tiny_mc, tie_embeddings=tie) for tie in (True, False))
    v = ParallelLayout(2, chunks=2, placement=V)
    with pytest.raises(ConfigError, match=r"zb-v with tied embeddings.*set tie_embeddings=false"):
        check_model(cfg, tied, v)
    check_model(cfg, untied, v)
    check_model(cfg, tied, ParallelLayout(2, chunks=2))  # a loop: the all-reduce of two copies


def test_the_cli_draws_them(tmp_path, capsys):
    png, trace = tmp_path / "v.png", tmp_path / "v.json"
    argv = ["schedule", "--schedule", "zb-v", "--stages", "2", "--microbatches", "4"]
    assert main([*argv, "--steps", "1", "--png", str(png), "--width", "400"]) == 0
    out = capsys.readouterr().out
    assert "r0 F0.0v0" in out and "F0.1v0" in out and "F0.3v0" in out
    assert "invariants: all hold" in out and png.stat().st_size > 10_000
    argv[2] = "dualpipev"
    assert main([*argv, "--steps", "1", "--trace", str(trace), "--width", "400"]) == 0
    out = capsys.readouterr().out
    assert "F3.0v0&B1.3v0" in out and "overlapped F&B" in out
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    assert "F3&B1" in names
    assert main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["microbatches_total"] == 4 * 3 and summary["invariant_violations"] == []
    assert summary["peak_activations"] == [5, 5]
