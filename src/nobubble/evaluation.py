"""Validation loss and bits per byte, accumulated the same way by every backend."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def microbatch_sums(
    logits: torch.Tensor, targets: torch.Tensor, token_bytes: torch.Tensor
) -> torch.Tensor:
    """A microbatch's terms of :class:`EvalSums` (loss, tokens, byte loss, bytes) as one float64
    vector on the device: summed there, they can be read once per evaluation."""
    losses = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    nbytes = token_bytes.to(targets.device)[targets.reshape(-1)]
    terms = [losses.sum(), (losses * (nbytes > 0)).sum(), nbytes.sum()]
    loss, byte_loss, total_bytes = (t.double() for t in terms)
    return torch.stack([loss, loss.new_full((), targets.numel()), byte_loss, total_bytes])


@dataclass
class EvalSums:
    """Additive totals over validation tokens; combine, then :meth:`result`."""

    loss: float = 0.0  # summed cross-entropy (nats) over all target tokens
    tokens: int = 0
    byte_loss: float = 0.0  # summed cross-entropy over targets that decode to >= 1 byte
    bytes: int = 0

    def add(self, logits: torch.Tensor, targets: torch.Tensor, token_bytes: torch.Tensor) -> None:
        loss, tokens, byte_loss, nbytes = microbatch_sums(logits, targets, token_bytes).tolist()
        self.loss += loss
        self.tokens += int(tokens)
        self.byte_loss += byte_loss
        self.bytes += int(nbytes)

    def as_list(self) -> list[float]:
        return [self.loss, float(self.tokens), self.byte_loss, float(self.bytes)]

    @classmethod
    def from_list(cls, values: list[float]) -> EvalSums:
        return cls(values[0], int(values[1]), values[2], int(values[3]))

    def result(self) -> tuple[float, float]:
        """(mean loss per token in nats, bits per UTF-8 byte of the targets)."""
        val_loss = self.loss / max(self.tokens, 1)
        val_bpb = self.byte_loss / (math.log(2) * self.bytes) if self.bytes else float("nan")
        return val_loss, val_bpb
