"""The linear theory of the delay corrections: how a delayed step spreads a unit update over the
steps that follow (docs/corrections.md, "Impulse responses").

Every part of a delayed training step that is linear in the gradient is a filter in the lag
operator q (q·x[t] = x[t-1]): the schedule's gradient delay D is q^D, an optimizer's momentum
turns a gradient into updates spread over later steps (an EMA of β: (1-β)/(1-β·q)), and a delay
correction is a filter of its own (error feedback: (1+γ) - γ·q). A :class:`Response` is one such
filter, q^shift·num(q)/den(q), normalized so that a unit update is applied once in all (the
learning rate keeps its meaning); the filters of one step multiply (:meth:`Response.then`).

Two numbers read a response:

- its **mean delay**, Σ k·h[k] over its impulse response h: a correction's own is how many steps
  it moves an update (EF: -γ, ahead); the whole step's is the schedule's delay, plus the
  momentum's, plus the corrections';
- on a quadratic f = ½·h·w² (per direction of curvature h), the **largest stable step**
  a = η·h·(steady-state gain) for which x[t+1] = x[t] - a·(filter applied to x)[t] converges
  (:func:`largest_stable_step`): a plain step at sync is stable up to a = 2, a delayed one up
  to a = 1.

The theory holds where the step is linear in the gradient (SGD; Adam-family optimizers while
their second moment is constant; the momentum part of the others, :data:`MOMENTUM`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.polynomial import polynomial as P

from nobubble.config import TrainConfig

Poly = tuple[float, ...]  # coefficients, ascending powers of q


@dataclass(frozen=True)
class Response:
    """The filter q^shift·num(q)/den(q); den(0) = 1 (a causal recursion)."""

    num: Poly
    den: Poly = (1.0,)
    shift: int = 0

    def then(self, other: Response) -> Response:
        """This filter followed by ``other`` (they commute)."""
        return Response(
            _poly(P.polymul(self.num, other.num)),
            _poly(P.polymul(self.den, other.den)),
            self.shift + other.shift,
        )

    def total(self) -> float:
        """The sum of the impulse response (1 for every filter here)."""
        return P.polyval(1.0, self.num) / P.polyval(1.0, self.den)

    def mean_delay(self) -> float:
        """Σ k·h[k] / Σ h[k]: the mean number of steps an update is moved by."""
        slope = P.polyval(1.0, P.polyder(self.num)) / P.polyval(1.0, self.num)
        return self.shift + slope - P.polyval(1.0, P.polyder(self.den)) / P.polyval(1.0, self.den)

    def terms(self, count: int) -> list[float]:
        """The impulse response h[shift], h[shift + 1], ... (``count`` of them)."""
        h: list[float] = []
        for k in range(count):
            value = self.num[k] if k < len(self.num) else 0.0
            value -= sum(self.den[j] * h[k - j] for j in range(1, min(k, len(self.den) - 1) + 1))
            h.append(value / self.den[0])
        return h


def _poly(coefficients: np.ndarray) -> Poly:
    return tuple(float(c) for c in coefficients)


def delay(steps: int) -> Response:
    """The schedule's gradient delay: the gradient applied at step t was computed at w[t-D]."""
    return Response((1.0,), shift=steps)


def fir(*weights: float) -> Response:
    """A finite response: ``weights`` at lags 0, 1, ..."""
    return Response(tuple(float(w) for w in weights))


def ema(beta: float) -> Response:
    """m[t] = β·m[t-1] + (1-β)·g[t] (heavy ball, buf = β·buf + g, is the same up to 1/(1-β))."""
    return Response((1.0 - beta,), (1.0, -beta))


def ema_nesterov(beta: float) -> Response:
    """(1-β)·g[t] + β·m[t] over the EMA m (torch's SGD with nesterov, Muon's, NAdam's constant
    momentum): h = [1-β², (1-β)·β², (1-β)·β³, ...], mean delay β²/(1-β)."""
    return Response(((1.0 - beta) * (1.0 + beta), -(1.0 - beta) * beta), (1.0, -beta))


@dataclass(frozen=True)
class Momentum:
    """The momentum view of an optimizer: the linear part of its step as a response, what it
    is, and whether the whole step is linear in the gradient (then the largest stable step
    applies; else only the timing of its momentum)."""

    response: Response
    what: str
    linear: bool


MARS_GAMMA = 0.025  # pytorch_optimizer's MARS gamma, which nobubble's factory leaves as it is


def _sgd(cfg: TrainConfig) -> Momentum:
    m = cfg.momentum
    if m == 0:
        return Momentum(fir(1.0), "plain SGD (no momentum)", True)
    if cfg.nesterov:
        return Momentum(ema_nesterov(m), f"heavy ball with Nesterov, momentum {m}", True)
    return Momentum(ema(m), f"heavy ball, momentum {m}", True)


def _muon(cfg: TrainConfig) -> Momentum:
    m = cfg.momentum
    shape = ema_nesterov(m) if cfg.nesterov else ema(m)
    what = f"EMA of momentum {m}" + (" with Nesterov" if cfg.nesterov else "")
    return Momentum(shape, f"{what}, then orthogonalized", False)


def _lion(cfg: TrainConfig) -> Momentum:
    """sign(β1·m[t-1] + (1-β1)·g[t]), m the EMA of β2."""
    b1, b2 = cfg.beta1, cfg.beta2
    num = (1.0 - b1, -(1.0 - b1) * b2 + b1 * (1.0 - b2))
    what = f"β1·m + (1-β1)·g over an EMA m of β2 = {b2}, β1 = {b1}, then its sign"
    return Momentum(Response(num, (1.0, -b2)), what, False)


def _adan(cfg: TrainConfig) -> Momentum:
    """m + β2·n: m the EMA (β1) of g, n the EMA (β2) of g[t] - g[t-1] (bias corrections
    aside)."""
    b1, b2 = cfg.beta1, cfg.beta2
    first = P.polymul((1.0 - b1,), (1.0, -b2))
    second = P.polymul((b2 * (1.0 - b2),), P.polymul((1.0, -1.0), (1.0, -b1)))
    response = Response(_poly(P.polyadd(first, second)), _poly(P.polymul((1.0, -b1), (1.0, -b2))))
    return Momentum(response, f"EMA of β1 = {b1} plus β2 = {b2} times an EMA of differences", True)


def _mars(cfg: TrainConfig) -> Momentum:
    """The EMA (β1) of c = g + κ·(g[t] - g[t-1]), κ = gamma·β1/(1-β1)."""
    b1 = cfg.beta1
    kappa = MARS_GAMMA * b1 / (1.0 - b1)
    response = fir(1.0 + kappa, -kappa).then(ema(b1))
    what = f"EMA of β1 = {b1} of g + {kappa:.3g}·(g - g_prev) (c clipped to norm 1)"
    return Momentum(response, what, True)


def _ema_of(key: str, label: str):
    def view(cfg: TrainConfig) -> Momentum:
        beta = getattr(cfg, key)
        return Momentum(ema(beta), f"EMA of {label} = {beta}", True)

    return view


def _signum(cfg: TrainConfig) -> Momentum:
    m = cfg.momentum
    return Momentum(ema(m) if m else fir(1.0), f"EMA of momentum {m}, then its sign", False)


def _nadamw(cfg: TrainConfig) -> Momentum:
    what = f"(1-β1)·g + β1·m over the EMA m, β1 = {cfg.beta1}"
    if cfg.nadam_momentum_decay:
        what += " (after NAdam's momentum warm-up)"
    return Momentum(ema_nesterov(cfg.beta1), what, True)


# the linear part of each optimizer's step (nobubble.optim.registry; docs/optimizers.md), its
# steady-state gain normalized to 1: Adam's √v and SOAP's rotation held fixed
MOMENTUM = {
    "adamw": _ema_of("beta1", "β1"),
    "muon": _muon,
    "lion": _lion,
    "adan": _adan,
    "soap": _ema_of("beta1", "β1"),
    "mars": _mars,
    "signum": _signum,
    "nadamw": _nadamw,
    "sgd": _sgd,
}


def momentum(cfg: TrainConfig) -> Momentum:
    """The momentum view of ``cfg``'s optimizer."""
    return MOMENTUM[cfg.optim](cfg)


def largest_stable_step(response: Response, high: float = 1e4) -> float:
    """The largest a for which x[t+1] = x[t] - a·(``response`` applied to x)[t] converges: the
    roots in q of (1 - q)·den(q) + a·q^(shift+1)·num(q) all lie outside the unit circle. ``inf``
    if it converges for every a up to ``high``."""
    if response.shift < 0:
        raise ValueError("a gradient cannot act before it is computed (shift < 0)")

    def stable(a: float) -> bool:
        loop = P.polymul((1.0, -1.0), response.den)
        lead = P.polymul((0.0,) * (response.shift + 1) + (1.0,), response.num)
        roots = P.polyroots(P.polyadd(loop, a * lead))
        return bool(np.all(np.abs(roots) > 1.0 + 1e-12))

    a = 1e-4
    while a < high and stable(a):
        a *= 1.25
    if a >= high:
        return math.inf
    low, unstable = a / 1.25, a
    for _ in range(60):
        middle = (low + unstable) / 2
        low, unstable = (middle, unstable) if stable(middle) else (low, middle)
    return low
