"""Sharded data parallelism (``zero=1``, ``zero=2``): the chain of collectives that turns a
stage's gradient into its next version on every replica, behind compute where the schedule
leaves room.

Each replica of a stage updates only its part of the stage's parameters
(:class:`nobubble.zero_partition.ShardPlan`) and holds optimizer and correction state for that part
alone. At a STEP the chain starts:

1. **reduce**: ``zero=1`` all-reduces the stage's gradient (one flat bucket, laid out replica by
   replica), so every replica has all of it; ``zero=2`` reduce-scatters it, so each keeps only
   its part. The step's figures (loss, routing sums) are all-reduced beside it, and the tied
   weight's gradient, if the stage holds a copy, is summed over its own group as without
   sharding (:mod:`nobubble.pipeline.replicas`).
2. **norm** (``zero=2``): the clip needs the norm of the whole averaged gradient: each replica's
   sum of squares, all-reduced (one number).
3. **read**: the step's figures and the norms are copied to the host behind the work that
   computes them (:class:`~nobubble.pipeline.host.HostCopy`): the chain moves on once the copy
   has arrived, so moving it on between two actions never waits for the device.
4. **update**: this replica's parts are clipped by that norm and stepped
   (:meth:`nobubble.stage_update.TrainedStage.apply`, the one order of a stage's update); then every
   replica's new parts are all-gathered into the newest version.

Every collective starts once the one before it has completed, which the runtime notices between
two actions (:meth:`ShardedUpdate.progress` without blocking), so under 2bw the whole chain runs
behind the compute of the next step: the version it makes is first read by the forwards of the
step after next. Only an action that needs that version (or the stage's next STEP) waits for
what is left. Each model stage has a process group of its own for its chain (its collectives
start at times the completions decide, which differ between the stages of an interleaved
process), so on every replica a group's collectives come in one order: reduce, norm, gather of
step t, then those of step t+1.

Every collective of the chain is posted through the process's transport
(:mod:`nobubble.pipeline.transport`), so under ``emulate_nccl`` it queues with its group's other
operations as on NCCL (the emulator runs gloo's, so the gloo path below, bitwise as on plain
gloo).

The reduce-scatter is NCCL's; on gloo, whose own reduce-scatter never reports completion to a
poll (torch 2.13), it is an all-to-all of the bucket's segments and a sum of the dp received
segments in replica order: the bytes of a reduce-scatter, with a second bucket held while it
runs.

The times are taken by the clock of the bucket's device (:mod:`nobubble.pipeline.timing`): each
collective's start to completion, and the time the stage blocked on them. On the CPU the wall
clock (the completion as gloo's future reports it, else as noticed) and the time the CPU
blocked; on CUDA events: from the point of the compute stream where the collective was started
to its completion (recorded by a side stream that waits for it), and the time the compute stream
stood idle waiting; read after the step, never while the chain moves on between two actions.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from functools import partial

import torch
import torch.distributed as dist

from nobubble.checkpoint.named_state import NamedState
from nobubble.layout import ParallelLayout
from nobubble.pipeline.host import HostCopy
from nobubble.pipeline.replicas import (
    PendingReduction,
    ReplicaReduction,
    comm_report,
    peer_failures,
    wait_for,
)
from nobubble.pipeline.timing import Completion, EventCompletion, Mark, Span, Tally, clock_for
from nobubble.pipeline.transport import Launch, Work, active
from nobubble.profiling import label
from nobubble.stage_update import TrainedStage
from nobubble.zero_partition import ShardPlan, state_to

# (the step's figures averaged over the replicas, the gradient's norms) -> the stage's update
ApplyStep = Callable[[torch.Tensor, tuple[float, float | None]], None]


class Phase(Enum):
    REDUCE = "the gradient's reduction with the other replicas of its stage"
    NORM = "the gradient norm's all-reduce with the other replicas of its stage"
    READ = "the copy of the step's figures and gradient norms to the host"
    GATHER = "the all-gather of the new weights from the other replicas of its stage"
    DONE = ""


@dataclass
class ShardedStep:
    """One STEP's chain in flight."""

    step: int
    sums: torch.Tensor  # the step's figures, all-reduced in place
    tied: PendingReduction | None  # the tied weight's sum over its copies
    phase: Phase = Phase.REDUCE
    works: list[Work] = field(default_factory=list)
    buffer: torch.Tensor | None = None  # what the phase's collective writes
    sent: torch.Tensor | None = None  # what it reads (kept alive until it completes)
    # the gradient's norm (zero=1) or sum of squares (zero=2), then the tied copy's norm, if any
    norms: list[torch.Tensor] = field(default_factory=list)
    figures: HostCopy | None = None  # the sums and the norms, on their way to the host
    read: list[float] | None = None  # the sums, read on the host
    started: Mark = 0.0  # the phase's collective's start
    completed: Completion | EventCompletion | None = None  # when it completes
    comm: Tally = field(default_factory=Tally)  # the chain's collectives, start to completion
    waited: Tally = field(default_factory=Tally)  # the time the stage blocked on them


class ShardedUpdate:
    """The chain of model stage ``trained`` (planned as ``plan``) over its replicas' ``group``:
    ``reduced``: the parameters reduced in the stage's bucket (all trainable ones but the tied
    copy, which ``tied`` reduces); ``zero``: 1 or 2; a wait longer than ``timeout_s`` or a
    replica that went away is an error naming ``name`` (this stage)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        plan: ShardPlan,
        trained: TrainedStage,
        reduced: list[str],
        tied: ReplicaReduction | None,
        zero: int,
        timeout_s: float,
        name: str,
    ) -> None:
        self.group, self.plan, self.trained, self.zero = group, plan, trained, zero
        self.tied, self.name = tied, name
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.reduced = plan.bucket(reduced)
        self.gathered = plan.bucket(plan.shapes)  # every part, the tied copy's included
        self.reduced_names = reduced
        # zero=2 on gloo: an all-to-all and a local sum (gloo's reduce-scatter cannot be polled)
        self.exchanges = dist.get_backend(group) == "gloo"
        device = next(iter(trained.params.values())).device
        self.clock = clock_for(device, dist.get_backend(group))
        self.comm, self.waited = Tally(), Tally()  # summed over steps
        self.bytes = 0  # bytes this rank put into the chains' collectives
        self.last, self.last_waited = Tally(), Tally()  # the latest chain's (the run's last)

    # -- the chain ------------------------------------------------------------------------------

    def start(self, step: int, sums: torch.Tensor, tied: PendingReduction | None) -> ShardedStep:
        """Start step ``step``'s chain: reduce the gradient now on the stage's parameters (and
        ``sums``); ``tied``: the tied copy's reduction, already started."""
        params = self.trained.params
        grads = {n: params[n].grad for n in self.reduced_names if params[n].grad is not None}
        like = next(iter(params.values()))
        bucket = self.reduced.pack(grads, like=like.detach())
        for name in self.reduced_names:  # the bucket holds them now
            params[name].grad = None
        pending = ShardedStep(step, sums, tied)
        group, what = self.group, f"the gradient's reduction (step {step + 1})"
        if self.zero == 1:
            pending.buffer = bucket
            launch = partial(dist.all_reduce, bucket, group=group, async_op=True)
        elif self.exchanges:  # gloo: every segment to its replica, summed there
            pending.sent, pending.buffer = bucket, torch.empty_like(bucket)
            launch = partial(
                dist.all_to_all_single, pending.buffer, bucket, group=group, async_op=True
            )
        else:
            pending.sent, pending.buffer = bucket, bucket.new_empty(self.reduced.segment)
            launch = partial(
                dist.reduce_scatter_tensor, pending.buffer, bucket, group=group, async_op=True
            )
        works = [
            self._post(launch, what, bucket),
            self._post(
                partial(dist.all_reduce, sums, group=group, async_op=True),
                f"the step's figures (step {step + 1})",
                sums,
            ),
        ]
        self._began(pending, works, bucket.numel() * bucket.element_size())
        return pending

    def progress(self, pending: ShardedStep, apply: ApplyStep, block: bool) -> bool:
        """Move ``pending`` on as far as its collectives have completed (``block``: all the way,
        waiting for them); ``apply`` runs the stage's update. Whether the chain is done."""
        while pending.phase is not Phase.DONE:
            if pending.phase is Phase.READ:
                if not block and not pending.figures.ready():
                    return False
                self._update(pending, apply)
                continue
            works = pending.works + (pending.tied.works if pending.tied else [])
            if not block and not all(work.is_completed() for work in works):
                return False
            self._wait(pending, works, block)
            if pending.phase is Phase.REDUCE:
                self._reduced(pending)
            if pending.phase is Phase.NORM and not pending.works:  # reduced, norms computed
                values = torch.cat([pending.sums, *(n.reshape(1) for n in pending.norms)])
                pending.figures, pending.phase = HostCopy(values), Phase.READ
            elif pending.phase is Phase.GATHER and not pending.works:
                self._gathered(pending)
        return True

    def _reduced(self, pending: ShardedStep) -> None:
        """The reduction is complete: this replica's parts of the averaged gradient; under
        zero=2 the start of the norm's all-reduce."""
        dp, size = self.plan.dp, self.reduced.segment
        pending.sums.div_(dp)
        if pending.tied is not None:
            self.tied.finish(pending.tied, [self.trained.params[self.trained.tied]])
            pending.tied = None
        if self.zero == 1:
            full = pending.buffer.div_(dp)
            mine = full[self.plan.replica * size : (self.plan.replica + 1) * size]
            others = torch.linalg.vector_norm(full).double()
        elif self.exchanges:
            received = pending.buffer.view(dp, size)
            mine = received[0].clone()
            for r in range(1, dp):  # in replica order
                mine.add_(received[r])
            mine.div_(dp)
        else:
            mine = pending.buffer.div_(dp)
        pending.buffer = pending.sent = None
        for name, grad in self.reduced.views(mine).items():
            self.trained.parts[name].grad = grad
        if self.zero == 2:  # summed over the replicas next
            others = torch.linalg.vector_norm(mine).double().square().reshape(1)
        tied = self._tied_norm()
        pending.norms = [others] + ([] if tied is None else [tied.double()])
        pending.phase = Phase.NORM
        pending.works = []
        if self.zero == 2:
            works = [
                self._post(
                    partial(dist.all_reduce, others, group=self.group, async_op=True),
                    f"the gradient's sum of squares (step {pending.step + 1})",
                    others,
                )
            ]
            self._began(pending, works, others.numel() * others.element_size())

    def _tied_norm(self) -> torch.Tensor | None:
        """The tied copy's gradient (whole on every replica) onto this replica's part of it;
        its norm."""
        name = self.trained.tied
        if name is None:
            return None
        param = self.trained.params[name]
        grad, param.grad = param.grad, None
        part = self.trained.parts.get(name)
        if part is not None:
            part.grad = next(p for p in self.plan.parts() if p.name == name).of(grad)
        return torch.nn.utils.get_total_norm([grad])

    def _update(self, pending: ShardedStep, apply: ApplyStep) -> None:
        """The norms are on the host: clip and step this replica's parts, then start gathering
        every replica's."""
        values, count = pending.figures.read(), len(pending.sums)
        others = math.sqrt(values[count]) if self.zero == 2 else values[count]
        tied = values[count + 1] if len(pending.norms) > 1 else None
        pending.read, pending.figures, pending.norms = values[:count], None, []
        apply(pending.sums, (others, tied))
        params = {n: p.detach() for n, p in self.trained.params.items()}
        mine = self.gathered.pack(
            params, like=params[next(iter(params))], replicas=[self.plan.replica]
        )
        pending.sent, pending.buffer = mine, mine.new_empty(self.gathered.numel)
        works = [
            self._post(
                partial(
                    dist.all_gather_into_tensor,
                    pending.buffer,
                    mine,
                    group=self.group,
                    async_op=True,
                ),
                f"the all-gather of the new weights (step {pending.step + 1})",
                mine,
            )
        ]
        pending.phase = Phase.GATHER
        self._began(pending, works, mine.numel() * mine.element_size())

    def _gathered(self, pending: ShardedStep) -> None:
        """Every replica's new parts into the newest version."""
        targets = {n: p.detach() for n, p in self.trained.params.items()}
        with torch.no_grad():
            self.gathered.unpack(pending.buffer, targets)
        pending.buffer = pending.sent = None
        pending.phase = Phase.DONE
        self.last, self.last_waited = pending.comm, pending.waited

    # -- collectives and their times ------------------------------------------------------------

    def _post(self, launch: Launch, what: str, tensor: torch.Tensor) -> Work:
        """Start the collective ``launch`` starts on the stage's group, through the process's
        transport (under ``emulate_nccl`` it queues with the group's other operations, as on
        NCCL); ``what``: for the emulator's reports."""
        return active().collective(self.group, launch, f"{self.name}: {what}", tensor.device)

    def _began(self, pending: ShardedStep, works: list[Work], nbytes: int) -> None:
        """``works`` (the phase's collectives, the timed one first) have started."""
        pending.works, pending.started = works, self.clock.mark()
        pending.completed = self.clock.completion(works[0])
        self.bytes += nbytes

    def _wait(self, pending: ShardedStep, works: list[Work], block: bool) -> None:
        """Wait for ``works`` (complete already unless ``block``), counting the time blocked and
        the collective's own time."""
        began = self.clock.mark()
        with label("wait", pending.phase.name.lower(), "step", pending.step + 1):
            wait_for(works, self.timeout, self.name, f"{pending.phase.value} (step {pending.step})")
        now = self.clock.mark()
        if block:
            self._count(self.waited, pending.waited, Span(began, now))
        if pending.works:
            self._count(self.comm, pending.comm, Span(pending.started, pending.completed.at(now)))
        pending.works = []

    @staticmethod
    def _count(total: Tally, chain: Tally, span: Span) -> None:
        """``span`` into the stage's ``total`` and the chain's own."""
        total.add(span)
        chain.add(span)

    @property
    def comm_s(self) -> float:
        return self.comm.seconds

    @property
    def wait_s(self) -> float:
        return self.waited.seconds

    def gather_state(self, state: NamedState, group: dist.ProcessGroup) -> NamedState | None:
        """The whole optimizer and correction state of the stage from every replica's part
        (``state``: this replica's), on replica 0 (None on the others); a collective call over
        ``group`` (gloo), through host memory."""
        parts: list[NamedState] | None = [None] * self.plan.dp if self.plan.replica == 0 else None
        with peer_failures(self.name, "the other replicas' parts of its state (a gather)"):
            dist.gather_object(state_to(state, "cpu"), parts, group=group, group_dst=0)
        return None if parts is None else self.plan.join_states(parts)

    def report(self, prefix: str) -> dict[str, float]:
        """The chains' measurements for a stage report, keys starting ``prefix``."""
        last, last_waited = self.last.seconds, self.last_waited.seconds
        return comm_report(prefix, self.comm_s, self.wait_s, self.bytes, last, last_waited)


@dataclass(frozen=True)
class StageGroups:
    """A model stage's replicas as process groups: ``chain`` for the update's collectives,
    ``state`` (gloo, on the CPU) to gather the optimizer state at a checkpoint."""

    chain: dist.ProcessGroup
    state: dist.ProcessGroup


def stage_groups(
    layout: ParallelLayout, replicas: dist.ProcessGroup, backend: str
) -> dict[int, StageGroups]:
    """The groups of each model stage this process holds, over the stage's replicas: for the
    chain, ``replicas`` itself where a process holds one model stage, else one group per model
    stage (see the module's docstring); for the state, the chain's on plain gloo, else a gloo
    group of its own (a checkpoint's state travels through host memory, never the GPU's; under
    ``emulate_nccl`` the chain's group has the emulator's queue, which the state's gather, made
    outside the transport, must not share). Every rank must call it, in the same order relative
    to other groups."""
    mine = {}
    for stage in range(layout.model_stages):
        ranks = [layout.rank_of(stage, r) for r in range(layout.dp)]
        transport = active()
        chain = (
            transport.new_group(ranks, f"chain of stage {stage}") if layout.chunks > 1 else replicas
        )
        plain = backend == "gloo" and not transport.emulated
        state = chain if plain else transport.new_group(ranks, f"state of stage {stage}", "gloo")
        if stage in layout.stages:
            mine[stage] = StageGroups(chain, state)
    return mine
