"""summary.json and the line a run ends with: why it stopped, its results, its speed."""

from __future__ import annotations

import contextlib
import shlex
import signal
from collections.abc import Iterator
from pathlib import Path

import torch

from nobubble.engine import Engine, peak_memory_mb
from nobubble.hf.export import unexportable
from nobubble.interrupt import Interrupted
from nobubble.model.flops import Utilization
from nobubble.model.moe import dispatch_in_words
from nobubble.model.presets import ModelConfig
from nobubble.optim.muon import ns_dtype
from nobubble.provenance import machine
from nobubble.run.errors import NonFiniteError
from nobubble.run.steplog import StepLogger
from nobubble.runfolder.folder import ERROR, FINISHED, NON_FINITE, SIGNAL, RunFolder, RunWriteError
from nobubble.runfolder.resume import resume_command
from nobubble.stage_options import compute_dtype, precision


def why_stopped(error: BaseException) -> tuple[str, str]:
    """(summary.json's ``stopped``, a line saying why) for a run that ``error`` ended early."""
    if isinstance(error, Interrupted):
        return SIGNAL, f"{signal.Signals(error.signum).name}: {error}"
    if isinstance(error, KeyboardInterrupt):
        return SIGNAL, "aborted by a second interrupt, without saving a checkpoint"
    if isinstance(error, NonFiniteError):
        return NON_FINITE, str(error)
    text = str(error).strip().splitlines()
    return ERROR, f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


@contextlib.contextmanager
def stops_recorded(
    run: RunFolder,
    log: StepLogger,
    engine: Engine,
    mc: ModelConfig,
    usage: Utilization,
    resumed_at: int,
) -> Iterator[None]:
    """On the leader, write summary.json for a run that an error or a signal ends early, saying
    why; where it cannot be written, the run's own error is what the user sees. A session that
    trained no step leaves an existing summary alone (a finished run's is never replaced by
    that of an attempt that did nothing). A run that a failed write into its folder stopped
    (:class:`RunWriteError`) ends with a line that also says whether summary.json could still
    be written and the command that continues it."""
    try:
        yield
    except BaseException as error:
        written = None
        if log.enabled and not (log.done == resumed_at and run.summary_path.exists()):
            stopped, reason = why_stopped(error)
            summary = run_summary(log, engine, mc, usage, resumed_at, None, stopped, reason)
            try:
                run.write_summary(summary)
                written = True
            except RunWriteError:
                written = False
        if isinstance(error, RunWriteError):  # on any rank: the command that continues
            said = {
                True: "; summary.json says why it stopped",
                False: "; summary.json could not be written either",
                None: "",
            }[written]
            error.after = f": {resume_command(run.path, engine.layout.world)}{said}"
        raise


def run_summary(
    log: StepLogger,
    engine: Engine,
    mc: ModelConfig,
    usage: Utilization,
    resumed_at: int,
    stages: list[dict] | None,
    stopped: str = FINISHED,
    reason: str | None = None,
) -> dict:
    """summary.json: why the run stopped, its final evaluation (that of the last step, for a
    finished run; the last one there was, for a run stopped early), throughput, MFU, times and
    memory, the code and the machine that ran it (and the dtype of Muon's Newton–Schulz, how the
    experts of an MoE model ``mc`` dispatch)."""
    elapsed = log.elapsed()
    rate = log.tokens_per_s()
    summary = {
        "stopped": stopped,
        "tokens_per_s": rate,
        "flops_per_token": usage.flops_per_token,
        "model_tflops": usage.model_tflops(rate),
        "devices": usage.devices,
        "peak_source": usage.peak_source,
        "wall_s": elapsed.wall_s,
        "train_s": elapsed.train_s,
        "steps": engine.step if stopped == FINISHED else log.done,
        "peak_mem_mb": peak_memory_mb(engine.device),
        "code": log.code,
        "machine": machine(),
    }
    if stopped == FINISHED:
        _, val_loss, val_bpb = log.last_eval or (0, float("nan"), float("nan"))
        summary |= {"final_val_loss": val_loss, "final_val_bpb": val_bpb}
    else:
        summary["reason"] = reason
        if log.last_eval:
            step, val_loss, val_bpb = log.last_eval
            summary["last_eval"] = {"step": step, "val_loss": val_loss, "val_bpb": val_bpb}
    if usage.peak_tflops is not None:
        summary |= {"peak_tflops": usage.peak_tflops, "mfu": usage.mfu(rate)}
    if engine.device.type == "cuda":  # what dtype=auto and tf32 made of it
        summary["precision"] = precision(log.cfg, engine.device)
    if log.cfg.optim == "muon":  # what muon_ns_dtype resolved to (auto: by the device type)
        resolved = ns_dtype(log.cfg.muon_ns_dtype, engine.device)
        summary["muon_ns_dtype"] = str(resolved).removeprefix("torch.")
    experts_in = getattr(torch, compute_dtype(log.cfg.dtype, engine.device))
    if dispatch := dispatch_in_words(mc, engine.device, experts_in):
        summary["moe_dispatch"] = dispatch
    if resumed_at:
        summary["resumed_at_step"] = resumed_at
    if stages:
        summary["stages"] = stages
    return summary


def summary_line(summary: dict, run_dir: Path, processes: int, mc: ModelConfig) -> str:
    """The one line a finished run (of the model ``mc``) ends with: results, throughput, time,
    where, and what next (only commands that accept the run)."""
    if "mfu" in summary:
        flops = f"MFU {summary['mfu']:.1%}"
    else:
        flops = f"{summary['model_tflops']:.3g} model TFLOP/s (no MFU: {summary['peak_source']})"
    if "precision" in summary:
        flops += f" in {summary['precision']}"
    folder = shlex.quote(str(run_dir))
    export = "" if unexportable(mc) else f" | export: nobubble export {folder} OUT --format hf"
    return (
        f"nobubble: done: {summary['steps']} steps in {duration(summary['wall_s'])}, "
        f"val_loss {summary['final_val_loss']:.4f}, val_bpb {summary['final_val_bpb']:.4f}, "
        f"{summary['tokens_per_s']:,.0f} tok/s, {flops} | run folder: {folder} | more steps: "
        f"{resume_command(run_dir, processes)} steps=N{export}"
    )


def duration(seconds: float) -> str:
    """``seconds`` for people: 42.1 s, 3 min 12 s, 2 h 05 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
