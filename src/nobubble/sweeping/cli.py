"""``nobubble sweep --config GRID.toml [--jobs N]``: train every run of a grid, N at a time.

Phases run in file order, each run in its own process and folder
(``<out>/<phase>/<axis=value,...>``). Complete runs are skipped, so an interrupted sweep resumes
where it stopped; the grid file format is documented in :mod:`nobubble.sweeping.grid` and
docs/experiments.md.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from nobubble.config.flags import whole
from nobubble.destinations import make_output_folder
from nobubble.runfolder.lock import hold
from nobubble.sweeping.best import Pending
from nobubble.sweeping.grid import Phase, Sweep, SweepError, load_sweep
from nobubble.sweeping.launch import run_all
from nobubble.sweeping.plan import check_sweep, plan_phase
from nobubble.sweeping.planned import PlannedRun, Status, finished_loss


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, metavar="GRID.toml", help="grid file (docs/experiments.md)"
    )
    parser.add_argument(
        "--jobs",
        type=whole(),
        default=1,
        help="processes at a time; a pipeline run takes one per stage (default: 1)",
    )
    parser.add_argument(
        "--phase",
        action="append",
        metavar="NAME",
        help="run only this phase (repeatable); phases it takes best: values from must be done",
    )
    parser.add_argument("--out", help="output root (default: the grid's [sweep] out)")
    parser.add_argument(
        "--dry-run", action="store_true", help="list every run and whether it would run"
    )


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def thread_share(jobs: int, cpus: int) -> Callable[[int], int]:
    """Torch threads per process so that ``jobs`` processes at a time share ``cpus`` cores."""
    return lambda processes: max(1, cpus // max(jobs, processes))


def needed_phases(sweep: Sweep, selected: Sequence[str]) -> list[Phase]:
    """The selected phases and every phase they take best: values from, in file order."""
    needed = set(selected)
    for phase in reversed(sweep.phases):
        if phase.name in needed:
            needed |= {ref.phase for ref in phase.best_refs().values()}
    return [phase for phase in sweep.phases if phase.name in needed]


@dataclass
class Tally:
    done: int = 0
    skipped: int = 0
    to_run: int = 0
    waiting: int = 0
    failed: list[str] = field(default_factory=list)


def _phase_title(phase: Phase) -> str:
    return f"phase {phase.name}" if phase.name else "grid"


def _check_conflicts(runs: Sequence[PlannedRun], statuses: Sequence[Status]) -> None:
    problems = [r.conflict() for r, s in zip(runs, statuses, strict=True) if s is Status.CONFLICT]
    if problems:
        listed = "\n  ".join(p for p in problems if p)
        raise SweepError(
            f"{len(problems)} run folders hold something else; the sweep never overwrites them. "
            f"Move them away or choose another output root (--out):\n  {listed}"
        )


LOCK_FILE = ".sweep.lock"  # in the output root, beside the phase folders


class SweepRun:
    """One invocation of ``nobubble sweep``: plans phase by phase and runs what is not done."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.sweep = load_sweep(args.config, out=args.out)
        names = [self.sweep.phase(n).name for n in args.phase or []]
        self.selected = names or [p.name for p in self.sweep.phases]
        self.threads = thread_share(args.jobs, available_cpus())
        self.planned: dict[str, list[PlannedRun]] = {}
        self.failed_paths: set[Path] = set()
        self.tally = Tally()
        self.lock: IO[str] | None = None  # held from the first write to the process's end

    def loss_of(self, run: PlannedRun) -> float | None:
        return finished_loss(run, self.failed_paths)

    def execute(self) -> int:
        check_sweep(self.sweep)
        if not self.args.dry_run:
            given = "--out" if self.args.out else f"{self.args.config} [sweep] out"
            make_output_folder(self.sweep.out, given)
            # Two sweeps over one folder would each take the other's run in progress for a
            # half-done one and set it aside; the lock is released when this process ends.
            self.lock = hold(
                Path(self.sweep.out) / LOCK_FILE,
                f"the sweep's output root {self.sweep.out}",
                "another `nobubble sweep` is running over it; wait for it to finish or stop it "
                "(a sweep started again later skips every run that finished)",
            )
        needed = needed_phases(self.sweep, self.selected)
        print(f"sweep {self.sweep.name}: runs in {self.sweep.out}, logs in its _sweep folder")
        for phase in needed:
            try:
                plan = plan_phase(self.sweep, phase, self.planned, self.loss_of, self.threads)
            except Pending as exc:
                self.wait(phase, exc)
                continue
            self.planned[phase.name] = plan.runs
            if phase.name in self.selected:
                for choice in plan.choices:
                    print(f"{_phase_title(phase)}: {choice.describe()}")
                self.run_phase(phase, plan.runs)
        return self.finish()

    def wait(self, phase: Phase, reason: Pending) -> None:
        refs = ", ".join(f"{k} = best:{r.phase}" for k, r in phase.best_refs().items())
        if not self.args.dry_run:
            sources = " ".join(f"--phase {r.phase}" for r in phase.best_refs().values())
            raise SweepError(
                f"{_phase_title(phase)} needs {refs}, which is not known yet: {reason}. "
                f"Run that phase to the end first (nobubble sweep --config {self.args.config} "
                f"{sources})"
            )
        points = phase.points()
        self.tally.waiting += len(points)
        print(f"{_phase_title(phase)}: {len(points)} runs, waiting for {refs} ({reason})")
        for point in points:
            print(f"  wait  {point.name}")

    def run_phase(self, phase: Phase, runs: list[PlannedRun]) -> None:
        statuses = [run.status() for run in runs]
        _check_conflicts(runs, statuses)
        todo = [r for r, s in zip(runs, statuses, strict=True) if not s.done]
        complete = len(runs) - len(todo)
        self.tally.skipped += complete
        diverged = statuses.count(Status.DIVERGED)
        complete_text = f"{complete} complete" + (f" ({diverged} diverged)" if diverged else "")
        print(f"{_phase_title(phase)}: {len(runs)} runs, {complete_text}, {len(todo)} to run")
        if self.args.dry_run:
            for run, status in zip(runs, statuses, strict=True):
                print(f"  {status.value:<5} {run.name}")
            self.tally.to_run += len(todo)
            return
        outcomes = run_all(todo, self.args.jobs, lambda _: self.sweep.logs_dir(phase), print)
        for outcome in outcomes:
            if outcome.ok:
                self.tally.done += 1
            else:
                self.failed_paths.add(outcome.run.path)
                self.tally.failed.append(f"{outcome.run.label}: {outcome.detail}")

    def finish(self) -> int:
        t = self.tally
        if self.args.dry_run:
            print(
                f"sweep {self.sweep.name} (dry run): {t.to_run} to run, {t.skipped} complete, "
                f"{t.waiting} waiting for earlier phases"
            )
            return 0
        for line in t.failed:
            print(f"failed: {line}")
        print(
            f"sweep {self.sweep.name}: {t.done} done, {t.skipped} skipped (already complete), "
            f"{len(t.failed)} failed"
        )
        return 1 if t.failed else 0


def run(args: argparse.Namespace) -> int:
    return SweepRun(args).execute()
