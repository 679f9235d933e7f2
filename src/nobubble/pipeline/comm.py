"""Point-to-point messages between pipeline stages, with timeouts that name the culprit.

Every message has a channel (activation, gradient, step statistics, evaluation, control), a
sequence number (the microbatch or step) and, where a process holds several model stages, the
chunk of the stage it is for; together they form the p2p tag, so messages can be posted in any
order. Sends are asynchronous (their tensors are kept alive until they complete);
receives are posted early and waited for where their data is consumed. Which process group
carries a message is the :class:`~nobubble.pipeline.links.Links`' choice (NCCL ignores tags);
every message is posted through the process's transport (:mod:`nobubble.pipeline.transport`:
torch.distributed, or gloo run as NCCL would under ``emulate_nccl``).
"""

from __future__ import annotations

import contextlib
import datetime
import time
from dataclasses import dataclass

import torch

from nobubble.layout import ParallelLayout
from nobubble.pipeline.channels import Channel, tag
from nobubble.pipeline.links import DATA_CHANNELS, Links
from nobubble.pipeline.timing import WALL, Clock, Tally
from nobubble.pipeline.transport import MismatchedMessages, Work, active
from nobubble.profiling import label

HOST = torch.device("cpu")  # where the control plane's messages are made and read


class PeerFailure(RuntimeError):
    """A peer stage did not answer in ``p2p_timeout_s``, or its connection closed (it exited)."""


def message_name(channel: Channel, sequence: int) -> str:
    """A message, short: ``activation mb5``, ``stats step 3`` (steps counted from 1)."""
    name = channel.name.lower().replace("_", " ")
    if channel in (Channel.ACTIVATION, Channel.GRADIENT):
        return f"{name} mb{sequence}"
    if channel in (Channel.STATS, Channel.CONTROL, Channel.STOP_VOTE):
        return f"{name} step {sequence + 1}"
    return f"{name} {sequence}"


@dataclass
class PendingRecv:
    buffer: torch.Tensor
    work: Work
    peer: int  # the sending stage
    replica: int | None  # its replica (None: this rank's)
    what: str
    channel: Channel
    sequence: int
    device: torch.device  # where the receiver wants it (the buffer may be on the CPU)
    dtype: torch.dtype  # in what (the buffer may hold the wire dtype)

    def __str__(self) -> str:
        """What it brings, short (the profiler's label of its wait): :func:`message_name`."""
        return message_name(self.channel, self.sequence)


SEND_WINDOW = 16  # sends kept in flight before the oldest is waited for


class Messenger:
    """Asynchronous sends and receives of one stage, with a timeout on every wait.

    Peers are named by their stage in this rank's pipeline replica (or in the replica given); the
    layout maps them to ranks, ``links`` to the process group that carries each message.

    A send's tensor must stay alive until the send completes. A send that reports its completion
    (NCCL's do, from the GPU) is let go at the next send, so it holds no memory after it is
    received; gloo reports one only through ``wait()``, so there at most ``SEND_WINDOW`` sends
    stay outstanding and beyond that the oldest is waited for (its receiver takes messages in
    the order they were sent, and a window this deep is far older than any message a peer could
    still be waiting for first).

    Every wait is timed by ``clock`` (the process device's, :mod:`~nobubble.pipeline.timing`)
    into :attr:`waited`, the stage's idle time: on the CPU the time the CPU blocked; on CUDA the
    time the current stream stood waiting for the message (or for the CPU, while a wait for a
    message in host memory blocked it), read from events after the step.
    """

    def __init__(
        self,
        layout: ParallelLayout,
        timeout_s: float,
        links: Links,
        wire: torch.dtype | None = None,
        clock: Clock = WALL,
    ) -> None:
        self.layout, self.links, self.transport = layout, links, active()
        # the dtype activations and gradients travel in (``p2p_dtype``); None: as they are
        self.wire = wire
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.sends: list[tuple[Work, torch.Tensor]] = []
        self.clock = clock
        self.waited = Tally()  # time blocked on peers: the stage's idle time

    @property
    def waited_s(self) -> float:
        """The idle time so far, every measurement read (outside actions only)."""
        return self.waited.seconds

    def send(
        self,
        tensor: torch.Tensor,
        peer: int,
        channel: Channel,
        sequence: int,
        replica: int | None = None,
        chunk: int = 0,
    ) -> None:
        """Send ``tensor`` to model stage ``peer``; ``chunk``: which of the receiving process's
        stages it is for (the receiver's chunk, where it holds several)."""
        tensor = self._outgoing(tensor.detach().contiguous(), channel)
        rank = self.layout.rank_of(peer, replica)
        number = tag(channel, sequence, chunk, self.layout.chunks)
        group = self.links.group(channel, peer, self._replica(replica))
        what = f"send {message_name(channel, sequence)} to {self.layout.name(peer, replica)}"
        self._let_go_of_completed_sends()
        started = time.perf_counter()
        try:  # a first post on a group connects the pair (NCCL), and that may fail
            work = self.transport.send(tensor, rank, group, number, what)
        except RuntimeError as exc:
            waited = time.perf_counter() - started
            raise self._failure(what, self.layout.name(peer, replica), waited, exc) from None
        self.sends.append((work, tensor))
        if len(self.sends) > SEND_WINDOW:
            self._wait_sends(self.sends[:-SEND_WINDOW])
            del self.sends[:-SEND_WINDOW]

    def hand_over(
        self, tensor: torch.Tensor, channel: Channel, device: torch.device, dtype: torch.dtype
    ) -> torch.Tensor:
        """What a message of ``tensor`` on ``channel`` would deliver, handed to another stage of
        this process in memory (the bottom of the V): detached, in the wire dtype on the way, in
        ``dtype`` on ``device`` at the end, so that a local hand-off computes what a message
        does."""
        return tensor.detach().to(self._on_wire(tensor.dtype, channel)).to(device, dtype)

    def post_recv(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        peer: int,
        channel: Channel,
        sequence: int,
        what: str,
        replica: int | None = None,
        chunk: int = 0,
    ) -> PendingRecv:
        """Post the receive of a message from model stage ``peer`` for this process's stage of
        chunk ``chunk``."""
        on = torch.device("cpu") if self.links.on_cpu(channel) else device
        buffer = torch.empty(shape, dtype=self._on_wire(dtype, channel), device=on)
        number = tag(channel, sequence, chunk, self.layout.chunks)
        receiver = self.layout.stages[chunk]
        group = self.links.group(channel, receiver, self._replica(replica))
        rank = self.layout.rank_of(peer, replica)
        name = f"receive {message_name(channel, sequence)} from {self.layout.name(peer, replica)}"
        started = time.perf_counter()
        try:  # a first post on a group connects the pair (NCCL), and that may fail
            work = self.transport.recv(buffer, rank, group, number, name)
        except RuntimeError as exc:
            waited = time.perf_counter() - started
            raise self._failure(
                f"posting {name}", self.layout.name(peer, replica), waited, exc
            ) from None
        return PendingRecv(buffer, work, peer, replica, what, channel, sequence, device, dtype)

    def _replica(self, replica: int | None) -> int:
        return self.layout.replica if replica is None else replica

    def wait(self, pending: PendingRecv) -> torch.Tensor:
        started, stalled = time.perf_counter(), self.clock.mark()
        peer = self.layout.name(pending.peer, pending.replica)
        try:
            with label("wait", pending, "from", peer):
                self._complete(pending.work, pending.buffer)
        except RuntimeError as exc:
            raise self._failure(
                f"waiting for {pending.what} from {peer}",
                peer,
                time.perf_counter() - started,
                exc,
            ) from None
        finally:
            self.waited.add(self.clock.span(stalled))
        return self._delivered(pending)

    def _complete(self, work: Work, tensor: torch.Tensor) -> None:
        """Wait for a message (``tensor``: its data) to be sent or received.

        A message in host memory (every one on gloo and under the emulator, the control plane's
        on NCCL) is waited for by the CPU, up to ``p2p_timeout_s``: a peer that failed is found
        here. One in device memory (NCCL) makes the current stream wait for the transfer and
        lets the CPU go on at once: no CPU busy-wait (which NCCL's wait with a timeout is), no
        stream drain. A hung peer is then found by the control plane, whose gloo messages every
        step waits for (:mod:`~nobubble.pipeline.control`), and by the groups' own timeout
        (``group_timeout_s``).
        """
        if tensor.is_cuda:
            work.wait()
        else:
            work.wait(self.timeout)

    def _outgoing(self, tensor: torch.Tensor, channel: Channel) -> torch.Tensor:
        """What a send on ``channel`` posts: ``tensor``, in host memory where the link needs
        it (gloo sends from host memory; on NCCL only the control plane's messages, built on the
        CPU already)."""
        tensor = tensor.to(self._on_wire(tensor.dtype, channel))
        return tensor.cpu() if self.links.on_cpu(channel) else tensor

    def _on_wire(self, dtype: torch.dtype, channel: Channel) -> torch.dtype:
        """The dtype a message of ``dtype`` on ``channel`` travels in: an activation or a
        gradient in the wire dtype (the compute dtype under autocast: half the bytes of float32),
        anything else as it is."""
        return self.wire if self.wire is not None and channel in DATA_CHANNELS else dtype

    @staticmethod
    def _delivered(pending: PendingRecv) -> torch.Tensor:
        """A received message on the device, in the dtype, its receiver asked for."""
        return pending.buffer.to(pending.device, pending.dtype)

    def _failure(self, doing: str, peer: str | None, waited: float, exc: Exception) -> PeerFailure:
        """The error for a wait that failed: a timeout, or a peer (named) that went away, or
        (under the emulator) two stages that post their messages in different orders."""
        limit = self.timeout.total_seconds()
        who = peer if peer is not None else "the receiving stage"
        me = self.layout.name()
        if isinstance(exc, MismatchedMessages):
            return PeerFailure(f"{me} stopped {doing}: {exc}")
        if waited < 0.9 * limit:  # the transport gave up early: the connection is gone
            return PeerFailure(
                f"{me} stopped {doing}: {who} exited or crashed (its own error, "
                f"in its log or above, says why). Transport said: {exc}"
            )
        hint = self.links.hang_hint()
        return PeerFailure(
            f"{me} gave up {doing} (limit {limit:.0f}s): {who} is stuck or died, "
            f"see its log; raise p2p_timeout_s if it is only slow. Transport said: {exc}"
            + (f"\n{hint}" if hint else "")
        )

    def recv(self, *args, **kwargs) -> torch.Tensor:
        return self.wait(self.post_recv(*args, **kwargs))

    def drain(self) -> None:
        """Wait for every send of this stage to be received."""
        self._wait_sends(self.sends)
        self.sends.clear()

    def _let_go_of_completed_sends(self) -> None:
        """Drop the sends that have completed (their ``wait()`` returns at once, and raises a
        transport's error as any wait would)."""
        completed: list[tuple[Work, torch.Tensor]] = []
        pending: list[tuple[Work, torch.Tensor]] = []
        for send in self.sends:
            (completed if send[0].is_completed() else pending).append(send)
        if completed:
            self._wait_sends(completed, labelled=False)
        self.sends = pending

    def _wait_sends(self, sends: list[tuple[Work, torch.Tensor]], labelled: bool = True) -> None:
        started, stalled = time.perf_counter(), self.clock.mark()
        try:
            with label("wait", len(sends), "sends") if labelled else contextlib.nullcontext():
                for work, tensor in sends:
                    self._complete(work, tensor)
        except RuntimeError as exc:
            waited = time.perf_counter() - started
            doing = "waiting for a message it sent to be received"
            raise self._failure(doing, None, waited, exc) from None
        finally:
            self.waited.add(self.clock.span(stalled))
