"""How a duration is measured (:mod:`nobubble.pipeline.timing`): the wall clock on the CPU, read
at once, as the runtime always measured; CUDA events on CUDA, recorded around what is measured
and read only once they have completed, never before the step ends. The CUDA path runs here
with a stand-in for ``torch.cuda.Event`` that logs what is done to it. No test asserts a
measured time: the clock's readings are made up.
"""

from __future__ import annotations

import datetime
import itertools

import pytest
import torch

from nobubble.layout import ParallelLayout
from nobubble.pipeline import timing
from nobubble.pipeline.channels import Channel
from nobubble.pipeline.comm import Messenger, PendingRecv
from nobubble.pipeline.links import Links
from nobubble.pipeline.timing import WALL, EventClock, Span, Tally, clock_for


class Log:
    """What was done to the fake events, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.count = itertools.count()

    def reads(self) -> list[str]:
        """The calls that would read an event's time or wait for it."""
        return [c for c in self.calls if c.startswith(("elapsed", "synchronize"))]


class FakeEvent:
    """A CUDA event: recorded at a made-up GPU time (ms), completed once ``done`` is set;
    ``elapsed_time`` fails before both have completed, as CUDA's does."""

    def __init__(self, log: Log, enable_timing: bool = False) -> None:
        assert enable_timing
        self.log, self.done, self.ms, self.name = log, False, None, None

    def record(self) -> None:
        self.name = f"e{next(self.log.count)}"
        self.ms = float(10 * int(self.name[1:]) ** 2)
        self.log.calls.append(f"record {self.name}")

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.calls.append(f"synchronize {self.name}")
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.done and end.done, "read before the events completed: a device sync"
        self.log.calls.append(f"elapsed {self.name} {end.name}")
        return end.ms - self.ms


def fake_clock() -> tuple[EventClock, Log, list[FakeEvent]]:
    """A CUDA clock on fake events: the clock, the log, and every event it made."""
    log, made = Log(), []

    def event(**kwargs) -> FakeEvent:
        made.append(FakeEvent(log, **kwargs))
        return made[-1]

    return EventClock(event), log, made


@pytest.fixture
def readings(monkeypatch) -> list[float]:
    """The wall clock's readings, in order, made up (each later one 1.5 s on)."""
    times = [float(t) * 1.5 for t in range(1, 100)]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: times.pop(0))
    return times


# -- the CPU: the wall clock, read at once ------------------------------------------------------


def test_the_cpu_and_cuda_devices_have_their_clocks():
    assert clock_for(torch.device("cpu")) is WALL
    assert isinstance(clock_for(torch.device("cuda", 0)), EventClock)
    assert clock_for(torch.device("cuda", 0)) is clock_for(torch.device("cuda", 0))
    assert clock_for(torch.device("cuda", 0), "gloo") is WALL  # its waits block the CPU


def test_on_the_cpu_a_span_is_the_wall_clock_and_adds_at_once(readings):
    tally = Tally()
    start = WALL.mark()  # 1.5
    tally.add(WALL.span(start))  # 3.0 - 1.5
    assert tally.unread == 0
    assert tally.seconds == 1.5
    assert Span(2.0, 4.5).seconds() == 2.5


def test_the_cpu_accounting_of_an_action_is_the_old_wall_clock_arithmetic(readings):
    """An action's time minus the waits inside it, the segment's idle time the waits while
    training: the runtime's accounting before the clock, ``took = end - began - (blocked after
    - blocked before)``."""
    waited, idle, took = Tally(), Tally(), Tally()
    waited.add(Span(0.0, 0.25))  # before training: not the segment's
    with waited.copied_to(idle):
        began = WALL.mark()  # 1.5
        with waited.copied_to(took, -1.0):
            stalled = WALL.mark()  # 3.0
            waited.add(WALL.span(stalled))  # 4.5 - 3.0
        took.add(WALL.span(began))  # 6.0 - 1.5
    waited.add(Span(0.0, 1.0))  # after: neither's
    assert took.seconds == (6.0 - 1.5) - (4.5 - 3.0)
    assert idle.seconds == 1.5
    assert waited.seconds == 0.25 + 1.5 + 1.0


# -- CUDA: events, read lazily ------------------------------------------------------------------


def test_on_cuda_a_span_is_two_events_read_only_once_they_completed():
    clock, log, made = fake_clock()
    tally = Tally()
    start = clock.mark()
    tally.add(clock.span(start))
    assert log.calls == ["record e0", "record e1"]
    tally.settle()  # not completed: nothing read, nothing waited for
    assert tally.unread == 1 and log.reads() == []
    for event in made:
        event.done = True
    tally.settle()
    assert tally.unread == 0
    assert log.reads() == ["elapsed e0 e1"]
    assert tally.seconds == 0.01  # e1 at 10 ms, e0 at 0


def test_settling_reads_the_completed_spans_and_keeps_the_rest():
    clock, log, made = fake_clock()
    tally = Tally()
    for _ in range(3):
        tally.add(clock.span(clock.mark()))
    for event in made[:4]:  # the first two spans' events
        event.done = True
    tally.settle()
    assert tally.unread == 1
    assert log.reads() == ["elapsed e0 e1", "elapsed e2 e3"]


def test_reading_the_sum_waits_for_the_spans_left():
    """At a segment's end (never inside an action) the sum waits for the last events."""
    clock, log, _ = fake_clock()
    tally = Tally()
    tally.add(clock.span(clock.mark()))
    assert tally.seconds == 0.01
    assert log.reads() == ["synchronize e0", "synchronize e1", "elapsed e0 e1"]


def test_deducted_waits_are_read_with_the_action_they_were_in():
    """An action's events around a wait's: its time is the span minus the wait, read after."""
    clock, log, made = fake_clock()
    waited, took = Tally(), Tally()
    began = clock.mark()  # e0 at 0 ms
    with waited.copied_to(took, -1.0):
        stalled = clock.mark()  # e1 at 10
        waited.add(clock.span(stalled))  # e2 at 40
    took.add(clock.span(began))  # e3 at 90
    assert log.reads() == [] and took.unread == 2
    for event in made:
        event.done = True
    assert took.seconds == pytest.approx(0.09 - 0.03)
    assert waited.seconds == pytest.approx(0.03)


class ReceivedWork:
    """A posted receive that has arrived: ``wait`` logs where it ran among the events."""

    def __init__(self, log: Log) -> None:
        self.log = log

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.log.calls.append("wait")
        return True


def test_the_messengers_idle_time_on_cuda_is_the_stream_around_its_wait():
    """Events recorded before and after the (stream) wait; read only when asked, after."""
    clock, log, made = fake_clock()
    messenger = Messenger(ParallelLayout(pp=2, rank=1), 5.0, Links(), clock=clock)
    cpu = torch.device("cpu")
    pending = PendingRecv(
        torch.zeros(2), ReceivedWork(log), 0, None, "a", Channel.ACTIVATION, 0, cpu, torch.float32
    )
    messenger.wait(pending)
    assert log.calls == ["record e0", "wait", "record e1"]
    assert messenger.waited.unread == 1
    for event in made:
        event.done = True
    assert messenger.waited_s == 0.01
    assert log.reads() == ["elapsed e0 e1"]
