"""Learning-rate schedules; step t is the update that turns w[t] into w[t+1]."""

from __future__ import annotations

import math

from nobubble.config import TrainConfig
from nobubble.config.optimizer import LR_SCHEDULES
from nobubble.optim.composite import OptimizerLike

# the settings each schedule reads besides lr, warmup_steps and steps
SETTINGS_READ: dict[str, tuple[str, ...]] = {
    "cosine": ("min_lr_ratio",),
    "wsd": ("decay_frac", "min_lr_ratio"),
    "constant": (),
}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of update ``step`` (0-based).

    Linear warmup ``lr·(t+1)/W`` reaches the peak at t = W-1; then ``constant`` stays there,
    ``cosine`` falls to ``min_lr_ratio·lr`` at the final step t = steps-1, and ``wsd`` stays at
    the peak until it falls linearly to the same floor over the last ``round(decay_frac·steps)``
    steps.
    """
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise ValueError(
            f"unknown lr_schedule {cfg.lr_schedule!r}; choose one of: {', '.join(LR_SCHEDULES)}"
        )
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return peak
    last = cfg.steps - 1
    top = max(cfg.warmup_steps - 1, 0)  # last update at the peak before the decay
    if cfg.lr_schedule == "wsd":
        top = max(top, last - round(cfg.decay_frac * cfg.steps))
    progress = min(max((step - top) / max(last - top, 1), 0.0), 1.0)
    if cfg.lr_schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak - (peak - floor) * progress  # wsd


def set_lr(optimizer: OptimizerLike, lr: float) -> None:
    """Set every group's learning rate to ``lr`` times the group's ``lr_scale`` (default 1)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
