"""Graceful stops: SIGTERM or Ctrl-C finish the step in flight, save a checkpoint, then exit."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator


class Interrupted(Exception):
    """Training stopped early on a signal, after saving a checkpoint."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


class StopRequest:
    """Callable flag: true once a stop signal arrived."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self) -> bool:
        return self.signum is not None


@contextlib.contextmanager
def stop_on_signals(announce: bool = True) -> Iterator[StopRequest]:
    """Turn the first SIGTERM/SIGINT into a stop request; a second Ctrl-C aborts at once."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request  # signal handlers can only be installed from the main thread
        return

    def handler(signum: int, frame: object) -> None:
        if request.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
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
