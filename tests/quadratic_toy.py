"""A delayed trainer on a quadratic whose gradients are known by hand, for the staleness and
applied-step tests: each stage holds one 2-vector w with loss ½(2·w₀² + 0.5·w₁²), gradient
(2·w₀, 0.5·w₁), plain SGD with no momentum, decay, warmup or clipping."""

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
