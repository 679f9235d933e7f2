"""Delay-compensated gradients (Zheng et al., ICML 2017: DC-ASGD, constant or adaptive λ).

The gradient g = ∇f(w_stale), computed at the weights the stage held when its microbatches ran
(w_stale = w[t-D] for a gradient delay of D steps), is moved towards the gradient at the weights
it is applied to by a diagonal outer-product approximation of the Hessian:

    g̃ = g + λ·g⊙g⊙(w[t] - w[t-D])

The adaptive variant (DC-ASGD-a, ``dc_mean_square_decay`` m > 0) scales λ per element by a
running mean square of the gradient, as the authors' reference implementation does (the mean
square updated with the current gradient first):

    ms[t] = m·ms[t-1] + (1 - m)·g⊙g,    g̃ = g + λ/√(ms[t] + ε)·g⊙g⊙(w[t] - w[t-D])

The wrapper compensates the gradient the optimizer receives (after the stage's clip) and then lets
the base optimizer step. It keeps w[t] - w[t-D] itself, as the last D applied changes of each
parameter (one tensor of D slots, and the mean square in one more slot for the adaptive variant),
so it needs nothing from the version store and computes the same bytes in both backends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nobubble.config import TrainConfig, correction_names
from nobubble.corrections.base import UpdateCorrection
from nobubble.corrections.response import Response
from nobubble.corrections.spec import PUBLISHED, Correction, Source
from nobubble.optim.composite import OptimizerLike, evaluate_closure

EPS = 1e-7  # under the square root of the adaptive variant, as in the reference implementation


class DelayCompensation(UpdateCorrection):
    """Wraps any optimizer. ``buffers[p]``: p's last D applied changes, oldest first, then (the
    adaptive variant) the gradient's mean square: shape ``(D, *p.shape)`` or ``(D + 1, ...)``;
    parameters with delay 0 have none and are left alone."""

    kind = "dc"
    buffer_key = "changes"

    def __init__(
        self,
        base: OptimizerLike,
        lam: float,
        delays: dict[torch.Tensor, int],
        mean_square_decay: float = 0.0,
    ) -> None:
        super().__init__(base)
        self.lam = lam
        self.delays = delays
        self.decay = mean_square_decay  # 0: DC-ASGD-c, constant λ

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = evaluate_closure(closure)
        delayed = [p for p in self._params() if self.delays[p] > 0]
        for p in delayed:
            if p.grad is None:
                continue
            if p not in self.buffers:
                slots = self.delays[p] + (1 if self.decay else 0)
                self.buffers[p] = torch.zeros((slots, *p.shape), dtype=p.dtype, device=p.device)
            buffer, d = self.buffers[p], self.delays[p]
            term = buffer[:d].sum(0)  # w[t] - w[t-D]
            term.mul_(p.grad).mul_(p.grad)
            if self.decay:
                mean_square = buffer[d]
                mean_square.mul_(self.decay).addcmul_(p.grad, p.grad, value=1 - self.decay)
                term.div_(mean_square.add(EPS).sqrt_())
            p.grad.add_(term, alpha=self.lam)
        before = [p.detach().clone() for p in delayed]
        self.base.step()
        for p, w in zip(delayed, before, strict=True):  # every step, a skipped one included
            change = (p.detach() - w).unsqueeze(0)
            if p not in self.buffers:  # no gradient yet: nothing to compensate, nothing learnt
                slots = self.delays[p] + (1 if self.decay else 0)
                self.buffers[p] = torch.zeros((slots, *p.shape), dtype=p.dtype, device=p.device)
            buffer, d = self.buffers[p], self.delays[p]
            self.buffers[p] = torch.cat([buffer[1:d], change, buffer[d:]])
        return loss

    def __repr__(self) -> str:
        return f"DelayCompensation({self.base!r}, lam={self.lam}, decay={self.decay})"


def response(delay: int, share: float = 0.0) -> Response:
    """On a quadratic of curvature h the exact compensation is g + h·(w[t] - w[t-D]); dc's
    λ·g⊙g stands for h, and ``share`` = λ·g²/h says how much of it (1: exact). The gradient
    is then (1 - share) of the stale one and ``share`` of the fresh one: relative to the delay,
    (1 - share) + share·q^-D, mean delay -share·D. At our gradient scales λ·g² is far below h
    (docs/corrections.md): share ≈ 0, nothing changes."""
    if delay == 0 or share == 0:
        return Response((1.0,))
    return Response((share,) + (0.0,) * (delay - 1) + (1.0 - share,), shift=-delay)


def _refuses(cfg: TrainConfig) -> str | None:
    if "predict" in correction_names(cfg):
        return (
            "dc compensates for the distance from the stale weights the gradient was computed at, "
            "and predict computes it elsewhere (at ŵ); drop one of them"
        )
    return None


def _wrap(optimizer: OptimizerLike, cfg: TrainConfig, delay: int) -> DelayCompensation:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    delays = dict.fromkeys(params, delay)
    return DelayCompensation(optimizer, cfg.dc_lambda, delays, cfg.dc_mean_square_decay)


CORRECTION = Correction(
    name="dc",
    acts_on="gradient",
    rule="g̃ = g + λ·g⊙g⊙(w[t] - w[t-D]), λ = dc_lambda; with dc_mean_square_decay m > 0, "
    "λ/√(ms + ε), ms = m·ms + (1-m)·g⊙g",
    memory="D buffers (the last D applied changes), one more for the adaptive variant's "
    "mean square, + a transient snapshot during the step",
    needs="nothing but step() (any optimizer)",
    schedules="2bw, pipedream; nothing to do at delay 0",
    source=Source(
        PUBLISHED,
        "Zheng et al., Asynchronous Stochastic Gradient Descent with Delay Compensation, "
        "ICML 2017, arXiv 1609.08326 (DC-ASGD-c and -a)",
    ),
    response=lambda _cfg, delay: response(delay),
    settings=("dc_lambda", "dc_mean_square_decay"),
    refuses=_refuses,
    wrap=_wrap,
)
