"""The one way the pipeline's messages and collectives reach torch.distributed: the transport.

Every point-to-point message of :class:`~nobubble.pipeline.comm.Messenger` (activations,
gradients, statistics, control, evaluation), every all-reduce of
:mod:`~nobubble.pipeline.replicas` (the data-parallel and the tied weight's, the evaluation
totals) and every collective of a sharded update's chain
(:mod:`~nobubble.pipeline.sharded_update`) is posted through the process's transport,
:func:`active`. An ordinary run has torch.distributed as it is (:class:`Transport`);
``emulate_nccl=true`` installs gloo run in NCCL's manner
(:class:`nobubble.pipeline.emulated_nccl.EmulatedNccl`). The transport is chosen once, when the
process group opens (:func:`nobubble.pipeline.process_group.open_process_group`), and is as
process-wide as torch.distributed's default group.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist


class Work(Protocol):
    """What a posted operation hands back (a ``dist.Work``, or the emulator's own)."""

    def wait(self, timeout: datetime.timedelta = ...) -> bool: ...

    def is_completed(self) -> bool: ...

    def get_future(self) -> torch.futures.Future: ...


Launch = Callable[[], dist.Work]  # starts a collective (async_op=True) and returns its work


class MismatchedMessages(RuntimeError):
    """Two ranks post their messages on a group in orders that pair different messages (which
    NCCL, ignoring tags, would do silently): a bug of the schedule's routes, not of a peer."""


class Transport:
    """torch.distributed as it is: gloo pairs a receive with the send of its peer and tag, in
    any order; NCCL pairs them in posting order (:mod:`nobubble.pipeline.links`)."""

    emulated = False

    def __init__(self, group_timeout: datetime.timedelta | None = None) -> None:
        self.group_timeout = group_timeout  # every group's (group_timeout_s); None: torch's

    def new_group(
        self, ranks: list[int] | None, desc: str, backend: str | None = None
    ) -> dist.ProcessGroup:
        """A process group of ``ranks`` (None: every rank) with the run's group timeout
        (``dist.new_group`` gives NCCL's 10 minutes otherwise, whatever the default group has).
        Every rank must call it, in the same order, as ``dist.new_group`` requires."""
        return dist.new_group(ranks, timeout=self.group_timeout, backend=backend, group_desc=desc)

    @property
    def pairs_by_tag(self) -> bool:
        """Whether a receive takes the send with its tag whatever the order (gloo), or the
        peer's next send on that group (NCCL)."""
        return dist.get_backend() == "gloo"

    @property
    def host_messages(self) -> bool:
        """Whether point-to-point messages must be CPU tensors (gloo sends from host memory;
        its collectives take CUDA tensors too)."""
        return dist.get_backend() == "gloo"

    def send(
        self, tensor: torch.Tensor, rank: int, group: dist.ProcessGroup | None, tag: int, label: str
    ) -> Work:
        """Send ``tensor`` to global ``rank`` over ``group`` (None: the default group);
        ``label``: what it is, for the emulator's reports."""
        return dist.isend(tensor, rank, group=group, tag=tag)

    def recv(
        self, buffer: torch.Tensor, rank: int, group: dist.ProcessGroup | None, tag: int, label: str
    ) -> Work:
        """Receive into ``buffer`` from global ``rank`` over ``group``."""
        return dist.irecv(buffer, rank, group=group, tag=tag)

    def collective(
        self,
        group: dist.ProcessGroup | None,
        launch: Launch,
        label: str,
        device: torch.device,
    ) -> Work:
        """Run the collective ``launch`` starts on ``group``, with tensors on ``device``."""
        return launch()

    def control_group(self) -> dist.ProcessGroup:
        """A gloo group of every rank, whose messages pair by tag whatever the default backend
        (every rank must create it, at the same point)."""
        return self.new_group(None, "control (gloo)", "gloo")

    def close(self) -> bool:
        """Stop what the transport runs beside the process group once what it posted is done;
        whether all of it stopped."""
        return True

    def abort(self) -> None:
        """Stop what the transport runs beside the process group at once, whatever it holds."""


_ACTIVE = Transport()


def active() -> Transport:
    """The transport of this process (torch.distributed as it is, unless one was installed)."""
    return _ACTIVE


def install(transport: Transport) -> None:
    """Make ``transport`` this process's (``open_process_group``; a plain one when it closes)."""
    global _ACTIVE
    _ACTIVE = transport
