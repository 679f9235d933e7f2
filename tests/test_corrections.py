"""Delay corrections (docs/corrections.md) against formulas written out by hand.

Every case is a few steps of f(w) = ½·(a1·w1² + a2·w2²) on one 2-parameter tensor, in float64.
A 2-D hidden-matrix name (1×2) gets weight decay, so the decay is part of Δ where it applies.
"""

import dataclasses
import math
import re

import pytest
import torch

from nobubble.checkpoint.named_state import decode, encode, load_named_state, named_state
from nobubble.config import SECTIONS, ConfigError, TrainConfig
from nobubble.configure import build_config
from nobubble.corrections.dc import DelayCompensation
from nobubble.corrections.ef import ErrorFeedback
from nobubble.corrections.nesterov import NesterovCorrection
from nobubble.corrections.registry import REGISTRY
from nobubble.corrections.spec import GENERALISATION, PUBLISHED
from nobubble.corrections.spike import SpikeCompensation
from nobubble.model.resolve import model_config
from nobubble.one_process import OneProcessEngine
from nobubble.optim.lr_schedule import set_lr
from nobubble.optim.registry import build_optimizer
from nobubble.stage_update import build_stage_optimizer
from tests.helpers.quadratic import column, run_steps, scalar_trainer

A = (2.0, 0.5)  # curvatures
W0 = (1.0, -2.0)
HIDDEN = "blocks.0.mlp.w_up.weight"


def grad(w: list[float]) -> list[float]:
    return [a * x for a, x in zip(A, w, strict=True)]


def run(cfg: TrainConfig, steps: int, delay: int = 0, name: str = HIDDEN) -> list[float]:
    """``steps`` optimizer steps whose gradient is computed ``delay`` steps back (as the engines
    do: at version max(t - delay, 0)); returns the final weights. The learning rate stays
    ``cfg.lr`` (no schedule is applied here)."""
    w = torch.nn.Parameter(torch.tensor([W0], dtype=torch.float64))
    opt = build_stage_optimizer([(name, w)], cfg, delay=delay)
    history = [w.detach().clone()]
    for t in range(steps):
        stale = history[max(t - delay, 0)][0].tolist()
        w.grad = torch.tensor([grad(stale)], dtype=torch.float64)
        opt.step()
        opt.zero_grad()
        history.append(w.detach().clone())
    return w.detach()[0].tolist()


def sgd_deltas(lr: float, mom: float, wd: float):
    """Heavy-ball SGD (torch): yields Δ[t] from (w[t], g[t]); L2 decay enters the gradient."""
    buf = None

    def delta(w: list[float], g: list[float]) -> list[float]:
        nonlocal buf
        g = [gi + wd * wi for gi, wi in zip(g, w, strict=True)]
        buf = g if buf is None else [mom * b + gi for b, gi in zip(buf, g, strict=True)]
        return [lr * b for b in buf]

    return delta


def adamw_deltas(lr: float, b1: float, b2: float, eps: float, wd: float):
    m, v, t = [0.0, 0.0], [0.0, 0.0], 0

    def delta(w: list[float], g: list[float]) -> list[float]:
        nonlocal t
        t += 1
        out = []
        for i in range(2):
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            step = lr * (m[i] / (1 - b1**t)) / (math.sqrt(v[i] / (1 - b2**t)) + eps)
            out.append(w[i] * lr * wd + step)
        return out

    return delta


SGD = {"optim": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": False, "weight_decay": 0.1}
ADAMW = {"optim": "adamw", "lr": 0.05, "beta1": 0.8, "beta2": 0.9, "eps": 1e-3}
ADAMW["weight_decay"] = 0.1


def base_deltas(settings: dict):
    if settings["optim"] == "sgd":
        return sgd_deltas(settings["lr"], settings["momentum"], settings["weight_decay"])
    return adamw_deltas(
        settings["lr"],
        settings["beta1"],
        settings["beta2"],
        settings["eps"],
        settings["weight_decay"],
    )


# -- ef: γ settable, and γ = β on heavy ball is Nesterov momentum -------------------------------


def test_ef_with_gamma_beta_on_heavy_ball_is_nesterov_momentum():
    """buf[t] = β·buf[t-1] + g[t], Δ[t] = η·buf[t]; EF with γ = β gives
    w[t+1] = w[t] - η·((1 + β)·buf[t] - β·buf[t-1]) = w[t] - η·((1 + β)·g[t] + β²·buf[t-1]),
    which is torch's Nesterov step w[t] - η·(g[t] + β·buf[t]) at a constant learning rate."""
    common = dict(SGD)
    ef = run(build_config({**common, "correction": "ef", "ef_gamma": 0.9}), 6, delay=1)
    nesterov = run(build_config({**common, "nesterov": True}), 6, delay=1)
    assert ef == pytest.approx(nesterov, rel=1e-12, abs=1e-14)
    assert ef != pytest.approx(run(build_config(common), 6, delay=1), rel=1e-3)


@pytest.mark.parametrize("settings", [SGD, ADAMW], ids=["sgd", "adamw"])
@pytest.mark.parametrize("gamma", [0.5, 1.5])
def test_ef_gamma_matches_formula(settings, gamma):
    delta, w, prev = base_deltas(settings), list(W0), [0.0, 0.0]
    history = [list(W0)]
    for t in range(4):
        d = delta(w, grad(history[max(t - 1, 0)]))
        w = [wi - di - gamma * (di - pi) for wi, di, pi in zip(w, d, prev, strict=True)]
        prev = d
        history.append(w)
    cfg = TrainConfig(**settings, correction="ef", ef_gamma=gamma)
    assert run(cfg, 4, delay=1) == pytest.approx(w, rel=1e-12)


# -- nesterov ------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [SGD, ADAMW], ids=["sgd", "adamw"])
def test_nesterov_matches_formula(settings):
    """u[t] = γ·u[t-1] + (1 - γ)·Δ[t];  w[t+1] = w[t] - γ·u[t] - (1 - γ)·Δ[t]."""
    gamma = 0.7
    delta, w, u = base_deltas(settings), list(W0), [0.0, 0.0]
    history = [list(W0)]
    for t in range(5):
        d = delta(w, grad(history[max(t - 1, 0)]))
        u = [gamma * ui + (1 - gamma) * di for ui, di in zip(u, d, strict=True)]
        w = [wi - gamma * ui - (1 - gamma) * di for wi, ui, di in zip(w, u, d, strict=True)]
        history.append(w)
    cfg = TrainConfig(**settings, correction="nesterov", nesterov_gamma=gamma)
    assert run(cfg, 5, delay=1) == pytest.approx(w, rel=1e-12)


def test_nesterov_on_plain_sgd_is_ema_nesterov_momentum():
    """With Δ = η·g: w[t+1] = w[t] - η·((1 - γ)·g[t] + γ·m[t]), m[t] = γ·m[t-1] + (1 - γ)·g[t]."""
    gamma, lr = 0.8, 0.1
    w, m, history = list(W0), [0.0, 0.0], [list(W0)]
    for t in range(5):
        g = grad(history[max(t - 1, 0)])
        m = [gamma * mi + (1 - gamma) * gi for mi, gi in zip(m, g, strict=True)]
        w = [wi - lr * ((1 - gamma) * gi + gamma * mi) for wi, gi, mi in zip(w, g, m, strict=True)]
        history.append(w)
    cfg = TrainConfig(optim="sgd", lr=lr, momentum=0.0, weight_decay=0.0)
    cfg.correction, cfg.nesterov_gamma = "nesterov", gamma
    assert run(cfg, 5, delay=1) == pytest.approx(w, rel=1e-12)


def test_nesterov_gamma_zero_is_the_base_optimizer_bitwise():
    base = run(TrainConfig(**ADAMW), 4, delay=1)
    assert run(TrainConfig(**ADAMW, correction="nesterov", nesterov_gamma=0.0), 4, 1) == base


# -- spike ---------------------------------------------------------------------------------------


def _spiked(settings: dict, delay: int, steps: int) -> list[float]:
    """Kosson et al.: heavy ball w[t+1] = w[t] - η·(a·v[t] + b·g[t]), a = m^D,
    b = (1 - m^D)/(1 - m); AdamW's numerator a·m[t] + (1 - a)·g[t] with a = β1^D."""
    w, history = list(W0), [list(W0)]
    if settings["optim"] == "sgd":
        lr, mom, wd = settings["lr"], settings["momentum"], settings["weight_decay"]
        a, b = mom**delay, (1 - mom**delay) / (1 - mom)
        v = None
        for t in range(steps):
            g = [gi + wd * wi for gi, wi in zip(grad(history[max(t - delay, 0)]), w, strict=True)]
            v = g if v is None else [mom * vi + gi for vi, gi in zip(v, g, strict=True)]
            w = [wi - lr * (a * vi + b * gi) for wi, vi, gi in zip(w, v, g, strict=True)]
            history.append(w)
        return w
    lr, b1, b2, eps, wd = (settings[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    a = b1**delay
    m, v = [0.0, 0.0], [0.0, 0.0]
    for t in range(1, steps + 1):
        g = grad(history[max(t - 1 - delay, 0)])
        new = []
        for i in range(2):
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            numerator = (a * m[i] + (1 - a) * g[i]) / (1 - b1**t)
            new.append(
                w[i] * (1 - lr * wd) - lr * numerator / (math.sqrt(v[i] / (1 - b2**t)) + eps)
            )
        w = new
        history.append(w)
    return w


@pytest.mark.parametrize("settings", [SGD, ADAMW], ids=["sgd", "adamw"])
@pytest.mark.parametrize("delay", [1, 3])
def test_spike_matches_formula(settings, delay):
    cfg = TrainConfig(**settings)
    w = torch.nn.Parameter(torch.tensor([W0], dtype=torch.float64))
    opt = SpikeCompensation(build_optimizer([(HIDDEN, w)], cfg), {w: delay})
    history = [w.detach().clone()]
    for t in range(5):
        w.grad = torch.tensor([grad(history[max(t - delay, 0)][0].tolist())], dtype=torch.float64)
        opt.step()
        history.append(w.detach().clone())
    assert w.detach()[0].tolist() == pytest.approx(_spiked(settings, delay, 5), rel=1e-12)


def test_spike_under_2bw_uses_delay_one():
    cfg = build_config({**ADAMW, "correction": "spike", "schedule": "2bw"})
    assert run(cfg, 4, delay=1) == pytest.approx(_spiked(ADAMW, 1, 4), rel=1e-12)


def test_pipedream_delays_follow_the_stages():
    """Each stage's optimizer (and so its correction) sees the delay of its place in the
    pipeline: the partition says which stage owns a parameter, the schedule each stage's delay."""
    cfg = build_config({"schedule": "pipedream", "stages": 2, "n_layers": 2, "correction": "spike"})
    engine = OneProcessEngine(cfg, model_config(cfg, tokenizer_vocab=64), torch.device("cpu"))
    delays = {name: stage.delay for stage in engine.trainer.stages for name in stage.params}
    assert delays["embed.weight"] == delays["blocks.0.attn.wq.weight"] == 1
    assert delays["head.weight"] == 0
    for stage in engine.trainer.stages:
        assert set(stage.optimizer.delays.values()) == {stage.delay}  # what spike compensates


# -- dc ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [SGD, ADAMW], ids=["sgd", "adamw"])
@pytest.mark.parametrize("delay", [1, 2])
def test_dc_matches_formula(settings, delay):
    """g̃ = g + λ·g⊙g⊙(w[t] - w[t-D]), g computed at w[t-D]; the base optimizer steps g̃."""
    lam = 0.3
    delta, w, history = base_deltas(settings), list(W0), [list(W0)]
    for t in range(5):
        stale = history[max(t - delay, 0)]
        g = [
            gi + lam * gi * gi * (wi - si) for gi, wi, si in zip(grad(stale), w, stale, strict=True)
        ]
        w = [wi - di for wi, di in zip(w, delta(w, g), strict=True)]
        history.append(w)
    cfg = TrainConfig(**settings, correction="dc", dc_lambda=lam)
    # 2bw: every delay 1; pipedream over 3 stages: the embedding (stage 0, decayed like a hidden
    # matrix) has delay 2
    cfg.schedule, cfg.stages, cfg.n_layers = ("2bw", 1, None) if delay == 1 else ("pipedream", 3, 3)
    assert run(cfg, 5, delay, name="embed.weight") == pytest.approx(w, rel=1e-12)


@pytest.mark.parametrize("delay", [1, 2])
def test_adaptive_dc_matches_formula(delay):
    """DC-ASGD-a: ms = m·ms + (1-m)·g⊙g first, then g̃ = g + λ/√(ms + 1e-7)·g⊙g⊙(w[t] - w[t-D])."""
    lam, m = 0.3, 0.9
    delta, w, history = base_deltas(ADAMW), list(W0), [list(W0)]
    mean_square = [0.0] * len(W0)
    for t in range(5):
        stale = history[max(t - delay, 0)]
        g = grad(stale)
        mean_square = [m * ms + (1 - m) * gi * gi for ms, gi in zip(mean_square, g, strict=True)]
        g = [
            gi + lam / math.sqrt(ms + 1e-7) * gi * gi * (wi - si)
            for gi, ms, wi, si in zip(g, mean_square, w, stale, strict=True)
        ]
        w = [wi - di for wi, di in zip(w, delta(w, g), strict=True)]
        history.append(w)
    cfg = TrainConfig(**ADAMW, correction="dc", dc_lambda=lam, dc_mean_square_decay=m)
    cfg.schedule, cfg.stages, cfg.n_layers = ("2bw", 1, None) if delay == 1 else ("pipedream", 3, 3)
    assert run(cfg, 5, delay, name="embed.weight") == pytest.approx(w, rel=1e-12)
    constant = TrainConfig(**ADAMW, correction="dc", dc_lambda=lam)
    constant.schedule, constant.stages, constant.n_layers = cfg.schedule, cfg.stages, cfg.n_layers
    assert run(constant, 5, delay, name="embed.weight") != pytest.approx(w, rel=1e-6)


@pytest.mark.parametrize("name", ["spike", "dc"])
def test_spike_and_dc_do_nothing_without_a_delay(name):
    """Their control under a synchronous schedule is the synchronous run itself (predict is
    refused there): the study runs no such control (docs/corrections.md)."""
    corrected = TrainConfig(**ADAMW, correction=name, dc_lambda=10.0)
    assert run(corrected, 5, delay=0) == run(TrainConfig(**ADAMW), 5, delay=0)


# -- state, refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"correction": "nesterov"},
        {"correction": "spike"},
        {"correction": "dc", "dc_lambda": 0.5},
        {"correction": "dc", "dc_lambda": 0.5, "dc_mean_square_decay": 0.9},
    ],
    ids=["nesterov", "spike", "dc", "dc-adaptive"],
)
def test_correction_state_round_trips_by_name(extra):
    """The loaded twin steps as the original, at a learning rate the schedule set after the
    load (loading replaces the optimizer's group dicts)."""
    cfg = TrainConfig(**ADAMW, **extra, schedule="2bw")
    w = torch.nn.Parameter(torch.tensor([W0], dtype=torch.float64))
    opt = build_stage_optimizer([(HIDDEN, w)], cfg, delay=1)
    for _ in range(2):
        w.grad = torch.tensor([grad(w.detach()[0].tolist())], dtype=torch.float64)
        opt.step()
    tensors, doc = encode(named_state(opt))
    state = decode(doc, lambda key: tensors[key].clone())  # as read from a file: not shared
    assert state.correction == extra["correction"]
    twin = torch.nn.Parameter(w.detach().clone())
    fresh = build_stage_optimizer([(HIDDEN, twin)], cfg, delay=1)
    load_named_state(fresh, state)
    set_lr(opt, 0.01)
    set_lr(fresh, 0.01)
    w.grad, twin.grad = torch.ones_like(w), torch.ones_like(twin)
    opt.step()
    fresh.step()
    assert torch.equal(w, twin)
    with pytest.raises(ValueError, match=f"correction={extra['correction']}, this optimizer has"):
        load_named_state(
            build_stage_optimizer([(HIDDEN, twin)], TrainConfig(**ADAMW), delay=1), state
        )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"optim": "muon", "correction": "spike"}, "linear in the momentum"),
        ({"optim": "sgd", "correction": "spike"}, "set nesterov=false"),
        ({"correction": "nesterov", "nesterov_gamma": 1.0}, "nesterov_gamma must be"),
        ({"correction": "dc", "dc_lambda": -1.0}, "dc_lambda must be"),
    ],
)
def test_refusals_say_why(settings, message):
    with pytest.raises(ConfigError, match=message):
        build_config(settings)


# each wrapper's class and the strengths it must take from the config (non-default values)
WRAPPERS = {
    "ef": (ErrorFeedback, {"ef_gamma": 1.7}, {"gamma": 1.7}),
    "nesterov": (NesterovCorrection, {"nesterov_gamma": 0.6}, {"gamma": 0.6}),
    "spike": (SpikeCompensation, {}, {}),
    "dc": (DelayCompensation, {"dc_lambda": 0.3, "dc_mean_square_decay": 0.5}, {"lam": 0.3}),
}
# published as the paper states it, or our generalisation of the paper's idea (issue 28)
METHODS = {
    "ef": PUBLISHED,
    "nesterov": GENERALISATION,  # the paper's method is NAdam at β1 = 0.99 (optim=nadamw)
    "spike": PUBLISHED,  # for heavy-ball SGD; the AdamW form is ours
    "dc": PUBLISHED,
    "predict": GENERALISATION,  # extrapolates the applied change, not the momentum
}


def test_every_correction_is_registered_with_its_facts():
    section = {f.name for f in dataclasses.fields(SECTIONS["correction"])}
    assert set(REGISTRY) == set(METHODS)
    read = set()
    for name, correction in REGISTRY.items():
        assert correction.name == name
        assert set(correction.settings) <= section - {"correction", "ef"}, name
        read |= set(correction.settings)
        source = correction.source
        assert source.method == METHODS[name], name
        assert re.search(r"(19|20)\d\d", source.paper), f"{name}: the paper's year"
        assert (source.method == GENERALISATION) <= bool(source.ours), name
        assert (correction.wrap is None) == (correction.acts_on == "weights"), name
    assert read == section - {"correction", "ef"}  # every strength belongs to a correction
    assert "arXiv 2505.01099" in REGISTRY["nesterov"].source.paper
    assert "AdamW" in REGISTRY["spike"].source.ours


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_each_wrapper_builds_its_class_with_the_configured_strength(name):
    kind, settings, attributes = WRAPPERS[name]
    cfg = TrainConfig(**ADAMW, correction=name, schedule="2bw", **settings)
    assert set(settings) == set(REGISTRY[name].settings)
    w = torch.nn.Parameter(torch.tensor([W0], dtype=torch.float64))
    base = build_optimizer([(HIDDEN, w)], cfg)
    wrapped = REGISTRY[name].wrap(base, cfg, 2)
    assert type(wrapped) is kind and wrapped.kind == name and wrapped.base is base
    for attribute, value in attributes.items():
        assert getattr(wrapped, attribute) == value
    if hasattr(wrapped, "delays"):  # the stage's delay reaches each of its parameters
        assert wrapped.delays == {w: 2}
    if name == "dc":
        assert wrapped.decay == 0.5


# -- with predict (the gradient at ŵ, the update corrected) -------------------------------------


def _predicted_points(weights: list[float], t: int) -> float:
    """ŵ[t] = w[c] + (w[c] - w[c-1]), c = max(t - 1, 0), w[-1] = w[0] (2bw)."""
    newer, older = weights[max(t - 1, 0)], weights[max(t - 2, 0)]
    return 2 * newer - older


def test_nesterov_and_spike_combine_with_predict():
    """One scalar, f = ½·w², lr 0.5 (tests/helpers/quadratic.py): the gradient is ŵ[t]."""
    gamma = 0.5
    trainer = scalar_trainer(
        [1], correction="nesterov+predict", nesterov_gamma=gamma, schedule="2bw"
    )
    weights, u = [1.0], 0.0
    for t in range(5):
        delta = 0.5 * _predicted_points(weights, t)
        u = gamma * u + (1 - gamma) * delta
        weights.append(weights[-1] - gamma * u - (1 - gamma) * delta)
    assert column(run_steps(trainer, 5), 0) == pytest.approx(weights, rel=1e-12, abs=1e-12)

    b1, b2, eps = 0.9, 0.95, 1e-8  # the defaults; a = β1^1 under 2bw
    trainer = scalar_trainer([1], optim="adamw", correction="spike+predict", schedule="2bw")
    weights, m, v = [1.0], 0.0, 0.0
    for t in range(1, 6):
        g = _predicted_points(weights, t - 1)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        numerator = (b1 * m + (1 - b1) * g) / (1 - b1**t)
        weights.append(weights[-1] - 0.5 * numerator / (math.sqrt(v / (1 - b2**t)) + eps))
    assert column(run_steps(trainer, 5), 0) == pytest.approx(weights, rel=1e-12, abs=1e-12)
