"""Delay-compensated gradients (Zheng et al., ICML 2017: DC-ASGD with a constant λ).

The gradient g = ∇f(w_stale), computed at the weights the stage held when its microbatches ran
(w_stale = w[t-D] for a gradient delay of D steps), is moved towards the gradient at the weights
it is applied to by a diagonal outer-product approximation of the Hessian:

    g̃ = g + λ·g⊙g⊙(w[t] - w[t-D])

The wrapper compensates the gradient the optimizer receives (after the stage's clip) and then lets
the base optimizer step. It keeps w[t] - w[t-D] itself, as the last D applied changes of each
parameter (one tensor of D slots), so it needs nothing from the version store and computes the same
bytes in both backends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nobubble.optim.composite import OptimizerLike, evaluate_closure
from nobubble.optim.update_correction import UpdateCorrection


class DelayCompensation(UpdateCorrection):
    """Wraps any optimizer. ``buffers[p]``: p's last D applied changes, oldest first (shape
    ``(D, *p.shape)``); parameters with delay 0 have none and are left alone."""

    kind = "dc"
    buffer_key = "changes"

    def __init__(self, base: OptimizerLike, lam: float, delays: dict[torch.Tensor, int]) -> None:
        super().__init__(base)
        self.lam = lam
        self.delays = delays

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = evaluate_closure(closure)
        delayed = [p for p in self._params() if self.delays[p] > 0]
        for p in delayed:
            if p.grad is not None and p in self.buffers:
                term = self.buffers[p].sum(0)  # w[t] - w[t-D]
                term.mul_(p.grad).mul_(p.grad)
                p.grad.add_(term, alpha=self.lam)
        before = [p.detach().clone() for p in delayed]
        self.base.step()
        for p, w in zip(delayed, before, strict=True):  # every step, a skipped one included
            change = p.detach() - w
            if p not in self.buffers:
                self.buffers[p] = torch.zeros(
                    (self.delays[p], *p.shape), dtype=p.dtype, device=p.device
                )
            self.buffers[p] = torch.cat([self.buffers[p][1:], change.unsqueeze(0)])
        return loss

    def __repr__(self) -> str:
        return f"DelayCompensation({self.base!r}, lam={self.lam})"
