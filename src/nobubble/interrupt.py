"""Graceful stops: SIGTERM or Ctrl-C finish the step in flight, save a checkpoint, then exit.

A second interrupt aborts at once without saving. What counts as the second one: any SIGINT after
the first stop signal (another Ctrl-C, or torchrun forwarding one), and a SIGTERM after a SIGINT.
The latter is how a second Ctrl-C reaches the workers under torchrun: they run in sessions of their
own, so the terminal's SIGINTs reach only the launcher, which forwards the first as SIGINT and
answers the second by sending SIGTERM. A SIGTERM after a SIGTERM does not abort: schedulers (SLURM,
Kubernetes) often deliver a preemption notice both to the worker and to its launcher, which forwards
it once more; that is one request to stop, and the checkpoint it asks for must still be written.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator


class Interrupted(Exception):
    """Stopped early on a signal: training, after saving a checkpoint, or a command, after its
    children (:mod:`nobubble.children`); the process exits 128 + ``signum``."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


class StopRequest:
    """Callable flag: true once a stop signal arrived."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self) -> bool:
        return self.signum is not None


def aborts(first: int | None, signum: int) -> bool:
    """Whether ``signum``, arriving after the stop signal ``first`` (None: none yet), aborts."""
    return first is not None and (signum == signal.SIGINT or first == signal.SIGINT)


@contextlib.contextmanager
def stop_on_signals(announce: bool = True) -> Iterator[StopRequest]:
    """Turn the first SIGTERM/SIGINT into a stop request; a second interrupt aborts at once."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request  # signal handlers can only be installed from the main thread
        return

    def handler(signum: int, frame: object) -> None:
        if aborts(request.signum, signum):
            raise KeyboardInterrupt
        if request.signum is not None:
            return  # the same stop, delivered twice
        request.signum = signum
        if announce:
            print(
                f"nobubble: {signal.Signals(signum).name}: finishing the step in flight, then "
                "saving a checkpoint (Ctrl-C again aborts without saving)",
                file=sys.stderr,
                flush=True,
            )

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
