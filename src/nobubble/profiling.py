"""``profile_steps=A:B``: a torch.profiler trace of training steps A..B (counted from 1).

The backends label what they do (:func:`label`, :func:`action_label`): every F, B and STEP of the
schedule, the waits for peers and all-reduces, evaluations. The labels are
``torch.profiler.record_function`` ranges while a trace records, and a shared no-op context
otherwise, so a run that does not profile pays one flag test per action.

Which actions a step's trace holds (docs/training.md, "Profiling"): a process starts recording at
its first action of step A and stops once its update of step B is applied. In one process that
is exactly steps A..B. On a pipeline stage the steps overlap (under 2bw the forwards of step t+1
run before the backwards of step t), so the window also holds the actions of neighbouring steps
that the stage runs between those two points; every action of steps A..B is in it.

When the step before A is trained in the same session, the profiler warms up during it and
discards what it saw (its start-up would otherwise skew the first recorded actions). Each
process writes its own trace into the run folder, named after the steps it covers: a trace
already there is never replaced. Under torchrun the leader then merges the ranks' traces into
one timeline, each rank a process named after its stage and replica.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, record_function
from tqdm import tqdm

from nobubble.config import TrainConfig, profile_range
from nobubble.engine import Engine
from nobubble.layout import ParallelLayout
from nobubble.schedules.ir import Action, ActionKind

PROFILE_DIR = "profile"
RECEIVES = (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)
F = TypeVar("F", bound=Callable[..., Any])
_NULL = contextlib.nullcontext()
_recording = False  # whether a trace is being taken in this process: labels are live


def label(*parts: object) -> AbstractContextManager:
    """A range named by ``parts`` (joined by spaces) on the trace, while one records."""
    if not _recording:
        return _NULL
    return record_function(" ".join(map(str, parts)))


def labelled(text: str) -> Callable[[F], F]:
    """Decorate a function so that each call is a range named ``text`` (see :func:`label`)."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with label(text):
                return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def action_label(action: Action) -> AbstractContextManager:
    """A schedule action's range: ``F mb5 v1`` (microbatch 5 with weight version 1, the cell
    ``F5v1`` of ``nobubble schedule``), ``B mb5 v1``, ``F mb5 v1 & B mb3 v1`` (an overlapped
    F&B), ``STEP v2`` (the update that makes version 2: step 2), ``SEND_ACT mb5 -> s1``."""
    if not _recording or action.kind in RECEIVES:  # receives: waited for inside an F or B
        return _NULL
    if action.kind is ActionKind.STEP:
        return record_function(f"STEP v{action.version}")
    if action.paired is not None:
        halves = (f"{a.kind} mb{a.microbatch} v{a.version}" for a in action.parts)
        return record_function(" & ".join(halves))
    text = f"{action.kind} mb{action.microbatch}"
    if action.kind.is_compute:
        return record_function(f"{text} v{action.version}")
    return record_function(f"{text} -> s{action.peer}")


def steps_to_trace(requested: range | None, done: int) -> range:
    """The steps of ``requested`` (from 1) that a session resuming after ``done`` steps trains."""
    if requested is None:
        return range(0)
    return range(max(requested.start, done + 1), requested.stop)


def free_path(folder: Path, stem: str) -> Path:
    """``folder/stem.json``, or ``stem-2.json``, ... if taken: nothing already there is lost."""
    path, n = folder / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}.json"
    return path


class StepProfiler:
    """Traces the 1-based steps ``steps`` of one process; the engine calls :meth:`before_step`
    before its first action of every step and :meth:`after_step` once a step's update is
    applied (both with the 0-based step index). ``warmup``: the step before ``steps`` runs in
    this session, so warm the profiler up during it. ``layout``: under torchrun, this process's
    layout (its trace is ``trace-steps{A}-{B}-stage{S}-replica{R}.json``, its process on the
    timeline "stage S replica R"; S lists the model stages it holds, ``0+2`` when interleaved);
    None in one process (``trace-steps{A}-{B}.json``)."""

    def __init__(
        self,
        steps: range,
        folder: Path,
        device: torch.device,
        layout: ParallelLayout | None = None,
        warmup: bool = False,
        announce: bool = True,
    ) -> None:
        self.steps, self.folder, self.layout = steps, folder, layout
        self.warmup, self.announce = warmup, announce
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.profiler: torch.profiler.profile | None = torch.profiler.profile(activities=activities)
        self.state = "idle"  # -> "warming" -> "recording" -> "done"
        self.last_done = 0  # the last step (from 1) whose update was applied while recording
        self.written: Path | None = None

    def before_step(self, step: int) -> None:
        number = step + 1
        if self.state == "idle" and self.warmup and number == self.steps.start - 1:
            self.profiler.prepare_trace()  # the profiler's start-up, then discarded
            self._set_recording(True, "warming")
        elif self.state in ("idle", "warming") and number == self.steps.start:
            if self.state == "idle":
                self.profiler.prepare_trace()
            self.profiler.start_trace()
            self._set_recording(True, "recording")

    def after_step(self, step: int) -> None:
        if self.state == "recording" and step + 1 in self.steps:
            self.last_done = step + 1
            if self.last_done == self.steps.stop - 1:
                self.close()

    def close(self) -> None:
        """Stop; write the trace of the steps completed (all of them unless the run stopped
        early; nothing if none was)."""
        if self.state == "warming":
            self.profiler.start_trace()  # what a schedule's warm-up does: start, stop, drop
        if self.state in ("warming", "recording"):
            self.profiler.stop_trace()
            self._set_recording(False, "done")
            if self.last_done >= self.steps.start:
                self._export()
            # Free the results now: torch's profile holds them in a reference cycle, and freed
            # by the collection at interpreter exit they crash a process that ran torch.distributed
            # (torch 2.13: an invalid free in kineto's MemoryTraceLogger).
            self.profiler = None
            gc.collect()

    def _set_recording(self, recording: bool, state: str) -> None:
        global _recording
        _recording, self.state = recording, state

    def _export(self) -> None:
        first, last = self.steps.start, self.last_done
        stem = f"trace-steps{first}-{last}"
        process, order = "nobubble (every stage)", 0
        if self.layout is not None:
            stages, replica = self.layout.stages, self.layout.replica
            stem += f"-stage{'+'.join(map(str, stages))}-replica{replica}"
            process = (
                f"stage{'s' * (len(stages) > 1)} {', '.join(map(str, stages))} replica {replica}"
            )
            order = self.layout.rank
        self.folder.mkdir(parents=True, exist_ok=True)
        path = free_path(self.folder, stem)
        tmp = path.with_name(f".{path.name}.tmp")
        self.profiler.export_chrome_trace(str(tmp))
        trace = json.loads(tmp.read_text())
        trace["traceName"] = str(path)
        name_process(trace, process, order)
        write_trace(tmp, trace)
        os.replace(tmp, path)
        self.written = path
        if self.announce:
            tqdm.write(f"profile of steps {first}..{last}: {path}", file=sys.stderr)


def name_process(trace: dict[str, Any], name: str, order: int) -> None:
    """Name the traced process on the timeline (torch calls it "python") and set its place."""
    for event in trace["traceEvents"]:
        if event.get("ph") != "M" or not isinstance(event.get("pid"), int):
            continue  # the profiler's own pseudo-processes have names, not process ids
        if event["name"] == "process_name":
            event["args"] = {"name": name}
        elif event["name"] == "process_sort_index":
            event["args"] = {"sort_index": order}


def write_trace(path: Path, trace: dict[str, Any]) -> None:
    with open(path, "w") as fh:
        json.dump(trace, fh)
        fh.flush()
        os.fsync(fh.fileno())


def merge_traces(paths: list[Path], out: Path) -> None:
    """One timeline of several processes' traces (taken on one clock: one node's processes),
    each process its own group of tracks, in the order of ``paths``."""
    events: list[dict[str, Any]] = []
    for path in paths:
        trace = json.loads(path.read_text())
        events += [e for e in trace["traceEvents"] if isinstance(e.get("pid"), int)]
    tmp = out.with_name(f".{out.name}.tmp")
    write_trace(tmp, {"traceEvents": events, "displayTimeUnit": "ms", "traceName": str(out)})
    os.replace(tmp, out)


class NoProfiler:
    """The profiler of a run that does not profile."""

    def before_step(self, step: int) -> None:
        """Nothing to start."""

    def after_step(self, step: int) -> None:
        """Nothing to stop."""


OFF = NoProfiler()


@contextlib.contextmanager
def profiled(cfg: TrainConfig, run_dir: Path, engine: Engine, pipeline: bool) -> Iterator[None]:
    """Profile ``engine``'s steps named by ``profile_steps`` while the body trains it."""
    requested = profile_range(cfg)
    steps = steps_to_trace(requested, engine.step)
    leader = engine.layout.is_leader
    if requested is not None and steps != requested and leader:
        trained = range(requested.start, min(requested.stop, engine.step + 1))
        left = f"tracing {steps.start}..{steps.stop - 1}" if steps else "nothing left to trace"
        print(
            f"nobubble: profile_steps {cfg.profile_steps}: steps {trained.start}.."
            f"{trained.stop - 1} were trained before the checkpoint this run resumed from; {left}",
            file=sys.stderr,
            flush=True,
        )
    if not steps:
        yield
        return
    layout = engine.layout
    profiler = StepProfiler(
        steps,
        run_dir / PROFILE_DIR,
        engine.device,
        layout=layout if pipeline else None,
        warmup=steps.start - 1 > engine.step,
        announce=leader,
    )
    engine.profiler = profiler
    try:
        yield
    finally:
        engine.profiler = OFF
        profiler.close()
    if pipeline:  # the run went to its end on every rank: put the stages on one timeline
        merge_stage_traces(profiler, layout)


def merge_stage_traces(profiler: StepProfiler, layout: ParallelLayout) -> None:
    """The leader merges every rank's trace into ``trace-steps{A}-{B}.json`` (a collective)."""
    written: list[Path | None] | None = [None] * layout.world if layout.is_leader else None
    dist.gather_object(profiler.written, written, dst=layout.leader)
    if written is None or None in written or layout.world == 1:
        return
    first, last = profiler.steps.start, profiler.last_done
    out = free_path(profiler.folder, f"trace-steps{first}-{last}")
    merge_traces(written, out)
    tqdm.write(f"every stage of steps {first}..{last} on one timeline: {out}", file=sys.stderr)
