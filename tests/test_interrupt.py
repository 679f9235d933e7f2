"""Which signals stop gracefully and which abort (the handlers run in this, the main, thread)."""

import os
import signal

import pytest

from nobubble.interrupt import stop_on_signals


def deliver(signum: int) -> None:
    os.kill(os.getpid(), signum)
    signal.getsignal(signum)  # a bytecode boundary: the Python-level handler has run by now


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (signal.SIGINT, signal.SIGINT),  # Ctrl-C twice in one process
        (signal.SIGINT, signal.SIGTERM),  # Ctrl-C twice under torchrun: the launcher's SIGTERM
        (signal.SIGTERM, signal.SIGINT),  # a preempted run the user then interrupts
    ],
)
def test_a_second_interrupt_aborts_without_waiting_for_the_step(first, second):
    with stop_on_signals(announce=False) as stop:
        deliver(first)
        assert stop() and stop.signum == first
        with pytest.raises(KeyboardInterrupt):
            deliver(second)


def test_a_preemption_notice_delivered_twice_is_one_graceful_stop():
    """SLURM signals the worker and its launcher, which forwards the SIGTERM once more."""
    with stop_on_signals(announce=False) as stop:
        deliver(signal.SIGTERM)
        deliver(signal.SIGTERM)
        assert stop.signum == signal.SIGTERM


def test_the_previous_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with stop_on_signals(announce=False):
        pass
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
