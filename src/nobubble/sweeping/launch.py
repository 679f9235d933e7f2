"""Running planned runs as separate processes, a few at a time, each logging to its own file.

Each run's resolved config is written to ``<logs>/<run>.toml`` and trained with
``python -m nobubble train --config <run>.toml --auto-resume`` (under ``torchrun --standalone``
for pipeline runs, one process per stage); stdout and stderr go to ``<logs>/<run>.log``. A run that
fails does not stop the others. A half-done run (stopped or failed in an earlier session) continues
from its newest valid checkpoint; one without any to continue from is moved aside, whole, into
``<logs>/set-aside/`` (nothing is deleted: the folder may hold files of the user's, or
checkpoints that could be restored), and trained again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import tomli_w

from nobubble.checkpoint.files import checkpoint_step
from nobubble.children import Children, stopping
from nobubble.json_files import DamagedFile
from nobubble.reporting.runs import final_loss
from nobubble.runfolder.folder import FINISHED, holds_files
from nobubble.runfolder.lock import FolderBusy, hold_folder
from nobubble.runfolder.reading import checkpoints, latest_valid_checkpoint, stop_of
from nobubble.sweeping.planned import PlannedRun

POLL_S = 0.2


@dataclass(frozen=True)
class Outcome:
    run: PlannedRun
    ok: bool
    seconds: float
    detail: str  # the final val loss, or why it failed and where the log is


def command(run: PlannedRun, config_file: Path) -> list[str]:
    train = ["-m", "nobubble", "train", "--config", str(config_file), "--auto-resume"]
    if run.launcher == "torchrun":
        launcher = ["-m", "torch.distributed.run", "--standalone"]
        launcher.append(f"--nproc-per-node={run.processes}")
        return [sys.executable, *launcher, *train]
    return [sys.executable, *train]


def write_config_file(run: PlannedRun, path: Path) -> None:
    """The run's full config as TOML (unset optional keys, which TOML cannot hold, left out)."""
    values = {k: v for k, v in run.config.to_dict().items() if v is not None}
    path.write_text(tomli_w.dumps(values))


@dataclass
class _Running:
    run: PlannedRun
    process: subprocess.Popen
    log_path: Path
    log: IO[str]
    started: float


def cannot_continue(run: PlannedRun) -> str | None:
    """Why the half-done run in ``run.path`` cannot be continued, or None: it can (from a valid
    checkpoint before its last step), or there is nothing there. A checkpoint at the last step
    lacks only the summary, which a resume does not write: that run is trained again."""
    if not holds_files(run.path):
        return None
    found = latest_valid_checkpoint(run.path)
    if found is None:
        tried = len(checkpoints(run.path))
        return f"its {tried} checkpoint(s) fail verification" if tried else "it has no checkpoint"
    if checkpoint_step(found[0]) >= run.config.steps:
        return "it has a checkpoint of its last step but no summary.json"
    return None


def set_aside(run: PlannedRun, logs: Path) -> Path:
    """Move ``run.path`` into ``logs/set-aside/`` under a new name; return where."""
    folder = logs / "set-aside"
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = folder / f"{run.name}-{stamp}"
    number = 1
    while dest.exists():
        number += 1
        dest = folder / f"{run.name}-{stamp}-{number}"
    os.rename(run.path, dest)
    return dest


def make_room(run: PlannedRun, logs: Path) -> str | None:
    """Move a half-done run that cannot be continued out of the way (never deleting anything);
    a line saying so, or None if there was nothing to move. OSError if it cannot be moved,
    :class:`FolderBusy` if a process is training in it (a run without a checkpoint yet looks
    half-done)."""
    why = cannot_continue(run)
    if why is None:
        return None
    fd = hold_folder(
        run.path,
        f"{run.label}'s run folder {run.path}",
        "a `nobubble train` is training in it (one an earlier, stopped sweep left running?); "
        "stop it or let it finish, then run the sweep again",
    )
    try:
        dest = set_aside(run, logs)
    finally:
        os.close(fd)
    return (
        f"set aside {run.label}: {why}, so it cannot be continued; moved to {dest} (delete it "
        "once you no longer need it), training it again"
    )


def _start(run: PlannedRun, logs: Path, children: Children) -> _Running:
    logs.mkdir(parents=True, exist_ok=True)
    config_file = logs / f"{run.name}.toml"
    write_config_file(run, config_file)
    log_path = logs / f"{run.name}.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed when the process ends
    env = {**os.environ, "OMP_NUM_THREADS": str(run.config.threads), "PYTHONUNBUFFERED": "1"}
    process = children.start(
        command(run, config_file), stdout=log, stderr=subprocess.STDOUT, env=env
    )
    return _Running(run, process, log_path, log, time.perf_counter())


def _last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    return next((line for line in reversed(lines) if line), "(empty log)")


def _finish(job: _Running, code: int) -> Outcome:
    job.log.close()
    seconds = time.perf_counter() - job.started
    try:
        summary = job.run.summary()
    except DamagedFile as exc:
        return Outcome(job.run, False, seconds, str(exc))
    if code == 0 and summary is not None and stop_of(summary) == FINISHED:
        return Outcome(job.run, True, seconds, f"val_loss {final_loss(summary):.4f}")
    reason = f"exit {code}" if code else "exited without a summary.json"
    detail = f"{reason}: {_last_line(job.log_path)} (log: {job.log_path})"
    return Outcome(job.run, False, seconds, detail)


def _cannot_move(run: PlannedRun, exc: OSError) -> str:
    return (
        f"{run.path} holds a half-done run that cannot be continued, and moving it aside failed "
        f"({exc.strerror or exc}); move it away yourself and run the sweep again"
    )


def run_all(
    runs: Sequence[PlannedRun],
    slots: int,
    logs_dir: Callable[[PlannedRun], Path],
    say: Callable[[str], None],
) -> list[Outcome]:
    """Run in order, as many at a time as fit in ``slots`` processes (a pipeline run takes one
    slot per stage, at most all of them). SIGTERM or Ctrl-C stops the runs in flight (each saves
    a checkpoint, which the next sweep continues from) and raises :class:`Interrupted`."""
    queue = deque(runs)
    running: list[_Running] = []
    outcomes: list[Outcome] = []
    width = len(str(len(runs)))

    def slots_of(run: PlannedRun) -> int:
        return min(run.processes, slots)

    with stopping("sweep", "resume with the same command") as children:
        try:
            while queue or running:
                while queue and sum(slots_of(j.run) for j in running) + slots_of(queue[0]) <= slots:
                    run = queue.popleft()
                    index = len(runs) - len(queue)
                    try:
                        note = make_room(run, logs_dir(run))
                    except (OSError, FolderBusy) as exc:
                        why = str(exc) if isinstance(exc, FolderBusy) else _cannot_move(run, exc)
                        outcome = Outcome(run, False, 0.0, why)
                        outcomes.append(outcome)
                        say(f"FAILED {run.label}: {outcome.detail}")
                        continue
                    if note:
                        say(note)
                    running.append(_start(run, logs_dir(run), children))
                    say(f"[{index:>{width}}/{len(runs)}] start {run.label}")
                for job in list(running):
                    code = children.poll(job.process)
                    if code is None:
                        continue
                    running.remove(job)
                    outcome = _finish(job, code)
                    outcomes.append(outcome)
                    state = "done  " if outcome.ok else "FAILED"
                    say(f"{state} {job.run.label} ({outcome.seconds:.0f} s): {outcome.detail}")
                if running:
                    time.sleep(POLL_S)
        finally:
            for job in running:  # stopped (a signal) or failed with the sweep: their logs
                job.log.close()
    return outcomes
