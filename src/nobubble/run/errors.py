"""Why training cannot go on."""

from __future__ import annotations


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. gradients keep being non-finite); the message says why."""


class NonFiniteError(TrainingError):
    """The non-finite policy stopped the run: ``nonfinite_patience`` bad steps in a row."""
