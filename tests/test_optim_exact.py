"""SGD, AdamW and NAdamW on a quadratic, checked against formulas written out by hand.

f = ½·a·w² per element, so g = a·w. One 2-D hidden matrix (weight-decayed) and one 1-D norm
gain (never decayed), in float64 so the library must match the formulas to ~1e-15.
"""

import math

import pytest
import torch

from nobubble.config import TrainConfig
from nobubble.optim.registry import build_optimizer

A_MATRIX, A_GAIN = 2.0, 3.0


def _params() -> list[tuple[str, torch.nn.Parameter]]:
    matrix = torch.nn.Parameter(torch.tensor([[1.0, -0.5], [0.25, 2.0]], dtype=torch.float64))
    gain = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    return [("blocks.0.mlp.w_up.weight", matrix), ("blocks.0.mlp_norm.weight", gain)]


def _run(cfg: TrainConfig, steps: int) -> list[list[float]]:
    """Final values of [matrix elements, gain elements] after ``steps`` updates."""
    named = _params()
    opt = build_optimizer(named, cfg)
    (_, matrix), (_, gain) = named
    for _ in range(steps):
        matrix.grad = A_MATRIX * matrix.detach()
        gain.grad = A_GAIN * gain.detach()
        opt.step()
        opt.zero_grad()
    return [matrix.detach().flatten().tolist(), gain.detach().tolist()]


def _initial() -> list[list[float]]:
    return [p.detach().flatten().tolist() for _, p in _params()]


def _by_hand(update, cfg: TrainConfig, steps: int) -> list[list[float]]:
    """Apply ``update(w, a, wd, state, t) -> w`` elementwise, decaying only the matrix."""
    out = []
    for values, a, wd in zip(_initial(), (A_MATRIX, A_GAIN), (cfg.weight_decay, 0.0), strict=True):
        finals = []
        for w in values:
            state: dict = {}
            for t in range(1, steps + 1):
                w = update(w, a, wd, state, t)
            finals.append(w)
        out.append(finals)
    return out


def _assert_close(got: list[list[float]], want: list[list[float]], rel: float = 1e-13) -> None:
    for g_row, w_row in zip(got, want, strict=True):
        assert g_row == pytest.approx(w_row, rel=rel, abs=1e-15)


def test_sgd_nesterov_two_steps_literal_numbers() -> None:
    # Matrix element w=1, a=2, wd=0.5, lr=0.1, μ=0.5, Nesterov, torch's L2-style decay:
    #   t=0: g = 2·1 + 0.5·1 = 2.5, buf = 2.5, d = 2.5 + 0.5·2.5 = 3.75, w = 1 - 0.375 = 0.625
    #   t=1: g = 2.5·0.625 = 1.5625, buf = 1.25 + 1.5625 = 2.8125,
    #        d = 1.5625 + 1.40625 = 2.96875, w = 0.625 - 0.296875 = 0.328125
    # Gain element w=1, a=3, no decay:
    #   t=0: g = 3, buf = 3, d = 4.5, w = 0.55
    #   t=1: g = 1.65, buf = 1.5 + 1.65 = 3.15, d = 1.65 + 1.575 = 3.225, w = 0.55 - 0.3225 = 0.2275
    cfg = TrainConfig(optim="sgd", lr=0.1, momentum=0.5, nesterov=True, weight_decay=0.5)
    matrix, gain = _run(cfg, 2)
    assert matrix[0] == pytest.approx(0.328125, abs=1e-15)
    assert gain[0] == pytest.approx(0.2275, abs=1e-15)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_matches_formula(nesterov: bool) -> None:
    cfg = TrainConfig(optim="sgd", lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.1)

    def update(w, a, wd, state, t):
        g = a * w + wd * w
        buf = g if t == 1 else cfg.momentum * state["buf"] + g
        state["buf"] = buf
        return w - cfg.lr * (g + cfg.momentum * buf if nesterov else buf)

    _assert_close(_run(cfg, 3), _by_hand(update, cfg, 3))


def test_adamw_first_step_literal_numbers() -> None:
    # First Adam step: m̂ = g, v̂ = g², so the update is lr·sign(g) (eps = 0).
    # Matrix: w = 1·(1 - 0.1·0.5) - 0.1 = 0.85. Gain (no decay): w = 1 - 0.1 = 0.9.
    cfg = TrainConfig(optim="adamw", lr=0.1, beta1=0.5, beta2=0.75, eps=0.0, weight_decay=0.5)
    matrix, gain = _run(cfg, 1)
    assert matrix[0] == pytest.approx(0.85, abs=1e-15)
    assert gain[0] == pytest.approx(0.9, abs=1e-15)


def _adam_moments(state: dict, g: float, b1: float, b2: float) -> tuple[float, float]:
    """Adam's first and second moments after gradient ``g``, updated in ``state``."""
    m = b1 * state.get("m", 0.0) + (1 - b1) * g
    v = b2 * state.get("v", 0.0) + (1 - b2) * g * g
    state.update(m=m, v=v)
    return m, v


def test_adamw_matches_formula() -> None:
    cfg = TrainConfig(optim="adamw", lr=0.02, beta1=0.8, beta2=0.9, eps=1e-3, weight_decay=0.3)
    b1, b2 = cfg.beta1, cfg.beta2

    def update(w, a, wd, state, t):
        g = a * w
        m, v = _adam_moments(state, g, b1, b2)
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        return w * (1 - cfg.lr * wd) - cfg.lr * m_hat / (math.sqrt(v_hat) + cfg.eps)

    _assert_close(_run(cfg, 3), _by_hand(update, cfg, 3))


def test_nadamw_is_nesterov_adamw_with_constant_momentum() -> None:
    cfg = TrainConfig(optim="nadamw", lr=0.02, beta1=0.8, beta2=0.9, eps=1e-3, weight_decay=0.3)
    b1, b2 = cfg.beta1, cfg.beta2

    def update(w, a, wd, state, t):
        g = a * w
        m, v = _adam_moments(state, g, b1, b2)
        denom = math.sqrt(v / (1 - b2**t)) + cfg.eps
        # Nesterov look-ahead: (1-β1)·g/(1-β1^t) + β1·m/(1-β1^(t+1)), with μ = β1 every step
        lookahead = (1 - b1) * g / (1 - b1**t) + b1 * m / (1 - b1 ** (t + 1))
        return w * (1 - cfg.lr * wd) - cfg.lr * lookahead / denom

    # torch keeps NAdam's running product of μ as a float32 scalar whatever the parameter dtype
    _assert_close(_run(cfg, 4), _by_hand(update, cfg, 4), rel=1e-7)


def test_nadamw_momentum_warmup_follows_dozats_schedule() -> None:
    """nadam_momentum_decay=ψ restores NAdam's warm-up μ_t = β1·(1 − ½·0.96^(tψ)) (the setting
    of Ajanthan et al.'s asynchronous-pipeline runs); a large ψ shows the warm-up in 4 steps."""
    cfg = TrainConfig(
        optim="nadamw",
        lr=0.02,
        beta1=0.8,
        beta2=0.9,
        eps=1e-3,
        weight_decay=0.3,
        nadam_momentum_decay=5.0,
    )
    b1, b2 = cfg.beta1, cfg.beta2

    def mu(t: int) -> float:
        return b1 * (1 - 0.5 * 0.96 ** (t * cfg.nadam_momentum_decay))

    def update(w, a, wd, state, t):
        g = a * w
        m, v = _adam_moments(state, g, b1, b2)
        product = state.get("mu_product", 1.0) * mu(t)
        state["mu_product"] = product
        denom = math.sqrt(v / (1 - b2**t)) + cfg.eps
        lookahead = (1 - mu(t)) * g / (1 - product) + mu(t + 1) * m / (1 - product * mu(t + 1))
        return w * (1 - cfg.lr * wd) - cfg.lr * lookahead / denom

    got = _run(cfg, 4)
    _assert_close(got, _by_hand(update, cfg, 4), rel=1e-7)
    constant = _run(TrainConfig(**{**cfg.__dict__, "nadam_momentum_decay": 0.0}), 4)
    assert got[0] != pytest.approx(constant[0], rel=1e-4)  # the warm-up really changed the steps
