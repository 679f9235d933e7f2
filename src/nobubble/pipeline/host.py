"""Values the CPU must read from the device, copied without waiting for them.

A step's figures (its loss, routing sums, gradient norms) are read on the CPU once per step: the
clip and the skip of a non-finite gradient are decided there, and the statistics travel as CPU
tensors. ``.item()`` would make the CPU wait until the GPU has run everything queued so far (a
drain of the stream, inside an action). A :class:`HostCopy` instead queues the copy into pinned
host memory behind the work that computes the value and records an event after it: the CPU goes
on queueing, asks :meth:`~HostCopy.ready` between two actions, and :meth:`~HostCopy.read` waits,
if at all, for that copy alone, never for the work queued after it. On the CPU the copy is made
at once and is always ready.
"""

from __future__ import annotations

import torch


class HostCopy:
    """``values`` (a 1-D tensor) as they are when this is made, on their way to host memory."""

    def __init__(self, values: torch.Tensor) -> None:
        cuda = values.is_cuda
        self.values = torch.empty(values.shape, dtype=values.dtype, pin_memory=cuda)
        self.values.copy_(values.detach(), non_blocking=cuda)
        self.event: torch.cuda.Event | None = None
        if cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def ready(self) -> bool:
        """Whether the copy has arrived (never waits)."""
        return self.event is None or self.event.query()

    def read(self) -> list[float]:
        """The values, waiting for the copy (and the work it follows) if it has not arrived."""
        if self.event is not None:
            self.event.synchronize()
        return self.values.tolist()
