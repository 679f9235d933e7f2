"""The sharding plan of zero=1, 2 (nobubble.zero_partition) against the optimizers it shards.

Each replica's optimizer over its parts of a stage (blocks of rows, or whole parameters it owns)
must compute exactly the rows of what one optimizer over the whole parameters computes, and
their states, joined, must be the whole optimizer's state (and a whole state, sliced, each
replica's): that is what makes a sharded run the run without sharding, and its checkpoints the
same as any other. The registry's list of what needs a whole tensor
(``nobubble.optim.registry.updates_whole``) is held against the optimizers both ways: a kind it
lets split updates its rows exactly, and a kind it keeps whole would not.
"""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from nobubble.checkpoint.named_state import load_named_state, named_state
from nobubble.configure import build_config
from nobubble.model.layers import build_model
from nobubble.model.resolve import model_config
from nobubble.optim.param_groups import classify
from nobubble.optim.registry import OPTIMIZERS, state_elements, updates_whole
from nobubble.pipeline.sharded_update import ShardedUpdate
from nobubble.pipeline.transport import Transport, install
from nobubble.stage_update import build_stage_optimizer
from nobubble.zero_partition import ShardPlan

MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64, "seq_len": 32}
MOE = {"moe_experts": 4, "moe_top_k": 2, "moe_d_ff": 32, "moe_layers": [1]}


def _setup(optim: str, correction: str = "none"):
    cfg = build_config({**MODEL, **MOE, "optim": optim, "correction": correction, "lr": 1e-2})
    model = build_model(model_config(cfg, tokenizer_vocab=48), seed=0)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return cfg, params


def _grad(name: str, shape: torch.Size, t: int) -> torch.Tensor:
    """A deterministic gradient, the same wherever the parameter is updated."""
    count = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    return torch.sin(0.37 * count + t + len(name))


def _train(cfg, params, plans, steps: int = 3):
    """The whole optimizer and, for each plan, one over its parts (of a copy of the weights that
    every replica's step writes its parts into, as the all-gather does); after ``steps`` steps
    of the same gradients, (whole weights, whole optimizer, sharded weights, part optimizers)."""
    whole = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
    whole_opt = build_stage_optimizer(list(whole.items()), cfg, delay=1)
    sharded = {n: p.detach().clone() for n, p in params.items()}
    parts = [
        {q.name: torch.nn.Parameter(q.of(sharded[q.name]).clone()) for q in plan.parts()}
        for plan in plans
    ]
    part_opts = [build_stage_optimizer(list(ps.items()), cfg, delay=1) for ps in parts]
    for t in range(steps):
        for name, p in whole.items():
            p.grad = _grad(name, p.shape, t)
        whole_opt.step()
        whole_opt.zero_grad(set_to_none=True)
        for plan, mine, opt in zip(plans, parts, part_opts, strict=True):
            for q in plan.parts():
                mine[q.name].grad = q.of(_grad(q.name, whole[q.name].shape, t))
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for plan, mine in zip(plans, parts, strict=True):
                for q in plan.parts():
                    q.of(sharded[q.name]).copy_(mine[q.name])
    return whole, whole_opt, sharded, part_opts


def _plans(params, optim: str, dp: int, split_everything: bool = False) -> list[ShardPlan]:
    if not split_everything:
        return [ShardPlan.of(params, optim, 0.9, dp, r) for r in range(dp)]
    return [ShardPlan({n: tuple(p.shape) for n, p in params.items()}, dp, r, []) for r in range(dp)]


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_each_replica_updates_its_parts_as_the_whole_optimizer_does(optim):
    cfg, params = _setup(optim)
    whole, _, sharded, _ = _train(cfg, params, _plans(params, optim, dp=3))
    for name in whole:
        assert torch.equal(whole[name].detach(), sharded[name]), name


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_the_kinds_kept_whole_are_the_ones_a_split_would_change(optim):
    """Split every parameter by rows: a kind the registry lets split is updated exactly as in the
    whole tensor; a kind it keeps whole is not (so the entry is needed)."""
    cfg, params = _setup(optim)
    whole, _, sharded, _ = _train(cfg, params, _plans(params, optim, 2, split_everything=True))
    for name, param in params.items():
        same = torch.equal(whole[name].detach(), sharded[name])
        assert same != updates_whole(optim, name, param), (name, classify(name, param))


@pytest.mark.parametrize(
    ("optim", "correction"),
    [("adamw", "ef"), ("muon", "nesterov"), ("sgd", "dc"), ("lion", "none"), ("soap", "none")],
)
def test_states_join_into_the_whole_state_and_slice_back(optim, correction):
    """The replicas' states joined (what a checkpoint holds) are the whole optimizer's, and the
    whole state sliced for each replica loads into its optimizer and trains on exactly."""
    cfg, params = _setup(optim, correction)
    plans = _plans(params, optim, dp=3)
    _, whole_opt, sharded, part_opts = _train(cfg, params, plans)
    joined = plans[0].join_states([named_state(opt) for opt in part_opts])
    _assert_same_state(joined, named_state(whole_opt))
    for plan, opt in zip(plans, part_opts, strict=True):
        fresh = {q.name: torch.nn.Parameter(q.of(sharded[q.name]).clone()) for q in plan.parts()}
        again = build_stage_optimizer(list(fresh.items()), cfg, delay=1)
        load_named_state(again, plan.slice_state(named_state(whole_opt)))
        _assert_same_state(named_state(again), named_state(opt))


def _assert_same_state(a, b) -> None:
    assert a.names() == b.names() and a.correction == b.correction
    assert a.params.keys() == b.params.keys()
    for name in a.params:
        _assert_same(a.params[name], b.params[name], name)
    assert (a.buffers is None) == (b.buffers is None)
    for name in a.buffers or {}:
        _assert_same(a.buffers[name], b.buffers[name], name)


def _assert_same(x, y, where: str) -> None:
    if isinstance(x, torch.Tensor):
        assert torch.equal(x, y), where
    elif isinstance(x, list | tuple):
        assert len(x) == len(y), where
        for u, v in zip(x, y, strict=True):
            _assert_same(u, v, where)
    elif isinstance(x, dict):
        assert x.keys() == y.keys(), where
        for key in x:
            _assert_same(x[key], y[key], f"{where}/{key}")
    else:
        assert x == y, where


def test_owned_parameters_are_balanced_deterministically_and_the_tied_one_first():
    shapes = {"a": (8, 4), "b": (8, 4), "c": (2, 4), "d": (6,), "tied": (4, 4)}
    plans = [ShardPlan(shapes, 2, r, whole=["a", "b", "c", "tied"], first="tied") for r in (0, 1)]
    assert plans[0].owner == plans[1].owner
    assert plans[0].owner["tied"] == 0  # the two stages with a tied copy split it alike
    assert {plans[0].owner["a"], plans[0].owner["b"]} == {0, 1}  # the two largest apart
    # d split 3 + 3; tied to replica 0, then a to the lighter replica 1, b to 0, c to 1
    assert plans[0].elements == [3 + 16 + 32, 3 + 32 + 8]
    mine = [{p.name: (p.lo, p.hi) for p in plan.parts()} for plan in plans]
    assert mine[0]["d"] == (0, 3) and mine[1]["d"] == (3, 6)
    assert set(mine[0]) & set(mine[1]) == {"d"}


def _first_stage(optim: str):
    """The trainable parameters of the first of two stages of a 4-block model (the embedding
    and two blocks), and its config."""
    cfg = build_config({**MODEL, "n_layers": 4, "optim": optim, "lr": 1e-2})
    model = build_model(model_config(cfg, tokenizer_vocab=65), seed=0)
    first = ("embed.", "blocks.0.", "blocks.1.")
    return cfg, {n: p for n, p in model.named_parameters() if n.startswith(first)}


def _held(state) -> int:
    """The elements of the tensors of one parameter's optimizer state, scalars left out."""
    if isinstance(state, torch.Tensor):
        return state.numel() if state.ndim else 0
    if isinstance(state, list | tuple):
        return sum(map(_held, state))
    return sum(map(_held, state.values())) if isinstance(state, dict) else 0


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_soap_s_owned_matrices_balance_the_state_each_replica_holds(dp):
    """SOAP's eigenbases grow with a matrix's sides squared, not with its elements: the plan
    balances what each replica's optimizer really holds, to within one parameter's cost."""
    cfg, params = _first_stage("soap")
    plans = _plans(params, "soap", dp)
    _, _, _, part_opts = _train(cfg, params, plans, steps=1)
    held = [sum(_held(s) for s in opt.state.values()) for opt in part_opts]
    assert held == plans[0].state
    costliest = max(state_elements("soap", cfg.momentum, n, params[n]) for n in plans[0].owner)
    assert max(held) - min(held) <= costliest, held


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_where_state_is_a_multiple_of_elements_the_plan_is_the_one_elements_give(optim):
    _, params = _first_stage(optim)
    for momentum in (0.0, 0.9):
        state = {n: state_elements(optim, momentum, n, p) for n, p in params.items()}
        if len({state[n] / p.numel() for n, p in params.items()}) > 1:
            assert optim in ("muon", "soap")  # Muon's momentum beside AdamW's two moments
            continue
        shapes = {n: tuple(p.shape) for n, p in params.items()}
        whole = [n for n, p in params.items() if updates_whole(optim, n, p)]
        for dp in (2, 3):
            by_elements = ShardPlan(shapes, dp, 0, whole)
            by_state = ShardPlan.of(params, optim, momentum, dp, 0)
            assert by_state.owner == by_elements.owner
            assert all(by_state.parts(r) == by_elements.parts(r) for r in range(dp))


def test_a_bucket_packs_each_replicas_parts_in_equal_segments():
    shapes = {"w": (5, 2), "g": (3,)}
    plans = [ShardPlan(shapes, 2, r, whole=[]) for r in (0, 1)]
    bucket = plans[1].bucket(shapes)
    w = torch.arange(10.0).reshape(5, 2)
    g = torch.tensor([10.0, 11.0, 12.0])
    full = bucket.pack({"w": w, "g": g}, like=w)
    # replica 0: rows 0-2 of w, 2 of g; replica 1: rows 3-4 of w, 1 of g, padded to 8
    assert full.tolist() == [0, 1, 2, 3, 4, 5, 10, 11, 6, 7, 8, 9, 12, 0, 0, 0]
    views = bucket.views(full[8:])
    assert views["w"].tolist() == [[6, 7], [8, 9]] and views["g"].tolist() == [12]
    target = {"w": torch.zeros(5, 2), "g": torch.zeros(3)}
    bucket.unpack(full, target)  # replica 1 takes replica 0's parts
    assert target["w"][:3].equal(w[:3]) and target["w"][3:].eq(0).all()
    assert target["g"].tolist() == [10, 11, 0]


class _Recording(Transport):
    """torch.distributed as it is, noting what is posted through the transport."""

    def __init__(self) -> None:
        self.labels: list[str] = []

    def collective(self, group, launch, label, device):
        self.labels.append(label)
        return launch()


@pytest.mark.parametrize(
    ("zero", "posted"),
    [
        (
            1,
            ["the gradient's reduction", "the step's figures", "the all-gather of the new weights"],
        ),
        (
            2,
            [
                "the gradient's reduction",
                "the step's figures",
                "the gradient's sum of squares",
                "the all-gather of the new weights",
            ],
        ),
    ],
)
def test_every_collective_of_the_chain_goes_through_the_transport(zero, posted):
    """Under emulate_nccl a chain's collectives must queue with its group's other operations
    (the evaluation totals, a tied weight's sum), so each is posted through the process's
    transport, as the replicas' all-reduce is (one process, a group of one)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    recording = _Recording()
    install(recording)
    try:
        weight = torch.nn.Parameter(torch.ones(4, 2))
        weight.grad = torch.full((4, 2), 2.0)
        trained = SimpleNamespace(
            params={"w": weight}, parts={"w": torch.nn.Parameter(torch.ones(4, 2))}, tied=None
        )
        plan = ShardPlan({"w": (4, 2)}, dp=1, replica=0, whole=())
        chain = ShardedUpdate(dist.group.WORLD, plan, trained, ["w"], None, zero, 60.0, "stage 0")
        applied = []
        pending = chain.start(0, torch.zeros(2), None)
        assert chain.progress(pending, lambda sums, norms: applied.append(norms), block=True)
        assert recording.labels == [f"stage 0: {what} (step 1)" for what in posted]
        assert applied == [(pytest.approx(math.sqrt(32.0)), None)]  # the gradient's norm
    finally:
        install(Transport())
        dist.destroy_process_group()
