"""The non-finite policy (docs/training.md): a stage whose gradient is not finite skips its update;
the run stops after ``nonfinite_patience`` such steps in a row."""

from __future__ import annotations

import math
import warnings

from nobubble.config import NobubbleWarning
from nobubble.engine import StepStats
from nobubble.run.errors import NonFiniteError


class NonFinitePolicy:
    """Counts the steps in a row with a non-finite loss or a skipped update."""

    def __init__(self, patience: int) -> None:
        self.patience, self.bad_in_a_row = patience, 0

    def check(self, stats: StepStats) -> NonFiniteError | None:
        """Warn about a non-finite step; the error to stop with once the patience is spent."""
        if not stats.skipped_stages and math.isfinite(stats.loss):
            self.bad_in_a_row = 0
            return None
        self.bad_in_a_row += 1
        warnings.warn(
            f"step {stats.step + 1}: non-finite loss or gradient (loss {stats.loss}); stages "
            f"{stats.skipped_stages} skipped their update",
            NobubbleWarning,
            stacklevel=2,
        )
        if self.bad_in_a_row < self.patience:
            return None
        return NonFiniteError(
            f"{self.bad_in_a_row} steps in a row had non-finite gradients (last at step "
            f"{stats.step + 1}); lower the learning rate, enable grad_clip, or check the data"
        )
