"""Staleness you can see: how far a delayed stage's weights have moved from the version its
gradients are computed at, how far its gradient points from the fresh one, and how far the
update it applies is from the one the fresh gradient would give.

- **Weight drift** (every evaluation, both engines, bitwise the same): ‖w[t] - w[t-d]‖ / ‖w[t]‖
  over a stage's trained parameters (summed in name order), w[t] its newest version and w[t-d]
  the one its next step's gradient is computed at (with weight prediction, the version ŵ
  extrapolates from). metrics.jsonl's
  evaluation lines carry one value per model stage (``weight_drift``; null for a stage without a
  delay).
- **Gradient cosine** (one-process engine, every ``staleness_every`` steps): the cosine between a
  stage's gradient as training computed it (at the delayed weights, or ŵ) and the gradient of
  the same batch at every stage's newest weights, before clipping (``grad_cosine``).
- **Applied-step error** (one-process engine, every ``applied_error_every`` steps): what a
  stage's delayed gradient changes in the update it applies. Δa = w[t+1] - w[t], the update step
  t applied (clipping, the correction, weight decay and the learning rate all included), against
  Δf, the update the same optimizer and correction state would have applied at step t from the
  fresh gradient (that of the cosine above, clipped by the same rule), stepped on copies so that
  the run is unchanged: ‖Δa - Δf‖ / ‖Δf‖ (``applied_error``) and cos(Δa, Δf)
  (``applied_cosine``), over the stage's trained parameters. Under a synchronous schedule Δa = Δf
  up to the order of summation; without a correction the difference is the stale gradient
  alone, through the optimizer's state; a correction acts on both.
- **Synchronous-step error** (measured with the applied-step error): Δa against Δs, the update
  the base optimizer alone (without the update correction that wraps it) would have applied at
  step t from the fresh gradient and the same optimizer state: the step a synchronous run takes
  from there. ‖Δa - Δs‖ / ‖Δs‖ (``sync_step_error``) and cos(Δa, Δs) (``sync_step_cosine``):
  what a correction is for, bringing a delayed update nearer to the synchronous one. Without an
  update correction Δs = Δf.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from nobubble.versions import VersionStore, Weights, gradient_version

DRIFT = "weight_drift"
COSINE = "grad_cosine"
APPLIED_ERROR = "applied_error"
APPLIED_COSINE = "applied_cosine"
SYNC_STEP_ERROR = "sync_step_error"
SYNC_STEP_COSINE = "sync_step_cosine"
# metrics.jsonl keys of the measures taken every N steps (staleness_every, applied_error_every)
STEP_MEASURES = (COSINE, APPLIED_ERROR, APPLIED_COSINE, SYNC_STEP_ERROR, SYNC_STEP_COSINE)
PER_STAGE = (
    DRIFT,
    *STEP_MEASURES,
)  # metrics.jsonl keys holding one value (or null) per model stage


def weight_drift(store: VersionStore, delay: int) -> float | None:
    """‖w[t] - w[t-d]‖ / ‖w[t]‖ of a stage with gradient ``delay`` d whose newest version is t
    (None without a delay); float64 sums over its parameters that train."""
    if delay == 0:
        return None
    newest = store.newest
    new, old = store[newest], store[gradient_version(newest, delay)]
    # in name order: the engines hold a stage's parameters in different orders (a tied copy)
    names = sorted(name for name, p in store.params.items() if p.requires_grad)
    return _relative(_squares(new[n] - old[n] for n in names), _squares(new[n] for n in names))


def applied_error(applied: Weights, fresh: Weights) -> tuple[float, float]:
    """(‖Δa - Δf‖ / ‖Δf‖, cos(Δa, Δf)) of a stage's ``applied`` update and the ``fresh`` one,
    each by parameter name; float64 sums in name order."""
    names = sorted(fresh)
    moved = _squares(applied[n].double() - fresh[n].double() for n in names)
    size = _squares(fresh[n] for n in names)
    return _relative(moved, size), cosine((applied[n] for n in names), (fresh[n] for n in names))


def _relative(moved: float, size: float) -> float:
    """sqrt(moved / size) of two sums of squares (0 for nothing moved from nothing)."""
    if size == 0:
        return 0.0 if moved == 0 else math.inf
    return math.sqrt(moved / size)


def _squares(tensors: Iterable[torch.Tensor]) -> float:
    return sum(float(_whole(t.detach().double().pow(2).sum())) for t in tensors)


def _whole(total: torch.Tensor) -> torch.Tensor:
    """A sum over a tensor-parallel DTensor shard, summed over the tp ranks (the same on each)."""
    return total.full_tensor() if isinstance(total, DTensor) else total


def cosine(first: Iterable[torch.Tensor | None], second: Iterable[torch.Tensor | None]) -> float:
    """The cosine between two gradients given as tensors in the same order (None: zeros)."""
    dot = norm_a = norm_b = 0.0
    for a, b in zip(first, second, strict=True):
        if a is None or b is None:
            norm_a += _squares([a]) if a is not None else 0.0
            norm_b += _squares([b]) if b is not None else 0.0
            continue
        a, b = a.detach().double(), b.detach().double()
        dot += float((a * b).sum())
        norm_a += float(a.pow(2).sum())
        norm_b += float(b.pow(2).sum())
    if norm_a == 0 or norm_b == 0:
        return math.nan
    return dot / math.sqrt(norm_a * norm_b)
