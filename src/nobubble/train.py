"""One training loop for both backends: segments of steps, evaluation, logging, checkpoints.

The loop asks the engine to train up to the next boundary (an evaluation or a checkpoint step), so
a pipeline only drains where something needs the newest weights of every stage.
"""

from __future__ import annotations

import contextlib
import math
import shlex
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

import torch
from tqdm import tqdm

from nobubble.checkpoint import (
    CheckpointError,
    CheckpointReader,
    checkpoint_name,
    prune,
    publish,
    read_meta,
    staging_dir,
    write_shard,
)
from nobubble.config import TrainConfig, chosen_loggers
from nobubble.data import DataBundle, build_data
from nobubble.engine import Engine, StepStats, peak_memory_mb
from nobubble.evaluation import EvalSums
from nobubble.flops import Utilization, utilization
from nobubble.hf.export import unexportable
from nobubble.hf.init import check_init_from, init_note, init_source, load_init_from
from nobubble.interrupt import Interrupted, stop_on_signals
from nobubble.model import ModelConfig, model_config
from nobubble.moe import routing_metrics
from nobubble.optim.muon import ns_dtype
from nobubble.optim.named_state import NamedStateError
from nobubble.profiling import profiled
from nobubble.provenance import provenance
from nobubble.resume import open_run, resume_command, tokenizer_digest
from nobubble.runfolder import ERROR, FINISHED, NON_FINITE, SIGNAL, RunFolder
from nobubble.tracking import Loggers, open_loggers, scalars_of, stage_scalars


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. gradients keep being non-finite); the message says why."""


class NonFiniteError(TrainingError):
    """The non-finite policy stopped the run: ``nonfinite_patience`` bad steps in a row."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("device=cuda was requested but no CUDA device is available; use cpu")
    return torch.device(name)


def configure_torch(cfg: TrainConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)


@dataclass(frozen=True)
class Pause:
    """A step where training pauses: to evaluate, to save a checkpoint, or both."""

    step: int
    evaluate: bool
    save: bool


def _every(step: int, every: int) -> int | float:
    """The next multiple of ``every`` after ``step`` (none when ``every`` is 0)."""
    return (step // every + 1) * every if every else math.inf


def pauses(cfg: TrainConfig, start: int) -> Iterator[Pause]:
    """Every pause after ``start`` up to the last step (which evaluates and saves), in order,
    found as training reaches it: a run of any length costs a pause at a time."""
    step = start
    while step < cfg.steps:
        step = int(min(_every(step, cfg.eval_every), _every(step, cfg.checkpoint_every), cfg.steps))
        last = step == cfg.steps
        yield Pause(
            step,
            evaluate=last or _every(step - 1, cfg.eval_every) == step,
            save=last or _every(step - 1, cfg.checkpoint_every) == step,
        )


@dataclass(frozen=True)
class Elapsed:
    """Time a run has spent on the steps it has trained so far, over all its sessions: training
    alone (evaluations and checkpoints excluded) and in all. Saved with every checkpoint."""

    train_s: float = 0.0
    wall_s: float = 0.0


class StepLogger:
    """Turns step stats and evaluations into metrics lines, the progress bar, the chosen loggers
    (:mod:`nobubble.tracking`) and the summary; a context manager that closes them all.

    Times and throughput describe the whole run: ``before`` is what earlier sessions spent.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        run: RunFolder,
        start: int,
        before: Elapsed,
        usage: Utilization,
        enabled: bool = True,
    ) -> None:
        self.cfg, self.run, self.usage, self.enabled = cfg, run, usage, enabled
        self.loggers = open_loggers(cfg, run.path, start) if enabled else Loggers([])
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        self.train_time, self.wall_before = before.train_s, before.wall_s
        self.started = self.segment_start = time.perf_counter()
        self.done = start
        self.pending: dict | None = None
        self.bad_in_a_row = 0
        self.last_eval: tuple[int, float, float] | None = None  # step, val_loss, val_bpb
        show = cfg.progress and enabled
        self.bar = tqdm(total=cfg.steps, initial=start, disable=not show, unit="step")

    def begin_segment(self) -> None:
        self.segment_start = time.perf_counter()

    def end_segment(self) -> None:
        self.train_time += time.perf_counter() - self.segment_start

    def elapsed(self) -> Elapsed:
        return Elapsed(self.train_time, self.wall_before + time.perf_counter() - self.started)

    def tokens_per_s(self, extra_time: float = 0.0) -> float:
        seconds = self.train_time + extra_time
        return self.done * self.tokens_per_step / seconds if seconds > 0 else 0.0

    def on_step(self, stats: StepStats) -> None:
        self.done = stats.step + 1
        abort = self.count_nonfinite(stats)
        rate = self.tokens_per_s(time.perf_counter() - self.segment_start)
        mfu = self.usage.mfu(rate)
        flops = {"mfu": f"{mfu:.1%}"} if mfu is not None else {"tflops": self.tflops(rate)}
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{stats.loss:.4f}", tok_s=f"{rate:,.0f}", **flops, refresh=False)
        if not abort and self.done % self.cfg.log_every and self.done != self.cfg.steps:
            return
        self.flush()
        record = {
            "step": self.done,
            "train_loss": stats.loss,
            "lr": stats.lr,
            "grad_norm": stats.grad_norm,
            "tokens": self.done * self.tokens_per_step,
            "tokens_per_s": rate,
        }
        if mfu is not None:
            record["mfu"] = mfu
        if stats.skipped_stages:
            record["skipped_stages"] = stats.skipped_stages
        if stats.routing:
            record.update(routing_metrics(stats.routing))
        self.pending = record
        if abort:
            self.flush()  # the step that ends the run is in metrics.jsonl too
            raise abort

    def count_nonfinite(self, stats: StepStats) -> NonFiniteError | None:
        """Warn about a non-finite step; the error to stop with once the patience is spent."""
        if not stats.skipped_stages and math.isfinite(stats.loss):
            self.bad_in_a_row = 0
            return None
        self.bad_in_a_row += 1
        warnings.warn(
            f"step {stats.step + 1}: non-finite loss or gradient (loss {stats.loss}); stages "
            f"{stats.skipped_stages} skipped their update",
            RuntimeWarning,
            stacklevel=2,
        )
        if self.bad_in_a_row < self.cfg.nonfinite_patience:
            return None
        return NonFiniteError(
            f"{self.bad_in_a_row} steps in a row had non-finite gradients (last at step "
            f"{stats.step + 1}); lower the learning rate, enable grad_clip, or check the data"
        )

    def on_eval(self, step: int, sums: EvalSums) -> None:
        if not self.enabled:
            return
        val_loss, val_bpb = sums.result()
        self.last_eval = (step, val_loss, val_bpb)
        if self.pending is None or self.pending["step"] != step:
            self.flush()
            self.pending = {"step": step}
        self.pending.update(val_loss=val_loss, val_bpb=val_bpb, train_time_s=self.train_time)
        self.bar.write(f"step {step}: val_loss {val_loss:.4f}  val_bpb {val_bpb:.4f}")
        self.flush()

    def tflops(self, rate: float) -> str:
        return f"{self.usage.model_tflops(rate):.3g}"

    def on_stages(self, step: int, reports: list[dict] | None) -> None:
        """Per-stage measurements of a pipeline (None: none, or not the leader) to the loggers."""
        if reports and self.enabled:
            self.loggers.log(step, stage_scalars(reports))

    def flush(self) -> None:
        if self.pending is not None and self.enabled:
            self.run.append_metrics(self.pending)
            self.loggers.log(self.pending["step"], scalars_of(self.pending))
            self.pending = None

    def close(self, error: BaseException | None = None) -> None:
        try:
            self.flush()
        finally:
            self.bar.close()
            self.loggers.close(error)

    def __enter__(self) -> StepLogger:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType
    ) -> None:
        self.close(error)


def save_checkpoint(
    run: RunFolder, engine: Engine, data: DataBundle | None, cfg: TrainConfig, elapsed: Elapsed
) -> None:
    """Replica 0 of every stage writes that stage's shard (the replicas of a stage hold the same
    weights and optimizer state); the leader seals the checkpoint once all are written."""
    root, layout = run.checkpoints, engine.layout
    if layout.replica == 0:
        state = engine.checkpoint_state()
        meta = {
            "step": engine.step,
            "data": data.train.state_dict() if data else None,
            # the leader's alone (shard 0, which a resume checks): no other rank reads run files
            "tokenizer_sha256": tokenizer_digest(run.path) if layout.is_leader else None,
            "config": cfg.to_dict(),
            "elapsed": asdict(elapsed),
        }
        write_shard(
            staging_dir(root, engine.step),
            layout.shard,
            engine.checkpoint_tensors(),
            state["step"],
            state["optimizer"],
            torch.get_rng_state(),
            meta,
        )
    engine.barrier()
    if layout.is_leader:
        publish(
            staging_dir(root, engine.step),
            root / checkpoint_name(engine.step),
            engine.step,
            layout.shards,
        )
        prune(root, cfg.keep_checkpoints)
    engine.barrier()


def restore_checkpoint(folder: Path | None, engine: Engine, data: DataBundle | None) -> Elapsed:
    """Load this process's parameters from a verified checkpoint (if any) into the engine, and
    the data position; return the time the run had spent up to it.

    The checkpoint may come from any layout (the simulator, another number of stages): the
    process reads its parameters by name from whichever shards hold them. Whether the layout may
    change at all was decided when the run was opened (:func:`nobubble.resume.reopen`).
    """
    if folder is None:
        return Elapsed()
    reader = CheckpointReader(folder)
    names = {key.split("/", 1)[1] for key in engine.checkpoint_tensors()}  # this stage's
    try:
        loaded = reader.load(names, complete=engine.layout.shards == 1)
        engine.restore(loaded.weights, {"step": loaded.step, "optimizer": loaded.optimizer})
    except NamedStateError as exc:
        raise CheckpointError(f"cannot continue from {folder}: {exc}") from None
    torch.set_rng_state(reader.rng(engine.layout.shard))
    meta = read_meta(folder, 0)  # shard 0 is the first stage's, which always reads the data
    if data is not None:
        data.train.load_state_dict(meta["data"])
    return Elapsed(**meta.get("elapsed", {}))  # checkpoints older than "elapsed" count from 0


def run_training(
    cfg: TrainConfig,
    mc: ModelConfig,
    run: RunFolder,
    data: DataBundle | None,
    engine: Engine,
    before: Elapsed,
    should_stop: Callable[[], bool] = lambda: False,
) -> dict | None:
    """Train ``engine`` (of the model ``mc``) from its step to ``cfg.steps``; the leader logs,
    prints the summary line and returns the summary (others: None).

    ``data`` is None on pipeline stages that need no data (neither first nor last). ``before``:
    the time spent up to the checkpoint the engine was restored from. When ``should_stop`` turns
    true the engine stops after the step in flight, a checkpoint is saved and
    :class:`Interrupted` is raised.
    """
    resumed_at = engine.step
    leader = engine.layout.is_leader
    token_bytes = data.tokenizer.token_bytes() if data else None
    next_batch = data.train.next_batch if data else None
    val = data.val if data else []
    usage = utilization(mc, cfg.seq_len, engine.device, engine.layout.world, cfg.peak_tflops)
    watch_stages = bool(chosen_loggers(cfg))  # the same on every rank: stage_reports is collective
    with (
        StepLogger(cfg, run, engine.step, before, usage, enabled=leader) as log,
        stops_recorded(run, log, engine, usage, resumed_at),
    ):
        if engine.step == 0:
            log.on_eval(0, engine.evaluate(val, token_bytes))
        for pause in pauses(cfg, engine.step):
            stop = pause.step
            log.begin_segment()
            engine.run_steps(stop, next_batch, log.on_step, should_stop)
            log.end_segment()
            if engine.step < stop:  # a stop was requested: keep what was done, then leave
                log.flush()
                save_checkpoint(run, engine, data, cfg, log.elapsed())
                raise Interrupted(
                    getattr(should_stop, "signum", None) or signal.SIGTERM,
                    f"stopped at step {engine.step} and saved a checkpoint; continue with: "
                    f"{resume_command(run.path, engine.layout.world)}",
                )
            if pause.evaluate:
                log.on_eval(stop, engine.evaluate(val, token_bytes))
                if watch_stages and stop < cfg.steps:  # the last step's come with the summary
                    log.on_stages(stop, engine.stage_reports(digests=False))
            log.flush()
            if pause.save:
                save_checkpoint(run, engine, data, cfg, log.elapsed())
        stages = engine.stage_reports()
        log.on_stages(engine.step, stages)
    if not leader:
        return None
    summary = run_summary(log, engine, usage, resumed_at, stages)
    run.write_summary(summary)
    print(summary_line(summary, run.path, engine.layout.world, mc), flush=True)
    return summary


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
    run: RunFolder, log: StepLogger, engine: Engine, usage: Utilization, resumed_at: int
) -> Iterator[None]:
    """On the leader, write summary.json for a run that an error or a signal ends early, saying
    why; where it cannot be written, the run's own error is what the user sees. A session that
    trained no step leaves an existing summary alone (a finished run's is never replaced by
    that of an attempt that did nothing)."""
    try:
        yield
    except BaseException as error:
        if log.enabled and not (log.done == resumed_at and run.summary_path.exists()):
            stopped, reason = why_stopped(error)
            summary = run_summary(log, engine, usage, resumed_at, None, stopped, reason)
            with contextlib.suppress(OSError):
                run.write_summary(summary)
        raise


def run_summary(
    log: StepLogger,
    engine: Engine,
    usage: Utilization,
    resumed_at: int,
    stages: list[dict] | None,
    stopped: str = FINISHED,
    reason: str | None = None,
) -> dict:
    """summary.json: why the run stopped, its final evaluation (that of the last step, for a
    finished run; the last one there was, for a run stopped early), throughput, MFU, times and
    memory (and the dtype of Muon's Newton–Schulz)."""
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
        "code": provenance(),
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
    if log.cfg.optim == "muon":  # what muon_ns_dtype resolved to (auto: by the device type)
        resolved = ns_dtype(log.cfg.muon_ns_dtype, engine.device)
        summary["muon_ns_dtype"] = str(resolved).removeprefix("torch.")
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


def train(
    cfg: TrainConfig, overwrite: bool = False, resume: bool = False, auto_resume: bool = False
) -> Path:
    """Train in this process (the simulator of ``cfg.schedule``); return the run folder."""
    from nobubble.simulated import SimulatedEngine

    configure_torch(cfg)
    device = resolve_device(cfg.device)
    setup = open_run(cfg, overwrite, resume, auto_resume)
    try:
        data = build_data(cfg, setup.work)
        mc = model_config(cfg, data.tokenizer.vocab_size)
        source = init_source(cfg, setup.checkpoint)
        if source:
            check_init_from(source, mc, data.tokenizer)
        engine = SimulatedEngine(cfg, mc, device)
        before = restore_checkpoint(setup.checkpoint, engine, data)
        if source:
            load_init_from(engine, source)
        run = setup.commit()
    except BaseException:
        setup.discard()
        raise
    print(f"run folder: {run.path}{resuming(setup.checkpoint)}{init_note(source)}")
    with stop_on_signals() as stop, profiled(cfg, run.path, engine, pipeline=False):
        run_training(cfg, mc, run, data, engine, before, stop)
    return run.path


def resuming(checkpoint: Path | None) -> str:
    return f" (resuming {checkpoint.name})" if checkpoint else ""
