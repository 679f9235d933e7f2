"""Error feedback: w[t+1] = w[t] - Δ[t] - γ·(Δ[t] - Δ[t-1]), by hand and around every optimizer."""

import dataclasses
import io
import math

import pytest
import torch

from nobubble.config import TrainConfig
from nobubble.corrections.ef import ErrorFeedback
from nobubble.optim.registry import OPTIMIZERS
from nobubble.stage_update import build_stage_optimizer


def _quadratic_run(cfg: TrainConfig, w0: float, a: float, steps: int) -> float:
    """One 1-D parameter (a gain, so no weight decay) on f = ½·a·w²."""
    w = torch.nn.Parameter(torch.tensor([w0], dtype=torch.float64))
    opt = build_stage_optimizer([("norm.weight", w)], cfg, delay=1)
    for _ in range(steps):
        w.grad = a * w.detach()
        opt.step()
        opt.zero_grad()
    return w.item()


def test_plain_sgd_literal_numbers() -> None:
    # w0 = 1, a = 2, lr = 0.1, no momentum, γ = 1:
    #   t=0: w' = 1 - 0.2 = 0.8,       Δ = 0.2,   w1 = 0.8 - (0.2 - 0)      = 0.6
    #   t=1: w' = 0.6 - 0.12 = 0.48,   Δ = 0.12,  w2 = 0.48 - (0.12 - 0.2)  = 0.56
    #   t=2: w' = 0.56 - 0.112 = 0.448, Δ = 0.112, w3 = 0.448 - (0.112 - 0.12) = 0.456
    cfg = TrainConfig(optim="sgd", lr=0.1, momentum=0.0, correction="ef", ef_gamma=1.0)
    assert _quadratic_run(cfg, 1.0, 2.0, 3) == pytest.approx(0.456, abs=1e-15)


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_sgd_momentum_matches_formula(gamma: float) -> None:
    cfg = TrainConfig(
        optim="sgd", lr=0.1, momentum=0.9, nesterov=False, correction="ef", ef_gamma=gamma
    )
    w, buf, prev = 1.0, 0.0, 0.0
    for t in range(4):
        g = 2.0 * w
        buf = g if t == 0 else 0.9 * buf + g
        delta = 0.1 * buf
        w, prev = w - delta - gamma * (delta - prev), delta
    assert _quadratic_run(cfg, 1.0, 2.0, 4) == pytest.approx(w, rel=1e-13)


def test_adamw_matches_formula() -> None:
    cfg = TrainConfig(optim="adamw", lr=0.05, beta1=0.8, beta2=0.9, eps=1e-3, correction="ef")
    w, m, v, prev = 1.5, 0.0, 0.0, 0.0
    for t in range(1, 5):
        g = 3.0 * w
        m = 0.8 * m + 0.2 * g
        v = 0.9 * v + 0.1 * g * g
        delta = 0.05 * (m / (1 - 0.8**t)) / (math.sqrt(v / (1 - 0.9**t)) + 1e-3)
        w, prev = w - delta - (delta - prev), delta
    assert _quadratic_run(cfg, 1.5, 3.0, 4) == pytest.approx(w, rel=1e-13)


def test_gamma_zero_is_the_base_optimizer() -> None:
    base = TrainConfig(optim="adamw", lr=0.05)
    wrapped = TrainConfig(optim="adamw", lr=0.05, correction="ef", ef_gamma=0.0)
    assert _quadratic_run(wrapped, 1.0, 2.0, 5) == _quadratic_run(base, 1.0, 2.0, 5)


def _named_params() -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "embed.weight": (48, 16),
        "blocks.0.attn_norm.weight": (16,),
        "blocks.0.attn.wq.weight": (16, 16),
        "blocks.0.mlp.w_up.weight": (24, 16),
        "head.weight": (48, 16),
    }
    return [(n, torch.nn.Parameter(torch.randn(s, generator=gen))) for n, s in shapes.items()]


def _clone(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_composes_with_every_optimizer(optim: str) -> None:
    """Each EF step equals: step a twin of the base optimizer, then apply the formula."""
    gamma = 0.7
    cfg = TrainConfig(optim=optim, lr=1e-2, correction="ef", ef_gamma=gamma)
    named = _named_params()
    params = [p for _, p in named]
    opt = build_stage_optimizer(named, cfg, delay=1)
    assert isinstance(opt, ErrorFeedback)
    gen = torch.Generator().manual_seed(1)
    prev = [torch.zeros_like(p) for p in params]
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        twin_named = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in named]
        twin_params = [p for _, p in twin_named]
        twin_base = build_stage_optimizer(
            twin_named, dataclasses.replace(cfg, correction="none"), delay=1
        )
        twin_base.load_state_dict(_clone(opt.base.state_dict()))
        for twin, p in zip(twin_params, params, strict=True):
            twin.grad = p.grad.clone()
        twin_base.step()
        before = [p.detach().clone() for p in params]
        opt.step()
        for i, (p, w, w_base) in enumerate(zip(params, before, twin_params, strict=True)):
            delta = w - w_base.detach()
            torch.testing.assert_close(p.detach(), w_base - gamma * (delta - prev[i]))
            prev[i] = delta


def test_state_dict_holds_one_buffer_per_parameter() -> None:
    """Each parameter's buffer is its Δ[0], known from the weights alone: at γ = 1 and
    Δ[-1] = 0 the first step is w[1] = w[0] - 2·Δ[0]."""
    named = _named_params()
    opt = build_stage_optimizer(named, TrainConfig(optim="sgd", lr=0.1, correction="ef"), delay=1)
    for _, p in named:
        p.grad = torch.ones_like(p)
    ordered = [p for group in opt.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in ordered]
    opt.step()
    state = opt.state_dict()
    assert sorted(state["prev_delta"]) == list(range(len(named)))
    for i, p in enumerate(ordered):
        delta = (before[i] - p.detach()) / 2
        assert delta.abs().max() > 0  # the step moved every parameter
        torch.testing.assert_close(state["prev_delta"][i], delta, rtol=1e-6, atol=0)
    fresh_named = _named_params()
    fresh = build_stage_optimizer(
        fresh_named, TrainConfig(optim="sgd", lr=0.1, correction="ef"), delay=1
    )
    fresh.load_state_dict(_clone(state))
    fresh_ordered = [p for group in fresh.param_groups for p in group["params"]]
    for p, q in zip(ordered, fresh_ordered, strict=True):
        assert torch.equal(fresh.prev_delta[q], opt.prev_delta[p])


def test_loading_a_state_dict_without_buffers_says_why() -> None:
    named = _named_params()
    plain = build_stage_optimizer(named, TrainConfig(optim="sgd"), delay=1)
    wrapped = build_stage_optimizer(named, TrainConfig(optim="sgd", correction="ef"), delay=1)
    with pytest.raises(ValueError, match="without correction=ef"):
        wrapped.load_state_dict(plain.state_dict())


def test_step_without_gradients_changes_nothing() -> None:
    named = _named_params()
    before = [p.detach().clone() for _, p in named]
    opt = build_stage_optimizer(named, TrainConfig(optim="adamw", correction="ef"), delay=1)
    opt.step()
    assert all(torch.equal(p, b) for (_, p), b in zip(named, before, strict=True))
    assert opt.prev_delta == {}
