"""Start ``nobubble`` runs for the tests without paying torch's import in every process.

Importing torch, torch._dynamo and nobubble costs about 5 s of CPU per process on a CI core, and a
4-stage torchrun launch runs it five times (the agent and four workers) for a run that trains in
under a second. Here a forkserver imports them once per test session, and every process of a run
is forked from it with the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT): nobubble takes the same code path as under torchrun, except that rank 0
hosts the rendezvous store instead of torchrun's agent (nobubble's path for other launchers).
The launches that must exercise torchrun itself (restarts, signals, several nodes, the agent's
store) still run it, with :func:`tests.helpers.pipeline.train_command`.

Like torchrun, a launch stops the other processes when one fails, and its exit status is the
first failure's.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "nobubble.cli",
    "nobubble.run.train",
    "tests.helpers.launcher",
]
_CONTEXT: multiprocessing.context.ForkServerContext | None = None
_STOP_GRACE_S = 10.0  # torchrun's default grace after SIGTERM before it kills


def _context() -> multiprocessing.context.ForkServerContext:
    """The forkserver, started once with one OpenMP thread (libgomp reads it when torch loads;
    every process forked from the server inherits that runtime)."""
    global _CONTEXT
    if _CONTEXT is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _CONTEXT = context
    return _CONTEXT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process_main(
    argv: list[str],
    environ: dict[str, str],
    out: str,
    err: str,
    prepare: Callable[[], None] | None = None,
) -> None:
    """One process of a launch: ``nobubble ARGV`` with ``environ``, its output to two files;
    ``prepare``: called first (a test's instruments)."""
    os.environ.clear()
    os.environ.update(environ)
    for stream, path in ((sys.stdout, out), (sys.stderr, err)):
        stream.flush()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, stream.fileno())
        os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if prepare is not None:
        prepare()
    sys.argv = ["nobubble", *argv]
    from nobubble.cli import main

    raise SystemExit(main(argv))


def run_nobubble(
    argv: Sequence[str],
    processes: int = 0,
    timeout: float = 300,
    env: Mapping[str, str] | None = None,
    prepare: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess:
    """``nobubble ARGV`` in one process (``processes=0``) or as ``processes`` ranks on this
    machine; like ``subprocess.run(..., capture_output=True, text=True)``, the ranks' output in
    rank order. ``prepare``: a module-level function every process calls first."""
    context = _context()
    environ = dict(os.environ if env is None else env)
    ranks = max(processes, 1)
    if processes:
        environ |= {
            "WORLD_SIZE": str(processes),
            "LOCAL_WORLD_SIZE": str(processes),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
        }
    with tempfile.TemporaryDirectory(prefix="nobubble-launch-") as logs:
        outs = [Path(logs, f"{r}.out") for r in range(ranks)]
        errs = [Path(logs, f"{r}.err") for r in range(ranks)]
        procs = []
        for rank in range(ranks):
            rank_env = environ | ({"RANK": str(rank), "LOCAL_RANK": str(rank)} if processes else {})
            proc = context.Process(
                target=_process_main,
                args=(list(argv), rank_env, str(outs[rank]), str(errs[rank]), prepare),
            )
            proc.start()
            procs.append(proc)
        code = _wait(procs, timeout, argv)
        return subprocess.CompletedProcess(
            ["nobubble", *argv],
            code,
            "".join(p.read_text() for p in outs),
            "".join(p.read_text() for p in errs),
        )


def _wait(procs: list, timeout: float, argv: Sequence[str]) -> int:
    """Wait for every process; on the first failure stop the rest (SIGTERM, then SIGKILL after
    a grace period) and return its status; past ``timeout`` kill them all and raise."""
    deadline = time.monotonic() + timeout
    failed: int | None = None
    stop_by = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if now > deadline:
            _kill(procs)
            raise subprocess.TimeoutExpired(["nobubble", *argv], timeout)
        for p in procs:
            if failed is None and p.exitcode not in (None, 0):
                failed = p.exitcode
                stop_by = now + _STOP_GRACE_S
                for other in procs:
                    if other.is_alive():
                        other.terminate()
        if stop_by is not None and now > stop_by:
            _kill(procs)
        multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], 0.2)
    for p in procs:
        p.join()
        if failed is None and p.exitcode != 0:
            failed = p.exitcode
    if failed is None:
        return 0
    return failed if failed > 0 else 128 - failed  # a signal: the status a shell reports


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join()
