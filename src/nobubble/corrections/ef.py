"""Error feedback, the optimizer-agnostic correction for a one-step gradient delay.

    w[t+1] = w[t] - Δ[t] - γ·(Δ[t] - Δ[t-1]),    Δ[-1] = 0

where Δ[t] = w[t] - w' is the change the base optimizer made at step t (learning rate and weight
decay included). γ = 1 gives "2Δ[t] - Δ[t-1]", γ = 0 the base optimizer unchanged. With a
heavy-ball or EMA momentum base and γ = β this is Nesterov momentum (docs/corrections.md).
"""

from __future__ import annotations

import torch

from nobubble.corrections.base import UpdateCorrection
from nobubble.corrections.response import fir
from nobubble.corrections.spec import PUBLISHED, Correction, Source
from nobubble.optim.composite import OptimizerLike


class ErrorFeedback(UpdateCorrection):
    """Wraps any optimizer; keeps one persistent buffer (Δ[t-1]) per parameter.

    The snapshot of w[t] is turned into Δ[t] in place and kept as the next buffer, so one
    transient copy of the parameters is the step's only extra memory.
    """

    kind = "ef"
    buffer_key = "prev_delta"

    def __init__(self, base: OptimizerLike, gamma: float = 1.0) -> None:
        super().__init__(base)
        self.gamma = gamma

    @property
    def prev_delta(self) -> dict[torch.Tensor, torch.Tensor]:
        return self.buffers

    def _correct(self, params: list[torch.Tensor], before: list[torch.Tensor]) -> None:
        deltas = before
        torch._foreach_sub_(deltas, params)  # Δ[t] = w[t] - w'
        prevs = self._previous(params)
        torch._foreach_sub_(prevs, deltas)  # Δ[t-1] - Δ[t]
        torch._foreach_add_(params, prevs, alpha=self.gamma)
        self.buffers.update(zip(params, deltas, strict=True))

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.base!r}, gamma={self.gamma})"


CORRECTION = Correction(
    name="ef",
    acts_on="update",
    rule="w[t+1] = w[t] - Δ[t] - γ·(Δ[t] - Δ[t-1]), γ = ef_gamma",
    memory="1 buffer (Δ[t-1]) + a transient snapshot during the step",
    needs="nothing but step() (any optimizer)",
    schedules="2bw (delay 1); runs under any",
    source=Source(
        PUBLISHED,
        "Zmushko et al. 2026, One-Step Gradient Delay is Not a Barrier for Large-Scale "
        "Asynchronous Pipeline Parallel LLM Pretraining (the error-feedback correction, γ = 1)",
        ours="γ settable (ef_gamma); the paper's correction is γ = 1",
    ),
    # a unit update is applied as 1 + γ now and -γ at the next step: mean delay -γ
    response=lambda cfg, _delay: fir(1.0 + cfg.ef_gamma, -cfg.ef_gamma),
    settings=("ef_gamma",),
    wrap=lambda opt, cfg, _delay: ErrorFeedback(opt, cfg.ef_gamma),
)
