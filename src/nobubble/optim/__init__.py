"""Optimizers, parameter routing, error feedback, LR schedules and gradient clipping."""

from nobubble.optim.clipping import clip_grad_norm
from nobubble.optim.composite import CompositeOptimizer, OptimizerLike
from nobubble.optim.ef import ErrorFeedback
from nobubble.optim.lr_schedule import lr_at, set_lr
from nobubble.optim.registry import OPTIMIZERS, build_optimizer
from nobubble.optim.routing import Kind, classify

__all__ = [
    "OPTIMIZERS",
    "CompositeOptimizer",
    "ErrorFeedback",
    "Kind",
    "OptimizerLike",
    "build_optimizer",
    "classify",
    "clip_grad_norm",
    "lr_at",
    "set_lr",
]
