"""Optimizers: the registry, parameter groups, composite optimizers, LR schedules, clipping."""
