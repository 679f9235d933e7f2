"""The update a stage applies, once for every backend (simulator, pipeline, torch baseline).

A step's update runs in three parts, so that a pipeline stage can reduce its gradient across data
parallel replicas (or with a tied copy) between the first two while it computes something else:

1. :meth:`nobubble.prediction.StepWeights.take_gradients`: the gradient of step ``t``,
   accumulated on the weights it was computed at, moves onto the optimizer's parameters.
2. :func:`prepare_step`: clip (or drop a non-finite gradient, so the optimizer skips the stage),
   release versions nobody will read again, and make the newest version the step's target
   (copying it first if an in-flight microbatch still reads it).
3. :func:`optimizer_step`: scheduled learning rate, optimizer step, gradients cleared.

Policy (docs/training.md): each stage clips its own parameters' gradient (no reduction across
stages, which would re-create the bubble under 2bw); a stage whose gradient norm is not finite
skips its update; the training loop aborts after ``nonfinite_patience`` such steps in a row.
Data-parallel replicas of a stage average their gradients before the clip, so clipping and the
non-finite check see what one process with the whole batch would see.

Tied embeddings split over stages (the first stage's embedding and the last stage's head share
one weight, each stage holding a copy, see :mod:`nobubble.model`): the tied weight's gradient is
the sum of both stages' gradients, the same bytes on both (the backend sums them before
:func:`prepare_step`). It forms its own clipping group: it is clipped by its own norm, on both
stages alike (identical bytes, identical factor), and each stage's other parameters are clipped
as before; a non-finite tied gradient makes both copies skip, whatever the rest of either stage
does. The first stage's reported norm includes the tied norm, the last stage's does not, so that
:func:`combined_norm` over the stages counts it once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from nobubble.config import TrainConfig
from nobubble.optim import clip_grad_norm, lr_at, set_lr
from nobubble.versions import VersionStore, gradient_version


def prepare_step(
    store: VersionStore,
    step: int,
    history: int,
    grad_clip: float,
    tied: str | None = None,
    reports_tied: bool = False,
) -> tuple[float, bool]:
    """Clip the stage's gradient and set up the versions for the optimizer step of ``step``.

    ``history``: how many steps back the stage keeps its versions (its gradient delay; one more
    under weight prediction: :attr:`nobubble.prediction.StepWeights.history`).
    ``tied``: the name of the tied weight if this stage holds one of its two copies (its gradient
    already summed over both); ``reports_tied``: whether the returned norm includes it (the
    first stage's does). Returns (gradient norm before clipping, whether the stage's update goes
    ahead in full).
    """
    if tied is None:
        norm, ok = clip_stage(store.params.values(), grad_clip)
    else:
        norm, ok = clip_with_tied(store.params, tied, grad_clip, reports_tied)
    store.release_older_than(gradient_version(step + 1, history))
    store.begin_step(still_needed=history > 0)
    return norm, ok


def optimizer_step(optimizer: Any, step: int, cfg: TrainConfig) -> float:
    """Step ``optimizer`` at the scheduled learning rate of ``step``; return that rate."""
    lr = lr_at(step, cfg)
    set_lr(optimizer, lr)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lr


def clip_stage(params: Iterable[torch.nn.Parameter], max_norm: float) -> tuple[float, bool]:
    """Clip one stage's gradients; drop them if non-finite so the optimizer skips the stage.

    Returns (norm before clipping, whether the update goes ahead).
    """
    params = [p for p in params if p.grad is not None]
    norm = clip_grad_norm(params, max_norm)
    if math.isfinite(norm):
        return norm, True
    for p in params:
        p.grad = None
    return norm, False


def clip_with_tied(
    params: dict[str, torch.nn.Parameter], tied: str, max_norm: float, reports_tied: bool
) -> tuple[float, bool]:
    """Clip a stage that holds a copy of the tied weight ``tied``: the tied weight by its own
    norm, the other parameters together by theirs; either group is dropped if its norm is not
    finite. Returns (the others' norm, combined with the tied norm if ``reports_tied``; whether
    both groups go ahead)."""
    norm, ok = clip_stage([p for name, p in params.items() if name != tied], max_norm)
    tied_norm, tied_ok = clip_stage([params[tied]], max_norm)
    if reports_tied:
        norm = combined_norm([norm, tied_norm])
    return norm, ok and tied_ok


def combined_norm(norms: Iterable[float]) -> float:
    """The norm of the whole model's gradient from its stages' norms."""
    return math.sqrt(sum(n * n for n in norms))
