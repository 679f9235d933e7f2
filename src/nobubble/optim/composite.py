"""Several torch optimizers over disjoint parameters, driven as one optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class OptimizerLike(Protocol):
    """What the training loop uses: a torch optimizer, a composite or an error-feedback wrapper."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def step(self, closure: Callable[[], Any] | None = None) -> Any: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def evaluate_closure(closure: Callable[[], Any] | None) -> Any:
    """Run a ``step(closure)`` closure once, before any part of a combined step."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class CompositeOptimizer:
    """E.g. Muon on the hidden matrices plus AdamW on the rest.

    ``param_groups`` lists every part's groups (live dicts, so setting ``lr`` works); the state
    dict holds one state dict per part, in order.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("a composite optimizer needs at least one optimizer")
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = evaluate_closure(closure)
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        parts = state_dict["optimizers"]
        if len(parts) != len(self.optimizers):
            raise ValueError(
                f"state dict holds {len(parts)} optimizers but this composite has "
                f"{len(self.optimizers)}; it was saved for a different optimizer or stage"
            )
        for opt, part in zip(self.optimizers, parts, strict=True):
            opt.load_state_dict(part)

    def __repr__(self) -> str:
        names = ", ".join(type(opt).__name__ for opt in self.optimizers)
        return f"CompositeOptimizer({names})"
