"""The fault campaign's runs, and its command line.

Each run is launched under torchrun, hit by its fault once it has logged the fault's step (and
sealed the checkpoint(s) it needs), left to end, freed of what keeps it from continuing (writes
allowed again, the disk emptied, a stopped rank killed), then launched again with
``--auto-resume`` until it finishes, and compared with its twin: the same layout and settings
without a fault, run once per layout. One run at a time; every process is stopped with the
campaign (:mod:`nobubble.children`).

    python experiments/fault_campaign.py --runs 50 --seed 0 --out runs/faults

OUT/campaign.json and OUT/campaign.md (rewritten after every run), OUT/twins/LAYOUT/ and
OUT/runs/NAME/ (the run folder and the log of each launch). Exit 1 if any run lost anything.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nobubble.children import Children, Identity, alive, identity, stopping
from nobubble.config import ConfigError
from nobubble.config.fields import NON_NEGATIVE, Range
from nobubble.config.flags import OneLineParser, whole
from nobubble.destinations import make_output_folder
from nobubble.faults.compare import what_was_lost
from nobubble.faults.draw import (
    DAMAGED_CHECKPOINT,
    FULL_DISK,
    KINDS,
    P2P_TIMEOUT_S,
    READ_ONLY,
    SETTINGS,
    SIGKILL_RANK,
    SIGSTOP_RANK,
    Layout,
    Trial,
    draw_trials,
)
from nobubble.faults.inject import (
    Undo,
    damage,
    fill,
    kill_tree,
    small_disk,
    small_disks_here,
    stop_writes,
    stop_writes_below,
    workers,
)
from nobubble.faults.summary import (
    EXACT,
    FAILED,
    LOST,
    MISSED,
    UNAVAILABLE,
    Record,
    failed,
    markdown,
    summarize,
)
from nobubble.interrupt import Interrupted
from nobubble.json_files import DamagedFile, write_json_atomic
from nobubble.provenance import machine, provenance
from nobubble.runfolder.folder import FINISHED, holds_files
from nobubble.runfolder.reading import read_metrics, read_summary, sealed_checkpoints, stop_of

PROG = "python experiments/fault_campaign.py"
RUNS = Range(1, 10_000, high_open=False, why="each run is a minute or more of torchrun launches")
LAUNCH_S = 900  # a launch still running after this is hung: killed, and the run counts as lost
END_S = 300  # a faulted launch must end by itself within this after its fault
DETECT_S = 3 * P2P_TIMEOUT_S + 60  # ... and its peers notice a dead or stopped rank within this
RESUMES = 3  # --auto-resume launches a run gets to finish
POLL_S = 0.05
WORKER_TRACEBACK = re.compile(r"^\[rank\d+\]: Traceback", re.MULTILINE)  # torch's prefix


def torchrun(layout: Layout, run: Path, *extra: str) -> list[str]:
    """The command that trains ``layout`` into ``run`` under torchrun."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    train = ["-m", "nobubble", "train", "--no-progress", "--out", str(run)]
    return [*launcher, f"--nproc-per-node={layout.world}", *train, *layout.settings(), *extra]


def steps_logged(run: Path) -> int:
    """The newest step with a train_loss in the run's metrics.jsonl (0 before any)."""
    rows = read_metrics(run, "").records
    return max((row["step"] for row in rows if "train_loss" in row), default=0)


def stopped(run: Path) -> str | None:
    """Why the run last stopped, from its summary.json (None without one)."""
    try:
        summary = read_summary(run)
    except DamagedFile as exc:
        return str(exc)
    return None if summary is None else stop_of(summary)


def ended(log: Path, code: int | None, run: Path) -> dict[str, Any]:
    """How a launch of ``run`` ended: its exit status (None: killed, hung), why the run says
    it stopped, and whether a worker ended in a Python traceback rather than a one-line error."""
    traceback = WORKER_TRACEBACK.search(log.read_text(errors="replace")) is not None
    return {"launch": log.stem, "exit": code, "stopped": stopped(run), "traceback": traceback}


def first_exit(others: Sequence[Identity], launch: subprocess.Popen, limit: float) -> float | None:
    """Seconds until one of ``others`` or the launch exits; None if none does within ``limit``."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if launch.poll() is not None or not all(map(alive, others)):
            return time.monotonic() - start
        time.sleep(POLL_S)
    return None


class Campaign:
    """The runs of one campaign into ``out``; ``unavailable``: why a fault kind cannot be done
    here, for each such kind."""

    def __init__(self, out: Path, children: Children, unavailable: dict[str, str]) -> None:
        self.out = out
        self.children = children
        self.unavailable = unavailable
        self.twins: dict[Layout, Path | str] = {}  # the twin's folder, or why it failed

    def launch(self, layout: Layout, run: Path, log: Path, *extra: str) -> subprocess.Popen:
        with log.open("w") as output:
            command = torchrun(layout, run, *extra)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            return self.children.start(command, stdout=output, stderr=subprocess.STDOUT, env=env)

    def finish(self, launch: subprocess.Popen, limit: float) -> int | None:
        """The launch's exit status, or None if it had to be killed after ``limit`` seconds."""
        try:
            return self.children.wait(launch, limit)
        except subprocess.TimeoutExpired:
            kill_tree(launch.pid)
            self.children.wait(launch)
            return None

    def twin(self, layout: Layout) -> Path | str:
        """The folder of ``layout``'s uninterrupted run (launched the first time it is asked
        for), or why it failed."""
        if layout not in self.twins:
            run = self.out / "twins" / layout.name
            run.parent.mkdir(parents=True, exist_ok=True)
            code = self.finish(self.launch(layout, run, run.with_suffix(".log")), LAUNCH_S)
            ok = code == 0 and stopped(run) == FINISHED
            why = f"its twin failed (exit {code}, see twins/{layout.name}.log)"
            self.twins[layout] = run if ok else why
        return self.twins[layout]

    def run(self, trial: Trial) -> Record:
        record = Record(trial)
        if trial.fault.kind in self.unavailable:
            record.outcome, record.note = UNAVAILABLE, self.unavailable[trial.fault.kind]
            return record
        twin = self.twin(trial.layout)
        if isinstance(twin, str):
            record.note = twin
            return record
        folder = self.out / "runs" / trial.name
        folder.mkdir(parents=True)
        on_disk = trial.fault.kind == FULL_DISK
        with small_disk(folder / "disk") if on_disk else contextlib.nullcontext(folder) as home:
            injected = self.fault_and_resume(trial, home / "run", folder, record)
            if on_disk and (home / "run").exists():  # kept past the unmount
                shutil.copytree(home / "run", folder / "run", symlinks=True)
        if injected:
            record.lost += what_was_lost(folder / "run", twin)
            record.outcome = LOST if record.lost else EXACT
        return record

    def fault_and_resume(self, trial: Trial, run: Path, folder: Path, record: Record) -> bool:
        """Launch the run, do its fault, resume it until it finishes; False if the launch
        ended before the fault's moment (the record says how: missed, or failed)."""
        launch = self.launch(trial.layout, run, folder / "faulted.log")
        record.injected_at = self.wait_for_moment(launch, run, trial)
        if record.injected_at is None:
            code = self.finish(launch, 0)  # it has ended, or hung for LAUNCH_S: killed
            record.launches.append(ended(folder / "faulted.log", code, run))
            record.outcome = MISSED if code == 0 else FAILED
            record.note = f"the run ended (exit {code}) before step {trial.fault.at_step}"
            return False
        fault_at = time.monotonic()
        undo = self.inject(trial, launch, run, record)
        try:
            code = self.finish(launch, END_S)
            record.down_s = round(time.monotonic() - fault_at, 2)
        finally:
            undo()
        if code is None:
            record.lost.append(f"the faulted launch did not end within {END_S} s; killed")
        record.launches.append(ended(folder / "faulted.log", code, run))
        if trial.fault.kind == DAMAGED_CHECKPOINT:
            newest = sealed_checkpoints(run)[-1]
            damage(newest / trial.fault.target, trial.fault.damage)
            record.note = f"{newest.name}/{trial.fault.target}: {trial.fault.damage}"
        for attempt in range(1, RESUMES + 1):
            if stopped(run) == FINISHED:
                break
            log = folder / f"resume-{attempt}.log"
            code = self.finish(self.launch(trial.layout, run, log, "--auto-resume"), LAUNCH_S)
            record.launches.append(ended(log, code, run))
        return True

    def wait_for_moment(self, launch: subprocess.Popen, run: Path, trial: Trial) -> int | None:
        """The newest step logged once the run has logged the fault's step and sealed the
        checkpoints it needs; None if the launch ends first (or hangs for ``LAUNCH_S``)."""
        deadline = time.monotonic() + LAUNCH_S
        while launch.poll() is None and time.monotonic() < deadline:
            step, sealed = steps_logged(run), len(sealed_checkpoints(run))
            if step >= trial.fault.at_step and sealed >= trial.fault.checkpoints_needed:
                return step
            time.sleep(POLL_S)
        return None

    def inject(self, trial: Trial, launch: subprocess.Popen, run: Path, record: Record) -> Undo:
        """Do the trial's fault to the running launch; returns what lets the run continue."""
        kind, rank = trial.fault.kind, trial.fault.rank
        if kind == FULL_DISK:
            return fill(run.parent).unlink
        if kind == READ_ONLY:
            undo = stop_writes_below(run)
            assert undo is not None, "probed at the start"
            return undo
        if rank is None:  # sigterm, damaged_checkpoint: torchrun passes it on to its workers
            launch.send_signal(signal.SIGTERM)
            return lambda: None
        ranks = workers(launch.pid)
        target = ranks[rank]
        others = [ident for r, pid in ranks.items() if r != rank and (ident := identity(pid))]
        os.kill(target, signal.SIGKILL if kind == SIGKILL_RANK else signal.SIGSTOP)
        record.detect_s = first_exit(others, launch, DETECT_S)
        if record.detect_s is None:
            record.lost.append(f"no other rank noticed rank {rank}'s {kind} within {DETECT_S} s")
        else:
            record.detect_s = round(record.detect_s, 2)
        if kind == SIGSTOP_RANK:  # stuck for good: torchrun would wait for it to take its SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGKILL)
        return lambda: None


def unavailable_here(out: Path, kinds: Sequence[str]) -> dict[str, str]:
    """Why each of ``kinds`` that cannot be done on this machine cannot, tried under ``out``."""
    why = {}
    if FULL_DISK in kinds:
        reason = small_disks_here(out / ".probe-disk")
        if reason:
            why[FULL_DISK] = reason
    if READ_ONLY in kinds:
        probe = out / ".probe-writes"
        probe.mkdir()
        undo = stop_writes(probe)
        if undo is None:
            why[READ_ONLY] = "nothing stops a write here (root without chattr +i)"
        else:
            undo()
        probe.rmdir()
    return why


def kinds_flag(text: str) -> tuple[str, ...]:
    """The argparse type of --kinds: comma-separated fault kinds."""
    kinds = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"must be some of {', '.join(KINDS)}, got {text!r}")
    return kinds


def campaign(args: argparse.Namespace, command: str) -> int:
    make_output_folder(args.out, "--out")
    if holds_files(args.out):
        raise ConfigError(
            f"--out {args.out} holds files already; a campaign starts in a new folder"
        )
    started = time.monotonic()
    trials = draw_trials(args.runs, args.seed, args.kinds)
    header: dict[str, Any] = {
        "command": command,
        "seed": args.seed,
        "kinds": list(args.kinds),
        "code": provenance(),
        "machine": machine(),
        "settings": list(SETTINGS),
        "p2p_timeout_s": P2P_TIMEOUT_S,
    }
    records: list[Record] = []
    summary = summarize(records, header)
    with stopping("fault campaign", "start it again in a new folder") as children:
        runs = Campaign(args.out, children, unavailable_here(args.out, args.kinds))
        for trial in trials:
            record = runs.run(trial)
            records.append(record)
            what = "; ".join(record.lost) or record.note
            print(
                f"[{trial.index + 1}/{len(trials)}] {trial.name}: {record.outcome}"
                + (f" ({what})" if what else ""),
                flush=True,
            )
            summary = summarize(records, {**header, "wall_s": round(time.monotonic() - started)})
            write_json_atomic(args.out / "campaign.json", summary)
            (args.out / "campaign.md").write_text(markdown(summary))
    print(markdown(summary), end="")
    if failed(summary):
        names = ", ".join(run["name"] for run in summary["not_exact"])
        print(f"{PROG}: NOT EXACT: {names} (see {args.out / 'campaign.md'})", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=whole(RUNS), default=50, help="runs to draw (default 50)")
    parser.add_argument("--seed", type=whole(NON_NEGATIVE), default=0, help="the draw's seed")
    parser.add_argument("--out", type=Path, required=True, help="a new folder for the results")
    parser.add_argument(
        "--kinds",
        type=kinds_flag,
        default=KINDS,
        help=f"faults to draw from (default: {','.join(KINDS)})",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    try:
        return campaign(args, shlex.join([*PROG.split(), *argv]))
    except ConfigError as exc:
        parser.exit(2, f"{PROG}: error: {exc}\n")
    except Interrupted as stop:
        print(f"nobubble: {stop}", file=sys.stderr)
        return 128 + stop.signum
