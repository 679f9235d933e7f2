"""The processes a command starts, stopped with it: the one rule for every command that has any.

``nobubble sweep``, ``nobubble bench`` and the GPU check (``scripts/gpu_check.sh``, through this
module's command line) start their children here. Each child leads a session of its own, so the
terminal's Ctrl-C reaches only the command, and a signal the command passes on reaches the child's
whole process group. On SIGTERM or SIGINT the command

1. sends the same signal to every child's process group: a ``nobubble train`` finishes its step,
   saves a checkpoint and exits; torchrun passes the signal on to its workers (they run in
   sessions of their own, so only torchrun may send it: a SIGINT sent to them twice would abort
   without saving, see :mod:`nobubble.interrupt`);
2. waits up to :data:`GRACE_S` for every process of the children's trees to exit (a second
   Ctrl-C, or a SIGTERM after one, ends the wait at once: :func:`nobubble.interrupt.aborts`);
3. kills whatever is left of the trees (SIGKILL of each process, found through ``/proc`` while the
   tree was whole, so torchrun's workers too), and raises :class:`Interrupted` with one line
   saying what was stopped; the command exits 128 + the signal's number.

No child outlives the command: the same end (SIGTERM, the grace period, SIGKILL) comes to every
child still running when the command leaves the ``with stopping(...)`` block for any reason.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from nobubble.interrupt import Interrupted, aborts

# Seconds a stopped child gets to save its checkpoint and exit before it is killed: within the
# 30 s that SLURM (KillWait) and Kubernetes (terminationGracePeriodSeconds) give a job by default.
GRACE_S = 20.0
POLL_S = 0.05
SIGNALS = (signal.SIGTERM, signal.SIGINT)

Identity = tuple[int, int]  # a process: its pid and its start time (a pid may be reused)


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None: gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def identity(pid: int) -> Identity | None:
    """``pid`` with its start time, or None if it is gone (or a zombie: it has exited)."""
    fields = _stat(pid)
    if fields is None or fields[0] == "Z":
        return None
    return pid, int(fields[19])


def alive(process: Identity) -> bool:
    return identity(process[0]) == process


def descendants(pid: int) -> set[Identity]:
    """Every live process below ``pid`` (children, their children, ...), whatever their session;
    empty where there is no /proc."""
    below: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            fields = _stat(int(entry.name)) if entry.name.isdigit() else None
            if fields is not None:
                below.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[Identity] = set()
    todo = list(below.get(pid, []))
    while todo:
        child = todo.pop()
        ident = identity(child)
        if ident is not None and ident not in found:
            found.add(ident)
            todo.extend(below.get(child, []))
    return found


def _send(pid: int, sig: int, group: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # gone already
        (os.killpg if group else os.kill)(pid, sig)


class Children:
    """The processes one command started, and how they end (see the module's docstring)."""

    def __init__(self, command: str, then: str, grace_s: float) -> None:
        self.command = command
        self.then = then  # what the stop line says to do next
        self.grace_s = grace_s
        self.processes: list[subprocess.Popen] = []
        self.signum: int | None = None
        self.signalled: set[int] = set()  # pids the stop signal was sent to
        self.trees: set[Identity] = set()  # every process below a child, seen at a stop
        self.abort = False
        self.holding = False  # starting or ending a child: a stop raises only after it

    def start(self, args: Sequence[str], **popen: Any) -> subprocess.Popen:
        """``subprocess.Popen(args, **popen)`` in a session of its own, stopped with the command."""
        self.holding = True
        try:
            process = subprocess.Popen(args, start_new_session=True, **popen)
            self.processes.append(process)
        finally:
            self.holding = False
        if self.signum is not None:  # the stop came while it started
            self._pass_on(self.signum)
            raise self.interrupted()
        return process

    def wait(self, process: subprocess.Popen, timeout: float | None = None) -> int:
        """Its exit code, once it has exited (``subprocess.TimeoutExpired`` after ``timeout``)."""
        code = process.wait(timeout)
        self.processes.remove(process)
        return code

    def poll(self, process: subprocess.Popen) -> int | None:
        """Its exit code if it has exited, else None."""
        code = process.poll()
        if code is not None:
            self.processes.remove(process)
        return code

    def interrupted(self) -> Interrupted:
        assert self.signum is not None
        name = signal.Signals(self.signum).name
        count = len(self.signalled)
        runs = f"{count} run{'s' if count != 1 else ''} stopped"
        return Interrupted(self.signum, f"{self.command}: stopped by {name}; {runs}, {self.then}")

    def on_signal(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
            self._pass_on(signum)
            if not self.holding:
                raise self.interrupted()
        elif aborts(self.signum, signum):
            self.abort = True

    def _pass_on(self, signum: int) -> None:
        """Send ``signum`` to each running child's process group, once."""
        for process in self.processes:
            if process.pid not in self.signalled and process.poll() is None:
                self.trees |= descendants(process.pid)
                _send(process.pid, signum, group=True)
                self.signalled.add(process.pid)

    def end(self) -> None:
        """Stop every child still running: its stop signal (SIGTERM if none came), up to
        ``grace_s`` for its whole tree to exit, then SIGKILL of whatever is left of it."""
        self.holding = True
        self._pass_on(self.signum or signal.SIGTERM)
        running = [p for p in self.processes if p.poll() is None]
        for process in running:
            self.trees |= descendants(process.pid)
        deadline = time.monotonic() + self.grace_s

        def left() -> bool:
            return any(p.poll() is None for p in running) or any(map(alive, self.trees))

        while left() and not self.abort and time.monotonic() < deadline:
            time.sleep(POLL_S)
        for process in running:
            if process.poll() is None:
                self.trees |= descendants(process.pid)
                _send(process.pid, signal.SIGKILL, group=True)
        for process in self.trees:
            if alive(process):
                _send(process[0], signal.SIGKILL)
        for process in running:
            process.wait()
        self.processes.clear()


@contextlib.contextmanager
def stopping(command: str, then: str, grace_s: float = GRACE_S) -> Iterator[Children]:
    """Within the block, SIGTERM and SIGINT stop the command and every child it started there
    (:meth:`Children.start`), raising :class:`Interrupted` ("sweep: stopped by SIGTERM; 2 runs
    stopped, ``then``"); whatever the block ends with, no child outlives it."""
    children = Children(command, then, grace_s)
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, children.on_signal) for sig in SIGNALS}
    else:  # signal handlers can only be installed from the main thread
        previous = {}
    try:
        yield children
    finally:
        try:
            children.end()
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)
    if children.signum is not None:  # a stop that came while the last child was ending
        raise children.interrupted()


def shell_status(code: int) -> int:
    """A process's exit status as a shell reports it (killed by signal N: 128 + N)."""
    return 128 - code if code < 0 else code


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m nobubble.children [--timeout S] -- COMMAND...``: COMMAND under the rule above,
    for scripts (the GPU check). Run it in the background and pass your signals on to it: it
    leaves the terminal's process group, so that a Ctrl-C reaches it once, through the script."""
    parser = argparse.ArgumentParser(prog="python -m nobubble.children", description=__doc__)
    parser.add_argument("--name", help="what the stop line calls it (default: COMMAND's name)")
    parser.add_argument(
        "--timeout", type=float, help="stop COMMAND as on SIGTERM after this many seconds; exit 124"
    )
    parser.add_argument("--grace", type=float, default=GRACE_S, help=f"default: {GRACE_S:g}")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    for flag, value in (("--timeout", args.timeout), ("--grace", args.grace)):
        if value is not None and not value >= 0:
            parser.error(f"{flag} must be a number of seconds, 0 or more; got {value}")
    name = args.name or Path(command[0]).name
    with contextlib.suppress(PermissionError):  # already a session leader
        os.setsid()
    try:
        with stopping(name, "none of its processes is left", args.grace) as children:
            process = children.start(command)
            try:
                return shell_status(children.wait(process, args.timeout))
            except subprocess.TimeoutExpired:
                pass  # leaving the block stops it: SIGTERM, the grace period, SIGKILL
    except Interrupted as stop:
        print(f"nobubble: {stop}", file=sys.stderr)
        return 128 + stop.signum
    print(f"nobubble: {name}: stopped after its timeout of {args.timeout:g} s", file=sys.stderr)
    return 124


if __name__ == "__main__":
    sys.exit(main())
