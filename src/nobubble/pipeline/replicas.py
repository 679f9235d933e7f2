"""Data parallelism: the replicas of one stage average their gradient, behind compute if they can.

Every replica of a stage runs the same actions on its own share of every microbatch (so the run
sees exactly the tokens a single replica would, see :func:`replica_rows`). At a STEP a stage starts
one asynchronous all-reduce over its replicas of its whole gradient (one flat bucket) and of its
figures (its loss sum, MoE routing sums); the rest of the update waits until something needs the
version the step produces (see ``PipelineEngine``). Under 2bw that is the first forward of the
step after next, so the reduction runs behind that compute; under a flushing schedule the next
forward needs it at once and the reduction is on the critical path. Both are measured per stage:
how long the reduction took (start to completion, reported by the backend) and how long the stage
waited for it.

Both are measured by the clock of the gradient's device (:mod:`nobubble.pipeline.timing`): on
the CPU the wall clock (the completion as gloo's future reports it); on CUDA events, not CPU
clocks: NCCL's future completes once the all-reduce is queued, and the CPU runs ahead of the
GPU, so a CPU clock would time the queue, not the transfer. The all-reduce's time runs from the
point of the compute stream where it was started to its completion (a side stream that waits for
it records the end); the wait is how long the compute stream stood idle on it. Both are read
after the step, never inside an action. On gloo with CUDA tensors (``dist_backend=gloo``) that
wait holds the CPU until the sum is done (gloo reduces in host memory), so there the all-reduce
does not run behind compute, and both are the wall clock's.

The all-reduces are posted through the process's transport (:mod:`nobubble.pipeline.transport`),
so under ``emulate_nccl`` they queue with the rest of their group's operations, as on NCCL.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nobubble.layout import ParallelLayout
from nobubble.pipeline.comm import PeerFailure
from nobubble.pipeline.timing import Completion, EventCompletion, Mark, Span, Tally, clock_for
from nobubble.pipeline.transport import Work, active
from nobubble.profiling import label


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
    works: list[Work]
    bucket: torch.Tensor
    figures: torch.Tensor | None
    started: Mark
    completed: Completion | EventCompletion  # when the gradient's all-reduce completes


class ReplicaReduction:
    """Sums a gradient (and float64 figures) over ``group`` and divides by ``dp`` (for a stage's
    replicas: their mean); a wait longer than ``timeout_s`` or a member that went away is a
    :class:`PeerFailure` naming ``name`` (the rank that waited) and ``what`` it waited for;
    ``short``: its name on a profiler trace."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        dp: int,
        timeout_s: float = 1800.0,
        name: str = "this stage",
        what: str = "the gradient all-reduce with the other replicas of its stage",
        short: str = "gradient all-reduce",
    ) -> None:
        self.group, self.dp, self.name, self.what, self.short = group, dp, name, what, short
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.backend = dist.get_backend(group)
        self.duration = Tally()  # start to completion, summed over steps
        self.waited = Tally()  # the part of it the stage spent blocked
        self.bytes = 0  # gradient bytes this rank contributed to all-reduces
        # the latest all-reduce's time and wait: at the end of a run the last one is waited for
        # with no compute left to hide behind, which the benchmark leaves out of its figures
        self.last: Span | None = None
        self.last_wait: Span | None = None

    @property
    def duration_s(self) -> float:
        return self.duration.seconds

    @property
    def waited_s(self) -> float:
        return self.waited.seconds

    @property
    def last_s(self) -> float:
        return self.last.seconds() if self.last else 0.0

    @property
    def last_wait_s(self) -> float:
        return self.last_wait.seconds() if self.last_wait else 0.0

    def start(
        self, step: int, params: list[torch.nn.Parameter], figures: torch.Tensor | None
    ) -> PendingReduction:
        """Start averaging the gradients of ``params`` (and ``figures``, float64 sums: a stage's
        loss and routing sums)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        bucket = torch.cat([g.reshape(-1) for g in grads])
        for param in params:  # the bucket holds them now; finish() hands back views of it
            param.grad = None
        clock = clock_for(bucket.device, self.backend)
        started = clock.mark()
        works = [self._all_reduce(bucket, f"{self.short} (step {step + 1})")]
        if figures is not None:
            works.append(self._all_reduce(figures, f"{self.short}'s figures (step {step + 1})"))
        completed = clock.completion(works[0])
        pending = PendingReduction(step, works, bucket, figures, started, completed)
        self.bytes += bucket.numel() * bucket.element_size()
        return pending

    def finish(
        self, pending: PendingReduction, params: list[torch.nn.Parameter]
    ) -> torch.Tensor | None:
        """Wait for ``pending``; put the averaged gradients on ``params``; return the figures
        averaged over the replicas (None if none were given)."""
        clock = clock_for(pending.bucket.device, self.backend)
        stalled = clock.mark()
        with label("wait", self.short, "step", pending.step + 1):
            self._wait(pending.works, f"{self.what} (step {pending.step})")
        resumed = clock.mark()
        self.last_wait = Span(stalled, resumed)
        self.last = Span(pending.started, pending.completed.at(resumed))
        self.waited.add(self.last_wait)
        self.duration.add(self.last)
        bucket = pending.bucket.div_(self.dp)
        offset = 0
        for param in params:
            count = param.numel()
            param.grad = bucket[offset : offset + count].view_as(param)
            offset += count
        return None if pending.figures is None else pending.figures.div_(self.dp)

    def sum_now(self, values: torch.Tensor, what: str) -> torch.Tensor:
        """Sum ``values`` over the group in place and wait for it (``what``: for the error)."""
        self._wait([self._all_reduce(values, what)], what)
        return values

    def _all_reduce(self, values: torch.Tensor, what: str) -> Work:
        """Start summing ``values`` over the group, through the process's transport."""

        def launch() -> dist.Work:
            return dist.all_reduce(values, group=self.group, async_op=True)

        return active().collective(self.group, launch, f"all-reduce: {what}", values.device)

    def _wait(self, works: list[Work], what: str) -> None:
        wait_for(works, self.timeout, self.name, what)

    def report(self, prefix: str) -> dict[str, float]:
        """The measurements of this reduction for a stage report, keys starting ``prefix``."""
        return comm_report(
            prefix, self.duration_s, self.waited_s, self.bytes, self.last_s, self.last_wait_s
        )


def comm_report(
    prefix: str, total_s: float, wait_s: float, nbytes: int, last_s: float, last_wait_s: float
) -> dict[str, float]:
    """A stage report's entries for collectives run over the steps, keys starting ``prefix``:
    their time (start to completion) and the time waited for them, summed; the bytes this rank
    put in (MB); the latest step's time and wait."""
    return {
        f"{prefix}_s": total_s,
        f"{prefix}_wait_s": wait_s,
        f"{prefix}_mb": nbytes / 2**20,
        f"{prefix}_last_s": last_s,
        f"{prefix}_last_wait_s": last_wait_s,
    }


def wait_for(works: list[Work], timeout: datetime.timedelta, name: str, what: str) -> None:
    """Wait for collectives ``works``; one that fails or takes longer than ``timeout`` is a
    :class:`PeerFailure` saying that ``name`` (the rank that waited) stopped waiting for
    ``what``."""
    try:
        for work in works:
            work.wait(timeout)
    except RuntimeError as exc:
        raise peer_failure(name, what, exc) from None


@contextlib.contextmanager
def peer_failures(name: str, what: str) -> Iterator[None]:
    """Around a collective made outside the transport (a barrier, a gather of Python objects):
    its error, that of a peer that exited, crashed or is stuck, becomes the one-line
    :class:`PeerFailure` of ``name`` (the rank that waited) waiting for ``what``. Keep the block
    to the call itself: any RuntimeError inside reads as a peer's."""
    try:
        yield
    except PeerFailure:
        raise
    except RuntimeError as exc:
        raise peer_failure(name, what, exc) from None


def peer_failure(name: str, what: str, exc: RuntimeError) -> PeerFailure:
    """The error of ``name`` (the rank that waited) whose collective ``what`` failed with
    ``exc``: one of the other processes in it exited, crashed or is stuck."""
    return PeerFailure(
        f"{name} stopped waiting for {what}: one of them exited, crashed or is "
        "stuck (its own error, in its log or above, says why); raise p2p_timeout_s if "
        f"it is only slow. Transport said: {exc}"
    )
