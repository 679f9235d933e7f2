"""Data parallelism: the replicas of one stage average their gradient, behind compute if they can.

Every replica of a stage runs the same actions on its own share of every microbatch (so the run
sees exactly the tokens a single replica would, see :func:`replica_rows`). At a STEP a stage starts
one asynchronous all-reduce over its replicas of its whole gradient (one flat bucket) and of its
loss sum; the rest of the update waits until something needs the version the step produces (see
``PipelineEngine``). Under 2bw that is the first forward of the step after next, so the reduction
runs behind that compute; under a flushing schedule the next forward needs it at once and the
reduction is on the critical path. Both are measured per stage: how long the reduction took
(start to completion, reported by the backend) and how long the stage waited for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nobubble.layout import ParallelLayout


def replica_rows(rows: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """This replica's share of a microbatch's rows: the ``replica``-th of ``dp`` equal parts.

    Taking a part of every microbatch (not whole microbatches) keeps microbatch ``m`` of every
    replica a part of microbatch ``m`` of the one-replica run, so a data-parallel run computes
    the same step as the run without data parallelism, up to the order of the sums.
    """
    return rows.chunk(layout.dp)[layout.replica] if layout.dp > 1 else rows


@dataclass
class PendingReduction:
    step: int
    works: list[dist.Work]
    bucket: torch.Tensor
    loss: torch.Tensor | None
    started: float
    done: list[float] = field(default_factory=list)  # completion time, set by the backend


class ReplicaReduction:
    """Averages one stage's gradient (and loss) over its ``dp`` replicas in ``group``."""

    def __init__(self, group: dist.ProcessGroup, dp: int) -> None:
        self.group, self.dp = group, dp
        self.duration_s = 0.0  # start to completion, summed over steps
        self.waited_s = 0.0  # the part of it the stage spent blocked
        self.bytes = 0  # gradient bytes this rank contributed to all-reduces

    def start(
        self, step: int, params: list[torch.nn.Parameter], loss: torch.Tensor | None
    ) -> PendingReduction:
        """Start averaging the gradients of ``params`` (and ``loss``, a float64 sum)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        bucket = torch.cat([g.reshape(-1) for g in grads])
        started = time.perf_counter()
        works = [dist.all_reduce(bucket, group=self.group, async_op=True)]
        if loss is not None:
            works.append(dist.all_reduce(loss, group=self.group, async_op=True))
        pending = PendingReduction(step, works, bucket, loss, started)
        works[0].get_future().then(lambda _: pending.done.append(time.perf_counter()))
        self.bytes += bucket.numel() * bucket.element_size()
        return pending

    def finish(
        self, pending: PendingReduction, params: list[torch.nn.Parameter]
    ) -> torch.Tensor | None:
        """Wait for ``pending``; put the averaged gradients on ``params``; return the loss sum
        averaged over the replicas (None on a stage without a loss)."""
        started = time.perf_counter()
        for work in pending.works:
            work.wait()
        if pending.bucket.is_cuda:
            torch.cuda.current_stream().synchronize()
        finished = time.perf_counter()
        self.waited_s += finished - started
        self.duration_s += (pending.done[0] if pending.done else finished) - pending.started
        bucket = pending.bucket.div_(self.dp)
        offset = 0
        for param in params:
            count = param.numel()
            param.grad = bucket[offset : offset + count].view_as(param)
            offset += count
        return None if pending.loss is None else pending.loss.div_(self.dp)
