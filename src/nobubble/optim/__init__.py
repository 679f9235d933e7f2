"""Optimizers, parameter routing, error feedback and LR schedules (placeholder registry)."""

OPTIMIZERS = ("adamw", "muon", "lion", "adan", "soap", "mars", "signum", "nadamw", "sgd")
