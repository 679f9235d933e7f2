"""Gradient-norm clipping over the parameters one caller owns (e.g. one pipeline stage)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy
import torch
from torch.distributed.tensor import DTensor


def clip_grad_norm(
    params: Iterable[torch.Tensor], max_norm: float, norm: float | None = None
) -> float:
    """Scale the gradients so that their total L2 norm is at most ``max_norm``.

    Returns the norm before clipping; ``max_norm`` 0 only measures it. ``norm``: the total norm
    if known already (the gradients are a part of a gradient sharded over processes, which
    measured it together). Parameters without a gradient are ignored. A non-finite norm is
    returned as is (and clipping then makes the gradients non-finite too), so the caller can
    detect it.
    """
    params = [p for p in params if p.grad is not None]
    split = [p for p in params if isinstance(p.grad, DTensor)]  # tensor-parallel shards
    whole = [p for p in params if not isinstance(p.grad, DTensor)]
    if norm is None:
        total = total_norm([p.grad for p in params])
    else:
        total = torch.tensor(norm, dtype=torch.float32)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(whole, max_norm, total)
        if split:  # each rank scales its own shard by the same factor
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for p in split:
                p.grad.to_local().mul_(coef)
    # a given norm is returned as the float32 it clips by, without reading a tensor
    return float(total) if norm is None else float(numpy.float32(norm))


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of ``grads`` together, where some may be DTensor shards of a stage split over
    tensor-parallel ranks (:mod:`nobubble.model.tensor_split`): theirs is taken over their whole
    tensors (an all-reduce over the tp ranks), the same on every rank."""
    split = [g for g in grads if isinstance(g, DTensor)]
    total = torch.nn.utils.get_total_norm([g for g in grads if not isinstance(g, DTensor)])
    if not split:
        return total
    shards = torch.nn.utils.get_total_norm(split).full_tensor()
    return torch.linalg.vector_norm(torch.stack([total, shards.to(total)]))
