"""Gradient-norm clipping over the parameters one caller owns (e.g. one pipeline stage)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy
import torch


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
    if norm is None:
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
    else:
        total = torch.tensor(norm, dtype=torch.float32)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    # a given norm is returned as the float32 it clips by, without reading a tensor
    return float(total) if norm is None else float(numpy.float32(norm))
