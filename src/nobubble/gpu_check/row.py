"""A run of the GPU check within its own timeout: how it is started (``nobubble train``, in one
process or under torchrun, on its first GPUs), and, past its timeout, the Python stacks of its
every process dumped into its log before it is stopped (``OUT/timeouts/NAME.json``), so that a
hang says where each rank waited."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from nobubble.children import POLL_S, identity, shell_status, stopping
from nobubble.gpu_check.runs import AUDIT, CheckRun, audit_folder
from nobubble.json_files import write_json_atomic

STACKS_WAIT_S = 10.0  # how long a process gets to write its stacks and exit


def command(run: CheckRun, out: Path, python: str = sys.executable) -> list[str]:
    """How ``run`` is started: ``nobubble train`` (inside ``nobubble gpu-check audit`` for an
    audit), in one process or under torchrun."""
    train = ["train", "--no-progress", "--overwrite", "--out", str(out / "runs" / run.name)]
    entry = ["-m", "nobubble", *train]
    if run.kind == AUDIT:
        entry = ["-m", "nobubble", "gpu-check", "audit", str(audit_folder(out, run)), "--", *train]
    launcher = [python]
    if run.processes:
        launcher += ["-m", "torch.distributed.run", "--standalone"]
        launcher.append(f"--nproc-per-node={run.processes}")
    return [*launcher, *entry, *run.base, *run.settings]


def row_environment(run: CheckRun, environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with the run's GPUs (the first ``run.gpus`` of those visible) and Python's
    fault handler on: SIGABRT then writes every thread's stack before the process dies."""
    visible = environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(run.gpus)))
    first = ",".join(visible.split(",")[: run.gpus])
    return {**environ, "CUDA_VISIBLE_DEVICES": first, "PYTHONFAULTHANDLER": "1"}


def run_row(out: Path, run: CheckRun) -> int:
    """Run ``run`` (its output: this process's); past its timeout, dump the stacks of its
    processes (:func:`dump_stacks`), record it in ``out/timeouts/NAME.json``, stop what is left
    and return 124. A stop signal to this process stops the run as :mod:`nobubble.children`
    says."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    with stopping(f"gpu-check row {run.name}", "none of its processes is left") as children:
        process = children.start(command(run, out), env=row_environment(run, dict(os.environ)))
        try:
            return shell_status(children.wait(process, run.timeout_s))
        except subprocess.TimeoutExpired:
            say(f"{run.name}: no end after its timeout of {run.timeout_s:g} s; its stacks follow")
            dumped = dump_stacks(process.pid, torchrun=run.processes > 0)
    (out / "timeouts").mkdir(exist_ok=True)
    record = {"run": run.name, "timeout_s": run.timeout_s, "stacks_of": dumped}
    write_json_atomic(out / "timeouts" / f"{run.name}.json", record)
    return 124


def say(line: str) -> None:
    print(f"nobubble gpu-check: {line}", file=sys.stderr, flush=True)


def dump_stacks(root: int, torchrun: bool) -> list[str]:
    """Make each process of a run write its Python stacks (SIGABRT, with the fault handler on),
    one after the other so that their stacks do not mix, and return who they were. Under
    torchrun the workers are the agent's children; the agent is stopped meanwhile (SIGSTOP),
    or it would end the other workers when the first one dies (torchrun passes on SIGTERM,
    SIGINT, SIGHUP and SIGQUIT, and no signal that dumps stacks)."""
    workers = children_of(root) if torchrun else [root]
    if torchrun:
        os.kill(root, signal.SIGSTOP)
    dumped = []
    try:
        for pid in workers:
            who = f"{rank_of(pid)} (pid {pid})"
            say(f"the Python stacks of {who}:")
            os.kill(pid, signal.SIGABRT)
            gone(pid, STACKS_WAIT_S)
            dumped.append(who)
    finally:
        if torchrun:
            os.kill(root, signal.SIGCONT)
    return dumped


def children_of(pid: int) -> list[int]:
    """The processes ``pid`` started (none where /proc does not say)."""
    try:
        return [
            int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        ]
    except OSError:
        return []


def rank_of(pid: int) -> str:
    """``rank R`` of a torchrun worker (its environment says), else ``the process``."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return "the process"
    ranks = [entry[5:].decode() for entry in environ if entry.startswith(b"RANK=")]
    return f"rank {ranks[0]}" if ranks else "the process"


def gone(pid: int, wait_s: float) -> None:
    """Wait up to ``wait_s`` for ``pid`` to exit."""
    deadline = time.monotonic() + wait_s
    while identity(pid) is not None and time.monotonic() < deadline:
        time.sleep(POLL_S)
