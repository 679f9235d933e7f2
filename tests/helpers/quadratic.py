"""Delayed trainers on quadratics whose gradients are known by hand, plain SGD (or the optimizer
asked for) with no momentum, decay, warmup or clipping:

- :func:`quadratic_trainer` (the staleness and applied-step tests): each stage holds one 2-vector
  w with loss ½(2·w₀² + 0.5·w₁²), gradient (2·w₀, 0.5·w₁);
- :func:`scalar_trainer` (the delay semantics, corrections, prediction): each stage holds one
  scalar w with loss ½·w², so its gradient is w itself.
"""

import math

import torch

from nobubble.config import TrainConfig
from nobubble.one_process import DelayedTrainer

LR = 0.5


def quadratic_trainer(delays: list[int], **settings) -> DelayedTrainer:
    """One toy stage per entry of ``delays``, each starting at w = (1, -2); ``settings`` add to
    the configuration (the measurement's interval, a correction)."""
    cfg = TrainConfig(
        optim="sgd",
        lr=LR,
        momentum=0.0,
        weight_decay=0.0,
        warmup_steps=0,
        lr_schedule="constant",
        grad_clip=0.0,
        **settings,
    )
    params = [
        {f"w{s}": torch.nn.Parameter(torch.tensor([1.0, -2.0]).double())}
        for s in range(len(delays))
    ]

    def micro_loss(weights, micro):
        return sum(0.5 * (2 * w[0] ** 2 + 0.5 * w[1] ** 2) for w in weights.values())

    return DelayedTrainer(params, delays, micro_loss, cfg)


def quadratic_grad(w: list[float]) -> list[float]:
    return [2 * w[0], 0.5 * w[1]]


def scalar_trainer(delays: list[int], optim: str = "sgd", **overrides) -> DelayedTrainer:
    """One scalar w = 1 per entry of ``delays``, loss ½·w² (its gradient is w itself);
    ``overrides`` add to the configuration."""
    cfg = TrainConfig(
        optim=optim,
        lr=0.5,
        momentum=0.0,
        nesterov=False,
        weight_decay=0.0,
        warmup_steps=0,
        lr_schedule="constant",
        grad_clip=0.0,
        **overrides,
    )
    params = [{f"w{s}": torch.nn.Parameter(torch.ones(1, dtype=torch.float64))} for s in delays]

    def micro_loss(weights, micro):
        return sum(0.5 * (w * w).sum() for w in weights.values())

    return DelayedTrainer(params, delays, micro_loss, cfg)


def run_steps(trainer: DelayedTrainer, steps: int) -> list[list[float]]:
    """Weights of every stage of a :func:`scalar_trainer` after each step, starting with the
    initial ones."""
    history = [[store.params[n].item() for store in trainer.stores for n in store.params]]
    for _ in range(steps):
        trainer.train_step([torch.zeros(1)])
        history.append([store.params[n].item() for store in trainer.stores for n in store.params])
    return history


def column(history: list[list[float]], stage: int) -> list[float]:
    return [row[stage] for row in history]


def adamw_update(m: float, v: float, g: float, t: int, b1=0.9, b2=0.95, eps=1e-8, lr=0.5):
    """One AdamW step by hand: the new moments and the step taken."""
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    step = lr * (m / (1 - b1**t)) / (math.sqrt(v / (1 - b2**t)) + eps)
    return m, v, step
