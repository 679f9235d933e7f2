"""The discounted Nesterov correction for asynchronous pipelines (Ajanthan et al., ICML 2025).

A Nesterov look-ahead in weight space over the base optimizer's change Δ[t], with the gradient
step scaled by (1 - γ) (docs/corrections.md):

    u[t]   = γ·u[t-1] + (1 - γ)·Δ[t],          u[-1] = 0
    w[t+1] = w[t] - γ·u[t] - (1 - γ)·Δ[t]
"""

from __future__ import annotations

import torch

from nobubble.corrections.base import UpdateCorrection
from nobubble.corrections.response import Response
from nobubble.corrections.spec import GENERALISATION, Correction, Source
from nobubble.optim.composite import OptimizerLike


class NesterovCorrection(UpdateCorrection):
    """Wraps any optimizer; keeps one buffer (the velocity u[t-1]) per parameter.

    With w' = w[t] - Δ[t] the base result, w[t+1] = w' + γ²·(Δ[t] - u[t-1]): the snapshot
    becomes Δ[t] and then u[t] in place, the step's only transient memory.
    """

    kind = "nesterov"
    buffer_key = "velocity"

    def __init__(self, base: OptimizerLike, gamma: float) -> None:
        super().__init__(base)
        self.gamma = gamma

    def _correct(self, params: list[torch.Tensor], before: list[torch.Tensor]) -> None:
        deltas = before
        torch._foreach_sub_(deltas, params)  # Δ[t]
        prevs = self._previous(params)
        torch._foreach_sub_(prevs, deltas)  # u[t-1] - Δ[t]
        torch._foreach_add_(params, prevs, alpha=-self.gamma * self.gamma)
        torch._foreach_add_(deltas, prevs, alpha=self.gamma)  # u[t] = Δ + γ·(u[t-1] - Δ)
        self.buffers.update(zip(params, deltas, strict=True))

    def __repr__(self) -> str:
        return f"NesterovCorrection({self.base!r}, gamma={self.gamma})"


def response(gamma: float) -> Response:
    """(1-γ)·(1 + γ - γ·q)/(1 - γ·q): h = [1-γ², (1-γ)·γ², (1-γ)·γ³, ...], mean delay γ²/(1-γ)
    (8.1 steps at γ = 0.9): a second, slower momentum over the base optimizer's."""
    return Response(((1 - gamma) * (1 + gamma), -(1 - gamma) * gamma), (1.0, -gamma))


CORRECTION = Correction(
    name="nesterov",
    acts_on="update",
    rule="u[t] = γ·u[t-1] + (1-γ)·Δ[t]; w[t+1] = w[t] - γ·u[t] - (1-γ)·Δ[t], γ = nesterov_gamma",
    memory="1 buffer (u[t-1]) + a transient snapshot during the step",
    needs="nothing but step() (any optimizer)",
    schedules="2bw, pipedream; runs under any",
    source=Source(
        GENERALISATION,
        "Ajanthan et al., Nesterov Method for Asynchronous Pipeline Parallel Optimization, "
        "ICML 2025, arXiv 2505.01099",
        ours=(
            "their method is NAdam with β1 = 0.99 at the optimizer level (their code; here "
            "optim=nadamw beta1=0.99 nadam_momentum_decay=0.004); this wraps any optimizer's "
            "update in a second, discounted momentum"
        ),
    ),
    response=lambda cfg, _delay: response(cfg.nesterov_gamma),
    settings=("nesterov_gamma",),
    wrap=lambda opt, cfg, _delay: NesterovCorrection(opt, cfg.nesterov_gamma),
)
