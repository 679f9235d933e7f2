"""The training loop of both backends: segments of steps, evaluation, logging, checkpoints.

The loop asks the engine to train up to the next pause (an evaluation or a checkpoint step), so
a pipeline only drains where something needs the newest weights of every stage.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from nobubble.config import TrainConfig, chosen_loggers
from nobubble.data import DataBundle
from nobubble.engine import Engine, StepStats
from nobubble.interrupt import Interrupted
from nobubble.model.flops import utilization
from nobubble.model.presets import ModelConfig
from nobubble.run.checkpoints import save_checkpoint
from nobubble.run.nonfinite import NonFinitePolicy
from nobubble.run.steplog import Elapsed, StepLogger
from nobubble.run.summary import run_summary, stops_recorded, summary_line
from nobubble.runfolder.folder import RunFolder
from nobubble.runfolder.resume import resume_command


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
    policy = NonFinitePolicy(cfg.nonfinite_patience)

    def on_step(stats: StepStats) -> None:  # the leader's: it sees every step's statistics
        stop = policy.check(stats)
        log.on_step(stats, last=stop is not None)  # the step that ends the run is logged too
        if stop is not None:
            raise stop

    with (
        StepLogger(cfg, run, engine.step, before, usage, enabled=leader) as log,
        stops_recorded(run, log, engine, mc, usage, resumed_at),
    ):
        if engine.step == 0:
            log.on_eval(0, engine.evaluate(val, token_bytes))
        for pause in pauses(cfg, engine.step):
            stop = pause.step
            log.begin_segment()
            engine.run_steps(stop, next_batch, on_step, should_stop)
            log.end_segment()
            if engine.step < stop:  # a stop was requested: keep what was done, then leave
                log.flush()
                save_checkpoint(run, engine, data, cfg, log.elapsed(), log.lines_at(engine.step))
                raise Interrupted(
                    getattr(should_stop, "signum", None) or signal.SIGTERM,
                    f"stopped at step {engine.step} and saved a checkpoint; continue with: "
                    f"{resume_command(run.path, engine.layout.world)}",
                )
            if pause.evaluate:
                log.on_eval(stop, engine.evaluate(val, token_bytes), engine.weight_drift())
                if watch_stages and stop < cfg.steps:  # the last step's come with the summary
                    log.on_stages(stop, engine.stage_reports(digests=False))
            log.flush()
            if pause.save:
                save_checkpoint(run, engine, data, cfg, log.elapsed(), log.lines_at(engine.step))
        stages = engine.stage_reports()
        log.on_stages(engine.step, stages)
    if not leader:
        return None
    summary = run_summary(log, engine, mc, usage, resumed_at, stages)
    run.write_summary(summary)
    print(summary_line(summary, run.path, engine.layout.world, mc), flush=True)
    return summary
