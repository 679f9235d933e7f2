"""Muon for stacked expert weights: every expert's matrix orthogonalized on its own.

An MoE layer keeps its E experts' matrices in one 3-D parameter (E, A, B). Muon's update is defined
per matrix, so :class:`ExpertMuon` applies it to each (A, B) slice exactly as the dense
:class:`~nobubble.optim.muon.Muon` would to that expert's matrix held as its own 2-D parameter: the
same momentum (kept for the whole tensor; it is elementwise), the same Newton–Schulz iteration in
the same ``ns_dtype`` and the same shape-adjusted learning rate (tested bitwise against that Muon on
the separate matrices, and in bfloat16 against ``torch.optim.Muon``). Orthogonalizing the
flattened (E·A, B) matrix instead would couple the experts' updates.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from nobubble.optim.muon import adjust_lr, momentum_direction, orthogonalize


class ExpertMuon(torch.optim.Optimizer):
    """Muon's update on each matrix ``p[e]`` of 3-D parameters ``p``, orthogonalized in
    ``ns_dtype`` (an attribute, as :class:`~nobubble.optim.muon.Muon`'s)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 3:
                    shape = tuple(p.shape)
                    raise ValueError(f"ExpertMuon takes (experts, rows, columns) tensors: {shape}")
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            lr, decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                update = momentum_direction(p.grad, buf, momentum, group["nesterov"])
                adjusted = adjust_lr(lr, group["adjust_lr_fn"], p.shape[1:])
                p.mul_(1 - lr * decay)
                for expert in range(p.shape[0]):
                    ortho = orthogonalize(update[expert], self.ns_dtype)
                    p[expert].add_(ortho, alpha=-adjusted)
