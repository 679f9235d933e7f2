"""Gradient-norm clipping over the parameters one caller owns (e.g. one pipeline stage)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Scale the gradients so that their total L2 norm is at most ``max_norm``.

    Returns the norm before clipping; ``max_norm`` 0 only measures it. Parameters without a
    gradient are ignored. A non-finite norm is returned as is (and clipping then makes the
    gradients non-finite too), so the caller can detect it.
    """
    params = [p for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)
