"""Registry and routing on the real model: who goes where, loss goes down, stage subsets give
the whole model's updates, state dicts resume exactly."""

import dataclasses
import io
import zlib

import pytest
import torch

from nobubble.config import TrainConfig
from nobubble.configure import resolve_config
from nobubble.corrections.ef import ErrorFeedback
from nobubble.model.layers import build_model, lm_loss
from nobubble.model.presets import PRESETS
from nobubble.optim.composite import CompositeOptimizer
from nobubble.optim.expert_muon import ExpertMuon
from nobubble.optim.lr_schedule import set_lr
from nobubble.optim.param_groups import Kind, classify
from nobubble.optim.registry import OPTIMIZERS, build_optimizer, state_elements
from nobubble.settings_read import READ_WHEN, RunFacts
from nobubble.stage_update import build_stage_optimizer

TINY = dataclasses.replace(PRESETS["tiny"], vocab_size=320)
# Same names and kinds as tiny, small enough to step every optimizer many times quickly.
SMALL = dataclasses.replace(TINY, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=2)
# Learning rates at which each optimizer reliably fits one fixed batch within 10 steps.
FIT_LR = {"lion": 3e-4, "signum": 3e-4, "sgd": 0.03}


def _names_by_kind(model: torch.nn.Module) -> dict[Kind, set[str]]:
    out: dict[Kind, set[str]] = {kind: set() for kind in Kind}
    for name, param in model.named_parameters():
        out[classify(name, param)].add(name)
    return out


def _group_names(opt, where=None) -> dict[str, set[str]]:
    """{kind: names} over the param groups, of one part of a composite if given."""
    groups = opt.param_groups if where is None else where.param_groups
    return {g["kind"]: set(g["param_names"]) for g in groups}


def test_classify_by_name_and_shape() -> None:
    kinds = _names_by_kind(build_model(SMALL))
    assert kinds[Kind.EMBEDDING] == {"embed.weight", "head.weight"}
    assert "norm.weight" in kinds[Kind.GAIN] and "blocks.1.mlp_norm.weight" in kinds[Kind.GAIN]
    assert all(n.startswith("blocks.") for n in kinds[Kind.HIDDEN])
    assert len(kinds[Kind.HIDDEN]) == 2 * 7  # wq wk wv wo w_gate w_up w_down per block


# MoE blocks (docs/moe.md) with bias balancing: an expert and a router group, and a balance bias
# that no optimizer steps
SMALL_MOE = dataclasses.replace(SMALL, moe_experts=4, moe_top_k=2, moe_bias_rate=1e-3)


@pytest.mark.parametrize("optim", OPTIMIZERS)
@pytest.mark.parametrize("mc", [SMALL, SMALL_MOE], ids=["dense", "moe"])
def test_one_group_per_kind_and_decay_only_on_matrices(optim: str, mc) -> None:
    model = build_model(mc)
    opt = build_optimizer(list(model.named_parameters()), TrainConfig(optim=optim))
    names = _names_by_kind(model)
    present = {kind.value: names[kind] for kind in Kind if names[kind]}
    present["gain"] = {n for n in present["gain"] if not n.endswith("balance_bias")}
    assert _group_names(opt) == present
    decay = {g["kind"]: g["weight_decay"] for g in opt.param_groups}
    expected = {"hidden": 0.1, "embedding": 0.1, "gain": 0.0}
    if mc.moe_experts:
        expected |= {"expert": 0.1, "router": 0.1}
    assert decay == expected


def test_muon_takes_hidden_matrices_and_adamw_the_rest() -> None:
    model = build_model(SMALL)
    opt = build_optimizer(list(model.named_parameters()), TrainConfig(optim="muon"))
    assert isinstance(opt, CompositeOptimizer)
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = _names_by_kind(model)
    assert _group_names(opt, muon) == {"hidden": names[Kind.HIDDEN]}
    assert _group_names(opt, adamw) == {
        "embedding": names[Kind.EMBEDDING],
        "gain": names[Kind.GAIN],
    }
    assert muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"


def test_muon_takes_each_experts_matrix_and_adamw_the_router() -> None:
    model = build_model(SMALL_MOE)
    opt = build_optimizer(list(model.named_parameters()), TrainConfig(optim="muon"))
    muon, experts, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(experts, ExpertMuon)
    names = _names_by_kind(model)
    assert _group_names(opt, experts) == {"expert": names[Kind.EXPERT]}
    assert set(_group_names(opt, adamw)) == {"embedding", "gain", "router"}
    assert experts.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"


@pytest.mark.parametrize(
    ("setting", "dtype"),
    [("auto", torch.float32), ("float32", torch.float32), ("bfloat16", torch.bfloat16)],
)
def test_muon_ns_dtype_reaches_the_dense_and_the_expert_muon(monkeypatch, setting, dtype) -> None:
    """On a CPU without bfloat16 matrix instructions ``auto`` is float32 (the rule:
    tests/test_muon.py)."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True})
    model = build_model(SMALL_MOE)
    cfg = TrainConfig(optim="muon", muon_ns_dtype=setting)
    muon, experts, _ = build_optimizer(list(model.named_parameters()), cfg).optimizers
    assert (muon.ns_dtype, experts.ns_dtype) == (dtype, dtype)


def test_muon_on_a_stage_without_hidden_matrices_is_adamw_alone() -> None:
    stage = [("embed.weight", torch.nn.Parameter(torch.randn(8, 4)))]
    opt = build_optimizer(stage, TrainConfig(optim="muon"))
    assert [type(o) for o in opt.optimizers] == [torch.optim.AdamW]


def test_soap_preconditions_embedding_and_head_on_the_model_side_only() -> None:
    model = build_model(SMALL)
    named = list(model.named_parameters())
    opt = build_optimizer(named, TrainConfig(optim="soap"))
    _set_grads(named, 0)
    opt.step()
    params = dict(named)
    for name in ("embed.weight", "head.weight"):  # (320, 32): no 320 x 320 eigenbasis
        assert [len(q) for q in opt.state[params[name]]["Q"]] == [0, SMALL.d_model]
    w_up = opt.state[params["blocks.0.mlp.w_up.weight"]]["Q"]
    assert [q.shape[0] for q in w_up] == [SMALL.d_ff, SMALL.d_model]


def test_mars_gains_take_adamw_at_the_scheduled_lr() -> None:
    gain = [("norm.weight", torch.nn.Parameter(torch.linspace(0.5, 1.5, 8)))]
    twin = [("norm.weight", torch.nn.Parameter(gain[0][1].detach().clone()))]
    mars = build_optimizer(gain, TrainConfig(optim="mars", lr=1.0))
    adamw = build_optimizer(twin, TrainConfig(optim="adamw", lr=1.0))
    for step in range(5):
        for opt, named in ((mars, gain), (adamw, twin)):
            set_lr(opt, 0.01 * (step + 1))
            _set_grads(named, step)
            opt.step()
    # MARS adds eps before the bias correction of the denominator, AdamW after: ~eps apart
    torch.testing.assert_close(gain[0][1], twin[0][1], rtol=1e-6, atol=0)


def test_tied_head_is_optimized_once() -> None:
    model = build_model(dataclasses.replace(SMALL, tie_embeddings=True))
    named = list(model.named_parameters(remove_duplicate=False))
    assert [n for n, _ in named].count("head.weight") == 1
    opt = build_optimizer(named, TrainConfig())
    assert _group_names(opt)["embedding"] == {"embed.weight"}


def test_unknown_optimizer_names_the_choices() -> None:
    with pytest.raises(ValueError, match="adamw, muon"):
        build_optimizer([("x", torch.nn.Parameter(torch.zeros(2)))], TrainConfig(optim="adam"))


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_weight_decay_shrinks_matrices_and_never_gains(optim: str) -> None:
    model = build_model(SMALL)
    named = list(model.named_parameters())
    before = {n: p.detach().clone() for n, p in named}
    opt = build_optimizer(named, TrainConfig(optim=optim, lr=0.1, weight_decay=0.5))
    for _ in range(2):  # SOAP makes no update on its first step
        for _, p in named:
            p.grad = torch.zeros_like(p)
        opt.step()
    for name, p in named:
        if p.ndim == 1:
            assert torch.equal(p, before[name]), name
        else:
            assert p.detach().abs().sum() < before[name].abs().sum(), name


@pytest.mark.parametrize("ef", [False, True], ids=["base", "ef"])
@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_every_optimizer_fits_a_fixed_batch_on_tiny(optim: str, ef: bool) -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, TINY.vocab_size, (2, 33))
    model = build_model(TINY)
    cfg = TrainConfig(optim=optim, lr=FIT_LR.get(optim, 3e-3), correction="ef" if ef else "none")
    opt = build_stage_optimizer(list(model.named_parameters()), cfg, delay=1)
    assert isinstance(opt, ErrorFeedback) == ef
    losses = []
    for _ in range(10):
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    assert losses[-1] < 0.85 * losses[0], losses


def _set_grads(named: list, step: int) -> None:
    """The same pseudo-random gradient for a parameter name and step, whoever asks."""
    for name, p in named:
        gen = torch.Generator().manual_seed(zlib.crc32(f"{name}@{step}".encode()))
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("ef", [False, True], ids=["base", "ef"])
@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_stage_subsets_update_like_the_whole_model(optim: str, ef: bool) -> None:
    cfg = TrainConfig(optim=optim, lr=1e-2, correction="ef" if ef else "none")
    whole, staged = build_model(SMALL), build_model(SMALL)
    whole_named = list(whole.named_parameters())
    staged_named = list(staged.named_parameters())
    split = next(i for i, (n, _) in enumerate(staged_named) if n.startswith("blocks.1."))
    stages = [staged_named[:split], staged_named[split:]]  # embed + block 0 | block 1 + head
    whole_opt = build_stage_optimizer(whole_named, cfg, delay=1)
    stage_opts = [build_stage_optimizer(named, cfg, delay=1) for named in stages]
    for step in range(3):
        _set_grads(whole_named, step)
        _set_grads(staged_named, step)
        whole_opt.step()
        for opt in stage_opts:
            opt.step()
    for (name, p), (_, q) in zip(whole_named, staged_named, strict=True):
        assert torch.equal(p, q), name


def _roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.parametrize("ef", [False, True], ids=["base", "ef"])
@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_state_dict_resume_equals_uninterrupted_training(optim: str, ef: bool) -> None:
    cfg = TrainConfig(optim=optim, lr=1e-2, correction="ef" if ef else "none")
    model = build_model(SMALL)
    named = list(model.named_parameters())
    opt = build_stage_optimizer(named, cfg, delay=1)
    for step in range(4):
        _set_grads(named, step)
        opt.step()
    saved_model = _roundtrip(model.state_dict())
    saved_opt = _roundtrip(opt.state_dict())

    resumed = build_model(SMALL, seed=1)
    resumed.load_state_dict(saved_model)
    resumed_named = list(resumed.named_parameters())
    resumed_opt = build_stage_optimizer(resumed_named, cfg, delay=1)
    resumed_opt.load_state_dict(saved_opt)
    for step in range(4, 12):  # past SOAP's eigenbasis refresh at step 10
        for named_, opt_ in ((named, opt), (resumed_named, resumed_opt)):
            _set_grads(named_, step)
            opt_.step()
    for (name, p), (_, q) in zip(named, resumed_named, strict=True):
        assert torch.equal(p, q), name


class _Reads:
    """A config that records the settings read from it."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg, self.read = cfg, set()

    def __getattr__(self, name: str):
        self.read.add(name)
        return getattr(self.cfg, name)


def test_each_optimizer_and_correction_reads_the_settings_the_config_says_it_reads() -> None:
    """The optimizer registry and the corrections declare the settings they read, which
    nobubble.settings_read turns into when each is read (what the warnings about unused settings go
    by); here that against what building a stage's optimizer really reads."""
    facts = RunFacts(moe=False, torchrun=False)
    conditional = set(READ_WHEN)
    cases = {}
    for optim in OPTIMIZERS:
        for correction in ("none", "ef", "nesterov", "dc"):
            cfg = resolve_config(TrainConfig(optim=optim, correction=correction))
            reads = _Reads(cfg)
            build_stage_optimizer(list(build_model(SMALL).named_parameters()), reads, delay=1)
            said = {k for k in conditional if READ_WHEN[k].holds(cfg, facts)}
            cases[optim, correction] = (reads.read & conditional, said)
    checked = set().union(*(read for read, _ in cases.values()))
    assert {"beta1", "beta3", "eps", "momentum", "nesterov", "ef_gamma", "dc_lambda"} <= checked
    for case, (read, said) in cases.items():
        assert read == said & checked, case


def _state_elements(state) -> int:
    """The elements of the tensors in one parameter's optimizer state, scalars left out."""
    if isinstance(state, torch.Tensor):
        return state.numel() if state.ndim else 0
    if isinstance(state, list | tuple):
        return sum(map(_state_elements, state))
    if isinstance(state, dict):
        return sum(map(_state_elements, state.values()))
    return 0


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_the_state_each_parameter_costs_is_what_the_optimizer_holds(optim: str, momentum) -> None:
    """state_elements (what zero=1, 2 balance over the replicas) against the optimizer's state
    after a step, for every kind of parameter (MoE experts and routers too)."""
    named = list(build_model(SMALL_MOE).named_parameters())
    opt = build_optimizer(named, TrainConfig(optim=optim, momentum=momentum))
    _set_grads(named, 0)
    opt.step()
    states = [part.state for part in getattr(opt, "optimizers", [opt])]
    for name, param in named:
        if not param.requires_grad:
            continue
        held = sum(_state_elements(state[param]) for state in states if param in state)
        assert state_elements(optim, momentum, name, param) == held, name
