"""Error feedback, the optimizer-agnostic correction for a one-step gradient delay.

    w[t+1] = w[t] - Δ[t] - γ·(Δ[t] - Δ[t-1]),    Δ[-1] = 0

where Δ[t] = w[t] - w' is the change the base optimizer made at step t (learning rate and weight
decay included). γ = 1 gives "2Δ[t] - Δ[t-1]", γ = 0 the base optimizer unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nobubble.optim.composite import OptimizerLike, evaluate_closure


class ErrorFeedback:
    """Wraps any optimizer; keeps one persistent buffer (Δ[t-1]) per parameter.

    The step needs w[t] after the base optimizer has overwritten it, so it snapshots the
    parameters first; the snapshot is turned into Δ[t] in place and kept as the next buffer, so
    one transient copy of the parameters is the step's only extra memory. A parameter without a
    gradient is skipped, as torch optimizers skip it.
    """

    def __init__(self, base: OptimizerLike, gamma: float = 1.0) -> None:
        self.base = base
        self.gamma = gamma
        self.prev_delta: dict[torch.Tensor, torch.Tensor] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.base.param_groups

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = evaluate_closure(closure)
        params = [p for p in self._params() if p.grad is not None]
        deltas = [p.detach().clone() for p in params]  # w[t]
        self.base.step()
        if not params:  # torch's foreach ops reject empty lists
            return loss
        torch._foreach_sub_(deltas, params)  # Δ[t] = w[t] - w'
        prevs = [
            self.prev_delta[p] if p in self.prev_delta else torch.zeros_like(p) for p in params
        ]
        torch._foreach_sub_(prevs, deltas)  # Δ[t-1] - Δ[t]
        torch._foreach_add_(params, prevs, alpha=self.gamma)
        self.prev_delta.update(zip(params, deltas, strict=True))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's state dict and the Δ buffers keyed by parameter position."""
        index = {p: i for i, p in enumerate(self._params())}
        buffers = {index[p]: delta for p, delta in self.prev_delta.items()}
        return {"base": self.base.state_dict(), "prev_delta": buffers}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "prev_delta" not in state_dict:
            raise ValueError(
                "state dict has no error-feedback buffers: it was saved without ef=true"
            )
        self.base.load_state_dict(state_dict["base"])
        params = self._params()
        self.prev_delta = {
            params[i]: delta.to(device=params[i].device, dtype=params[i].dtype, copy=True)
            for i, delta in state_dict["prev_delta"].items()
        }

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.base!r}, gamma={self.gamma})"
