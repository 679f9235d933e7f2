"""The linear theory of the delay corrections (docs/corrections.md, "Impulse responses"): each
correction's response to a unit update and its mean delay, written out by hand, and the
responses held against what the optimizers and the correction wrappers really do with a unit
gradient."""

import math

import pytest
import torch

from nobubble.cli import main
from nobubble.config import TrainConfig
from nobubble.corrections import dc, predict, spike
from nobubble.corrections.registry import REGISTRY, step_response
from nobubble.corrections.response import (
    MOMENTUM,
    delay,
    ema,
    ema_nesterov,
    fir,
    largest_stable_step,
    momentum,
)
from nobubble.optim.muon import momentum_direction
from nobubble.optim.registry import OPTIMIZERS
from nobubble.stage_update import build_stage_optimizer
from tests.helpers.commands import line_with


def _close(values, expected):
    assert values == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0])
def test_ef_applies_one_plus_gamma_now_and_minus_gamma_next(gamma):
    response = REGISTRY["ef"].response(TrainConfig(ef_gamma=gamma), 1)
    _close(response.terms(4), [1 + gamma, -gamma, 0, 0])
    assert response.mean_delay() == pytest.approx(-gamma)  # γ = 1 cancels 2bw's one step


def test_the_nesterov_wrapper_is_a_second_slower_momentum():
    g = 0.9
    response = REGISTRY["nesterov"].response(TrainConfig(nesterov_gamma=g), 1)
    _close(response.terms(4), [1 - g**2, (1 - g) * g**2, (1 - g) * g**3, (1 - g) * g**4])
    assert response.mean_delay() == pytest.approx(g**2 / (1 - g))  # 8.1 steps late
    assert response.total() == pytest.approx(1.0)


@pytest.mark.parametrize("d", [1, 3])
def test_predict_extrapolates_over_the_delay(d):
    """(1 + D)·g(w[c]) - D·g(w[c-1]) on a quadratic: mean -D, the delay cancelled."""
    response = predict.response(d)
    _close(response.terms(3), [1 + d, -d, 0])
    assert d + response.mean_delay() == pytest.approx(0.0)
    _close(predict.response(0).terms(2), [1, 0])


def test_dc_mixes_the_fresh_gradient_in_by_its_share_of_the_curvature():
    response = dc.response(2, share=0.25)  # 0.25 of the gradient at w[t], 0.75 at w[t-2]
    assert response.shift == -2
    _close(response.terms(3), [0.25, 0.0, 0.75])
    assert response.mean_delay() == pytest.approx(-0.25 * 2)
    assert REGISTRY["dc"].response(TrainConfig(), 2).mean_delay() == 0.0  # λ·g² << h: nothing


@pytest.mark.parametrize(("optim", "key"), [("adamw", "beta1"), ("sgd", "momentum")])
@pytest.mark.parametrize("d", [1, 3])
def test_spike_applies_the_missed_momentum_at_once(optim, key, d):
    """Over the optimizer's EMA of β, a·m[t] + (1 - a)·g[t] with a = β^D: a unit gradient gives
    a·(1 - β) + (1 - a) now and a·(1 - β)·β^k k steps later."""
    beta = 0.8
    cfg = TrainConfig(optim=optim, nesterov=False, **{key: beta})
    response = ema(beta).then(spike.response(cfg, d))
    a = beta**d
    _close(
        response.terms(4), [a * (1 - beta) + 1 - a] + [a * (1 - beta) * beta**k for k in (1, 2, 3)]
    )
    gamma = beta * (1 - beta**d) / (1 - beta)  # under 2bw: EF at γ = β
    _close(spike.response(cfg, d).terms(2), [1 + gamma, -gamma])


def test_each_optimizers_momentum_view_and_its_mean_delay():
    b1, b2, m = 0.9, 0.95, 0.95
    means = {
        "adamw": b1 / (1 - b1),
        "soap": b1 / (1 - b1),
        "nadamw": b1**2 / (1 - b1),
        "muon": m**2 / (1 - m),  # nesterov on by default
        "sgd": m**2 / (1 - m),
        "signum": m / (1 - m),
        "lion": b1 / (1 - b2),  # β1·m[t-1] + (1-β1)·g[t], m the EMA of β2
        "adan": b1 / (1 - b1) - b2,  # + β2 times an EMA of differences
        "mars": b1 / (1 - b1) - 0.025 * b1 / (1 - b1),
    }
    assert set(MOMENTUM) == set(OPTIMIZERS) == set(means)
    for optim, mean in means.items():
        view = momentum(TrainConfig(optim=optim))
        assert view.response.total() == pytest.approx(1.0), optim
        assert view.response.mean_delay() == pytest.approx(mean), optim
    assert momentum(
        TrainConfig(optim="muon", nesterov=False)
    ).response.mean_delay() == pytest.approx(19)
    assert not momentum(TrainConfig(optim="muon")).linear


def _impulse(opt, param: torch.Tensor, steps: int) -> list[float]:
    """The weight changes after a unit gradient at step 0 and zero gradients after it."""
    changes = []
    for t in range(steps):
        param.grad = torch.full_like(param, 1.0 if t == 0 else 0.0)
        before = param.item()
        opt.step()
        changes.append(before - param.item())
    return changes


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"momentum": 0.0}, fir(1.0)),
        ({"momentum": 0.8, "nesterov": False}, ema(0.8)),
        ({"momentum": 0.8, "nesterov": True}, ema_nesterov(0.8)),
    ],
    ids=["plain", "heavy-ball", "nesterov"],
)
def test_the_momentum_view_is_what_torchs_sgd_does(settings, expected):
    cfg = TrainConfig(optim="sgd", lr=1.0, weight_decay=0.0, **settings)
    w = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    changes = _impulse(build_stage_optimizer([("norm.weight", w)], cfg, delay=1), w, 5)
    gain = 1 / (1 - settings["momentum"])  # torch's steps add up to lr/(1 - m)
    _close([c / gain for c in changes], momentum(cfg).response.terms(5))
    _close(momentum(cfg).response.terms(5), expected.terms(5))


@pytest.mark.parametrize("nesterov_on", [True, False])
def test_the_momentum_view_is_what_muon_does_before_orthogonalizing(nesterov_on):
    cfg = TrainConfig(optim="muon", momentum=0.9, nesterov=nesterov_on)
    buffer = torch.zeros(1, dtype=torch.float64)
    directions = [  # (the buffer itself without nesterov: read each at once)
        momentum_direction(torch.tensor([float(t == 0)]).double(), buffer, 0.9, nesterov_on).item()
        for t in range(5)
    ]
    _close(directions, momentum(cfg).response.terms(5))


@pytest.mark.parametrize(
    ("correction", "settings"),
    [("ef", {"ef_gamma": 1.5}), ("nesterov", {"nesterov_gamma": 0.7})],
)
def test_the_wrappers_spread_a_unit_update_as_their_responses_say(correction, settings):
    """Plain SGD (a step of lr·g) wrapped: a unit gradient's changes are the response."""
    cfg = TrainConfig(optim="sgd", lr=1.0, momentum=0.0, correction=correction, **settings)
    w = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    changes = _impulse(build_stage_optimizer([("norm.weight", w)], cfg, delay=1), w, 6)
    _close(changes, REGISTRY[correction].response(cfg, 1).terms(6))


@pytest.mark.parametrize("d", [1, 2])
def test_spike_spreads_a_unit_gradient_as_its_response_says(d):
    m = 0.8
    cfg = TrainConfig(
        optim="sgd", lr=1.0, momentum=m, nesterov=False, weight_decay=0.0, correction="spike"
    )
    w = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    changes = _impulse(build_stage_optimizer([("norm.weight", w)], cfg, delay=d), w, 6)
    whole = momentum(cfg).response.then(spike.response(cfg, d))
    _close([c * (1 - m) for c in changes], whole.terms(6))


def test_the_largest_stable_step_on_a_quadratic_by_hand():
    """x[t+1] = x[t] - a·x[t]: stable below a = 2; one step late (z² - z + a: |z|² = a) below
    1; an EMA of β at sync below 2(1 + β)/(1 - β) (a root at z = -1), and one step late below 1
    whatever β (complex roots of product β + a(1 - β))."""
    assert largest_stable_step(fir(1.0)) == pytest.approx(2.0, rel=1e-9)
    assert largest_stable_step(delay(1)) == pytest.approx(1.0, rel=1e-9)
    for beta in (0.5, 0.9):
        assert largest_stable_step(ema(beta)) == pytest.approx(2 * (1 + beta) / (1 - beta))
        assert largest_stable_step(delay(1).then(ema(beta))) == pytest.approx(1.0, rel=1e-9)
    assert largest_stable_step(fir(1.0), high=1.5) == math.inf


def test_the_whole_step_adds_the_delay_the_momentum_and_the_corrections():
    cfg = TrainConfig(optim="adamw", schedule="2bw", correction="ef+predict", ef_gamma=1.5)
    assert step_response(cfg, 1).mean_delay() == pytest.approx(1 + 9 - 1.5 - 1)
    plain = TrainConfig(optim="adamw", schedule="2bw", correction="nesterov")
    assert step_response(plain, 1).mean_delay() == pytest.approx(1 + 9 + 8.1)
    # the wrapper over AdamW: less stable than no correction at all; EF more
    none = largest_stable_step(step_response(TrainConfig(optim="adamw"), 1))
    assert largest_stable_step(step_response(plain, 1)) < none < 2.5
    assert largest_stable_step(step_response(TrainConfig(optim="adamw", correction="ef"), 1)) > 2.5


def test_nobubble_corrections_prints_each_response_and_the_auto_choice(capsys):
    assert main(["corrections", "optim=adamw", "schedule=2bw", "--sources"]) == 0
    out = capsys.readouterr().out
    assert "9.00" in line_with(out, "β1 = 0.9", "mean delay")  # the momentum's own delay
    assert "stable step without a delay (sync): 38" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    assert rows["ef"][2:5] == ["2,", "-1", "-1.00"]
    assert rows["nesterov"][-4:-2] == ["+8.10", "9.10"]
    assert rows["dc+predict"][1] == "refused:"
    assert line_with(out, "correction=auto", "adamw", "2bw", "ef (ef_gamma=2.0)")
    assert "our generalisation: Ajanthan et al." in out

    assert main(["corrections", "optim=adamw", "ef_gamma=1.5"]) == 0  # a strength of one's own
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    assert rows["ef"][1:4] == ["ef_gamma=1.5", "2.5,", "-1.5"]

    assert main(["corrections", "optim=muon", "schedule=pipedream", "stages=3"]) == 0
    out = capsys.readouterr().out
    assert "gradient delay per model stage [2, 1, 0]" in out
    assert "not linear in the gradient" in out
    assert "delay 2 (model stages 0):" in out
    assert "spike  " in out and "refused: correction spike" in out
