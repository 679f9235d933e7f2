"""The shape every update-side delay correction shares: a wrapper around any optimizer.

The wrapper snapshots w[t], lets the base optimizer step (its own state built from the gradients
as usual), and then corrects each parameter that had a gradient from the snapshot, the base
optimizer's result and a persistent buffer of its own (one tensor per parameter, or none). What
each correction computes is in its subclass; which corrections exist is in
:mod:`nobubble.corrections.registry`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor

from nobubble.optim.composite import OptimizerLike, evaluate_closure


class UpdateCorrection:
    """Base of ErrorFeedback, NesterovCorrection, SpikeCompensation.

    ``buffers`` maps a parameter to its persistent buffer; :attr:`kind` (the correction's name)
    labels them in state dicts and checkpoints. A parameter without a gradient is skipped (weights
    and buffer unchanged), as torch optimizers skip it. The step's only transient memory is the
    snapshot of w[t], which a subclass may keep as the next buffer.
    """

    kind: ClassVar[str]
    buffer_key: ClassVar[str]  # the key of the buffers in state_dict()

    def __init__(self, base: OptimizerLike) -> None:
        self.base = base
        self.buffers: dict[torch.Tensor, torch.Tensor] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.base.param_groups

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = evaluate_closure(closure)
        params = [p for p in self._params() if p.grad is not None]
        before = [p.detach().clone() for p in params]  # w[t]
        self.base.step()
        # torch's foreach ops reject empty lists, and lists that mix tensor-parallel DTensor
        # shards with plain tensors: one call per kind (the rules are element-wise)
        for split in (False, True):
            kind = [i for i, p in enumerate(params) if isinstance(p, DTensor) == split]
            if kind:
                self._correct([params[i] for i in kind], [before[i] for i in kind])
        return loss

    def _correct(self, params: list[torch.Tensor], before: list[torch.Tensor]) -> None:
        """Turn the base optimizer's result (``params``) into the corrected w[t+1]; ``before``
        holds w[t] and may be reused."""
        raise NotImplementedError

    def _previous(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each parameter's buffer, zeros before its first step."""
        return [self.buffers[p] if p in self.buffers else torch.zeros_like(p) for p in params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's state dict and the buffers keyed by parameter position."""
        index = {p: i for i, p in enumerate(self._params())}
        buffers = {index[p]: buffer for p, buffer in self.buffers.items()}
        return {"base": self.base.state_dict(), self.buffer_key: buffers}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.buffer_key not in state_dict:
            raise ValueError(
                f"state dict has no {self.kind} buffers ({self.buffer_key}): it was saved without "
                f"correction={self.kind}"
            )
        self.base.load_state_dict(state_dict["base"])
        params = self._params()
        self.buffers = {
            params[i]: buffer.to(device=params[i].device, dtype=params[i].dtype, copy=True)
            for i, buffer in state_dict[self.buffer_key].items()
        }


def base_optimizer(optimizer: OptimizerLike) -> OptimizerLike:
    """The optimizer an update correction wraps (``optimizer`` itself when it wraps none): the
    step a synchronous run would take from the same state."""
    return optimizer.base if isinstance(optimizer, UpdateCorrection) else optimizer
