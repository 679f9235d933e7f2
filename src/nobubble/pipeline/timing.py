"""How a duration is measured on this device: the one home of that fact.

On the CPU (gloo, the NCCL emulator) every wait blocks the CPU and every operation is done when
its call returns, so the wall clock (``time.perf_counter``) is the measure, read at once.

On CUDA the CPU runs ahead of the GPU: a wait for a message in device memory makes the current
stream wait and returns at once, and NCCL's work is handed back once queued, so the CPU clock
would time the queueing, not the GPU. There a duration is a pair of
``torch.cuda.Event(enable_timing=True)`` recorded on the current stream around what is measured:

- **idle** (a wait): the time the stream stood between the two events, that is, waiting for
  the transfer, or with nothing queued while the CPU was blocked; the stream's idle time, which
  is what the CPU's blocked time is on the CPU;
- **an action**: the GPU time of the work the action queued (waits inside it deducted, as on
  the CPU);
- **a collective**: from the point of the stream where it was started to its completion, which
  a side stream that waits for it records (:meth:`EventClock.completion`).

Reading an event's time is a device sync if it has not completed, so it is never done inside an
action: a :class:`Tally` keeps the pairs unread and reads them at a step's end (those whose
events have completed: ``Event.query()``, which never waits) or at a segment's end (all,
waiting for them: the work is finished there anyway).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nobubble.pipeline.transport import Work

# a point in time: the CPU clock's reading, or a CUDA event recorded on a stream
Mark = Any  # float | torch.cuda.Event (or a test's stand-in for it)


class Span:
    """The duration from ``start`` to ``end``: seconds at once on the CPU, read from the events
    on CUDA once they have completed."""

    def __init__(self, start: Mark, end: Mark) -> None:
        self.start, self.end = start, end

    @property
    def timed(self) -> bool:
        """Whether the span is two events (read later) rather than two clock readings."""
        return not isinstance(self.start, float)

    def ready(self) -> bool:
        """Whether its time can be read without waiting for the device."""
        return not self.timed or (self.start.query() and self.end.query())

    def seconds(self) -> float:
        """Its length, waiting for its events if they have not completed (never inside an
        action: see the module's docstring)."""
        if not self.timed:
            return self.end - self.start
        if not self.ready():
            self.start.synchronize()
            self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


class Tally:
    """A sum of durations. A clock span adds at once; an event span stays unread until
    :meth:`settle` finds its events completed (or, waiting, at :attr:`seconds`)."""

    def __init__(self) -> None:
        self._read = 0.0
        self._unread: list[tuple[float, Span]] = []  # (sign, span)
        self._copies: list[tuple[Tally, float]] = []

    def add(self, span: Span, sign: float = 1.0) -> None:
        """Add ``span`` (``sign`` -1: deduct it), and to every tally copied to now."""
        if span.timed:
            self._unread.append((sign, span))
        else:
            self._read += sign * span.seconds()
        for tally, factor in self._copies:
            tally.add(span, sign * factor)

    @contextlib.contextmanager
    def copied_to(self, tally: Tally, sign: float = 1.0) -> Iterator[None]:
        """While open, every span added here is also added to ``tally`` (``sign`` -1:
        deducted from it)."""
        entry = (tally, sign)
        self._copies.append(entry)
        try:
            yield
        finally:
            self._copies.remove(entry)

    def settle(self, wait: bool = False) -> None:
        """Read the spans whose events have completed (``wait``: all, waiting for them)."""
        unread = []
        for sign, span in self._unread:
            if wait or span.ready():
                self._read += sign * span.seconds()
            else:
                unread.append((sign, span))
        self._unread = unread

    @property
    def unread(self) -> int:
        """How many spans wait to be read."""
        return len(self._unread)

    @property
    def seconds(self) -> float:
        """The sum, every span read (waiting for the device where one has not completed)."""
        self.settle(wait=True)
        return self._read


class Completion:
    """When a collective completed, as the CPU saw it: the backend's report where it gives one
    (gloo's future), else when it was noticed."""

    def __init__(self, work: Work) -> None:
        self.done: list[float] = []
        with contextlib.suppress(RuntimeError):  # no future: the completion as noticed
            work.get_future().then(lambda _: self.done.append(time.perf_counter()))

    def at(self, noticed: Mark) -> Mark:
        return self.done[0] if self.done else noticed


class EventCompletion:
    """When a collective completed on the GPU: an event a side stream records once the
    collective is done."""

    def __init__(self, event: Mark) -> None:
        self.event = event

    def at(self, noticed: Mark) -> Mark:
        return self.event


class Clock:
    """Durations on the CPU: the wall clock."""

    def mark(self) -> Mark:
        """Now."""
        return time.perf_counter()

    def span(self, start: Mark) -> Span:
        """From ``start`` to now."""
        return Span(start, self.mark())

    def completion(self, work: Work) -> Completion | EventCompletion:
        """How the completion of ``work`` (just started) will be known."""
        return Completion(work)


class EventClock(Clock):
    """Durations on CUDA: events recorded on the current stream (``event``: the event class,
    ``torch.cuda.Event`` but for tests)."""

    def __init__(self, event: Callable[..., Mark] = torch.cuda.Event) -> None:
        self.event = event
        self._side: torch.cuda.Stream | None = None  # records collectives' completions

    def mark(self) -> Mark:
        event = self.event(enable_timing=True)
        event.record()
        return event

    def completion(self, work: Work) -> EventCompletion:
        """A side stream waits for ``work`` (not the CPU, not the compute stream) and records
        when it is done."""
        self._side = self._side or torch.cuda.Stream()
        with torch.cuda.stream(self._side):
            work.wait()
            return EventCompletion(self.mark())


WALL = Clock()
_EVENTS: dict[int | None, EventClock] = {}


def clock_for(device: torch.device, backend: str | None = None) -> Clock:
    """The clock that measures durations on ``device`` (one per CUDA device: its side
    stream); ``backend``: that of the collectives it times, where it does. gloo's run on the CPU
    even with CUDA tensors, and its ``wait()`` blocks the CPU, so a side stream could not wait
    for one: they are timed by the wall clock, as on the CPU."""
    if device.type != "cuda" or backend == "gloo":
        return WALL
    return _EVENTS.setdefault(device.index, EventClock())
