"""How long a stage holds the messages it sent: a send that reports its completion (NCCL's) is let
go at the next send; one that reports it only through ``wait()`` (gloo's) stays in the window of
``SEND_WINDOW`` sends until it is the oldest. Real transports run these paths in
tests/test_pipeline_parity.py and tests/test_emulated_nccl.py (whose sends report completion);
here a fake one says when a send is done.
"""

from __future__ import annotations

import datetime

import pytest
import torch

from nobubble.layout import ParallelLayout
from nobubble.pipeline.channels import Channel
from nobubble.pipeline.comm import SEND_WINDOW, Messenger, PeerFailure
from nobubble.pipeline.links import Links


class FakeSend:
    """A send's work: ``received`` once its peer has the data; it says so to ``is_completed()``
    only if ``reports`` (NCCL), else only through ``wait()`` (gloo)."""

    def __init__(self, reports: bool, fails: bool) -> None:
        self.reports, self.fails = reports, fails
        self.received = self.waited = False

    def is_completed(self) -> bool:
        return self.reports and self.received

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.waited = True
        if self.fails:
            raise RuntimeError("connection closed by peer")
        return True


class FakeTransport:
    def __init__(self, reports: bool, fails: bool = False) -> None:
        self.reports, self.fails = reports, fails
        self.works: list[FakeSend] = []

    def send(self, tensor, rank, group, tag, what) -> FakeSend:
        self.works.append(FakeSend(self.reports, self.fails))
        return self.works[-1]


def messenger(transport: FakeTransport) -> Messenger:
    sender = Messenger(ParallelLayout(pp=2, rank=0), 5.0, Links())
    sender.transport = transport
    return sender


def send(sender: Messenger, microbatch: int) -> None:
    sender.send(torch.full((4,), float(microbatch)), 1, Channel.ACTIVATION, microbatch)


def held(sender: Messenger) -> list[float]:
    """The microbatches whose messages the stage still holds."""
    return [tensor[0].item() for _, tensor in sender.sends]


def test_a_send_that_reports_its_completion_is_let_go_at_the_next_send():
    transport = FakeTransport(reports=True)
    sender = messenger(transport)
    for mb in range(3):
        send(sender, mb)
    transport.works[0].received = transport.works[2].received = True  # out of order: two peers
    send(sender, 3)
    assert held(sender) == [1.0, 3.0]
    assert [w.waited for w in transport.works] == [True, False, True, False]
    transport.works[1].received = transport.works[3].received = True
    sender.drain()
    assert held(sender) == []


def test_a_send_that_reports_only_through_wait_stays_in_the_window():
    transport = FakeTransport(reports=False)
    sender = messenger(transport)
    for mb in range(SEND_WINDOW + 3):
        send(sender, mb)
        transport.works[-1].received = True  # received, but gloo does not say so
    assert held(sender) == [float(mb) for mb in range(3, SEND_WINDOW + 3)]
    assert [w.waited for w in transport.works] == [True] * 3 + [False] * SEND_WINDOW


def test_a_completed_send_that_failed_raises_when_it_is_let_go():
    transport = FakeTransport(reports=True, fails=True)
    sender = messenger(transport)
    send(sender, 0)
    transport.works[0].received = True
    with pytest.raises(PeerFailure, match=r"exited or crashed.*connection closed by peer"):
        send(sender, 1)


class Received:
    """A receive's work that is done at once."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def test_activations_and_gradients_travel_in_the_wire_dtype_and_arrive_as_asked():
    """Under bfloat16 autocast (p2p_dtype=auto) a stage's float32 activations and gradients
    travel in bfloat16, half the bytes, and are handed to the receiver in the dtype it asked
    for; control messages and statistics travel as they are."""
    transport = FakeTransport(reports=True)
    transport.recv = lambda buffer, rank, group, tag, what: (buffers.append(buffer), Received())[1]
    buffers: list[torch.Tensor] = []
    sender = Messenger(ParallelLayout(pp=2, rank=0), 5.0, Links(), torch.bfloat16)
    sender.transport = transport
    value = torch.tensor([1.0 + 2**-10, 3.0])  # 1 + 2^-10 is not a bfloat16
    for channel in (Channel.ACTIVATION, Channel.GRADIENT, Channel.EVAL_ACTIVATION, Channel.STATS):
        sender.send(value, 1, channel, 0)
    assert [t.dtype for _, t in sender.sends] == [torch.bfloat16] * 3 + [torch.float32]
    assert sender.sends[0][1].tolist() == [1.0, 3.0]  # rounded on the way
    cpu = torch.device("cpu")
    pending = sender.post_recv((2,), torch.float32, cpu, 1, Channel.GRADIENT, 0, "a gradient")
    assert buffers[-1].dtype == torch.bfloat16
    assert sender.wait(pending).dtype == torch.float32
    pending = sender.post_recv((2,), torch.float32, cpu, 1, Channel.STATS, 0, "statistics")
    assert buffers[-1].dtype == torch.float32
    plain = Messenger(ParallelLayout(pp=2, rank=0), 5.0, Links())  # p2p_dtype=float32
    plain.transport = FakeTransport(reports=True)
    plain.send(value, 1, Channel.ACTIVATION, 0)
    assert plain.sends[0][1].dtype == torch.float32 and plain.sends[0][1].equal(value)
