"""Connect every process group of a pipeline before its first action (``p2p_warmup``).

NCCL connects two ranks for point-to-point on a communicator the first time one sends to the
other there, and that setup blocks the posting thread until the peer posts its own first
operation of the pair. The runtime posts receives ahead of need (``RECV_AHEAD``) on one edge's
group while its neighbour waits to post on another, so without a warm-up most schedules hang at
step 0 (the emulator shows it: :mod:`nobubble.pipeline.emulated_nccl`). Here every rank first
makes one message on each of its stage edges (one way, as the edge carries its messages) and one
all-reduce on each of its collective groups (tied copies, replicas, a sharded update's chain),
all in one order that every rank agrees on. Two ranks that wait on each other are then at the
same connection: a rank waiting at a connection waits for a peer that is at an earlier one in
that order, and the earliest one has both of its sides. The messages carry a zero and change
nothing that a run computes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nobubble.layout import ParallelLayout
from nobubble.pipeline.channels import Channel, tag
from nobubble.pipeline.comm import Messenger
from nobubble.pipeline.replicas import peer_failures
from nobubble.pipeline.transport import Transport, Work

ORDER_EDGES, ORDER_TIED, ORDER_REPLICAS, ORDER_CHAINS = range(4)  # the order's first key


@dataclass(frozen=True)
class Connection:
    """A group to connect: its place in the one order (the same tuple on every rank), what it
    is (for an error), and, for a stage edge, the global ranks of its sender and receiver (a
    collective group has neither)."""

    order: tuple[int, ...]
    group: dist.ProcessGroup
    what: str
    sender: int | None = None
    receiver: int | None = None


def edge_connections(messenger: Messenger, layout: ParallelLayout) -> list[Connection]:
    """The stage edges this rank sends or receives on (a two-rank group each)."""
    connections = []
    for (channel, receiver, replica), group in messenger.links.edges.items():
        sender = receiver + 1 if channel is Channel.GRADIENT else receiver - 1
        ends = layout.rank_of(sender, replica), layout.rank_of(receiver, replica)
        if group is None or layout.rank not in ends:
            continue  # on one process (no message), or not this rank's
        name = channel.name.lower().replace("_", " ")
        what = f"the {name} edge {sender}->{receiver} of replica {replica}"
        connections.append(
            Connection((ORDER_EDGES, replica, receiver, channel), group, what, *ends)
        )
    return connections


def collective_connections(
    layout: ParallelLayout,
    tied: dist.ProcessGroup | None,
    replicas: dist.ProcessGroup | None,
    chains: dict[int, dist.ProcessGroup],
) -> list[Connection]:
    """This rank's collective groups: its tied copies', its replicas', and the chain of each
    of its model stages where that is a group of its own (``chains``: stage -> group)."""
    connections = []
    if tied is not None:
        connections.append(Connection((ORDER_TIED,), tied, "the tied copies' group"))
    if replicas is not None:
        what = f"the replicas' group of {layout.name()}"
        connections.append(Connection((ORDER_REPLICAS, layout.stages[0]), replicas, what))
    for stage, chain in chains.items():
        if chain is not replicas:
            what = f"the sharded update's group of stage {stage}"
            connections.append(Connection((ORDER_CHAINS, stage), chain, what))
    return connections


def connect(messenger: Messenger, connections: Iterable[Connection], device: torch.device) -> None:
    """Make the first operation of each of ``connections``, in their order, and wait for it.
    A peer that does not answer within ``p2p_timeout_s`` (or exited) is a
    :class:`PeerFailure` naming the group."""
    transport, rank, me = messenger.transport, messenger.layout.rank, messenger.layout.name()
    for connection in sorted(connections, key=lambda c: c.order):
        what = f"the first operation on {connection.what} (p2p_warmup)"
        with peer_failures(me, what):
            if connection.sender is None:
                work = _all_reduce(transport, connection.group, device, what)
            elif connection.sender == rank:
                zero = torch.zeros(1, device=_message_device(messenger, device))
                work = transport.send(zero, connection.receiver, connection.group, TAG, what)
            else:
                buffer = torch.empty(1, device=_message_device(messenger, device))
                work = transport.recv(buffer, connection.sender, connection.group, TAG, what)
            work.wait(messenger.timeout)


TAG = tag(Channel.CONNECT, 0)


def _message_device(messenger: Messenger, device: torch.device) -> torch.device:
    return torch.device("cpu") if messenger.links.on_cpu(Channel.ACTIVATION) else device


def _all_reduce(
    transport: Transport, group: dist.ProcessGroup, device: torch.device, what: str
) -> Work:
    zero = torch.zeros(1, device=device)

    def launch() -> dist.Work:
        return dist.all_reduce(zero, group=group, async_op=True)

    return transport.collective(group, launch, what, device)
