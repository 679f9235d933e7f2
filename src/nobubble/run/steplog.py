"""Step logging: metrics lines, the progress bar, the loggers, throughput and the run's time."""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType

from tqdm import tqdm

from nobubble.config import TrainConfig
from nobubble.engine import StepStats
from nobubble.evaluation import EvalSums
from nobubble.model.flops import Utilization
from nobubble.model.moe import routing_metrics
from nobubble.provenance import provenance
from nobubble.runfolder.folder import RunFolder
from nobubble.staleness import DRIFT
from nobubble.tracking import Loggers, open_loggers, scalars_of, stage_scalars


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
        # the code that trains, read now (by the leader, which writes the summary: git reads the
        # checkout's files): a checkout that moves on while the run trains must not change what
        # its summary says ran it
        self.code = provenance() if enabled else {}
        self.loggers = open_loggers(cfg, run.path, start) if enabled else Loggers([])
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        self.train_time, self.wall_before = before.train_s, before.wall_s
        self.started = self.segment_start = time.perf_counter()
        self.done = start
        self.pending: dict | None = None
        self.written: list[dict] = []  # the lines written at the newest step written
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

    def on_step(self, stats: StepStats, last: bool = False) -> None:
        """Count a step, show it, and write its metrics line every ``log_every`` steps, at the
        run's last step, and when it is the ``last`` of a run that stops here (written at once)."""
        self.done = stats.step + 1
        rate = self.tokens_per_s(time.perf_counter() - self.segment_start)
        mfu = self.usage.mfu(rate)
        flops = {"mfu": f"{mfu:.1%}"} if mfu is not None else {"tflops": self.tflops(rate)}
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{stats.loss:.4f}", tok_s=f"{rate:,.0f}", **flops, refresh=False)
        logged = not self.done % self.cfg.log_every or self.done == self.cfg.steps
        if not (last or logged or stats.measured):  # a measurement is kept
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
        record.update(stats.measured)
        if stats.routing:
            record.update(routing_metrics(stats.routing))
        self.pending = record
        if last:
            self.flush()

    def on_eval(self, step: int, sums: EvalSums, drift: list[float | None] | None = None) -> None:
        """An evaluation's line, with each model stage's weight drift where a stage has a
        delay (:mod:`nobubble.staleness`)."""
        if not self.enabled:
            return
        val_loss, val_bpb = sums.result()
        self.last_eval = (step, val_loss, val_bpb)
        if self.pending is None or self.pending["step"] != step:
            self.flush()
            self.pending = {"step": step}
        self.pending.update(val_loss=val_loss, val_bpb=val_bpb, train_time_s=self.train_time)
        if drift is not None:
            self.pending[DRIFT] = drift
        self.bar.write(f"step {step}: val_loss {val_loss:.4f}  val_bpb {val_bpb:.4f}")
        self.flush()

    def tflops(self, rate: float) -> str:
        return f"{self.usage.model_tflops(rate):.3g}"

    def on_stages(self, step: int, reports: list[dict] | None) -> None:
        """Per-stage measurements of a pipeline (None: none, or not the leader) to the loggers."""
        if reports and self.enabled:
            self.loggers.log(step, stage_scalars(reports))

    def flush(self) -> None:
        """Write the pending line; one whose write fails is dropped, not tried again (by
        :meth:`close`): the run stops, and its resume trains the step again and writes it."""
        if self.pending is not None and self.enabled:
            line, self.pending = self.pending, None
            self.run.append_metrics(line)
            self.pending = line
            self.loggers.log(self.pending["step"], scalars_of(self.pending))
            if self.written and self.written[-1]["step"] != self.pending["step"]:
                self.written = []
            self.written.append(self.pending)
            self.pending = None

    def lines_at(self, step: int) -> list[dict]:
        """The metrics lines written at ``step``, if it is the newest step written (what a
        checkpoint of ``step`` keeps: :func:`nobubble.runfolder.resume.metrics_up_to`)."""
        return [line for line in self.written if line["step"] == step]

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
