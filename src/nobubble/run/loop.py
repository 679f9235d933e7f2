"""The training loop of both backends: segments of steps, evaluation, logging, checkpoints.

The loop asks the engine to train up to the next pause (an evaluation or a checkpoint step), so
a pipeline only drains where something needs the newest weights of every stage.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

from nobubble.config import TrainConfig, chosen_loggers
from nobubble.data import DataBundle
from nobubble.engine import Engine, StepStats
from nobubble.flops import utilization
from nobubble.interrupt import Interrupted
from nobubble.model.presets import ModelConfig
from nobubble.resume import resume_command
from nobubble.run.checkpoints import save_checkpoint
from nobubble.run.nonfinite import NonFinitePolicy
from nobubble.run.steplog import Elapsed, StepLogger
from nobubble.run.summary import run_summary, stops_recorded, summary_line
from nobubble.runfolder import RunFolder


def boundaries(cfg: TrainConfig, start: int) -> tuple[list[int], set[int], set[int]]:
    """(every step where training pauses, evaluation steps, checkpoint steps) after ``start``."""
    evals = {cfg.steps}
    if cfg.eval_every:
        evals |= set(range(cfg.eval_every, cfg.steps, cfg.eval_every))
    saves = {cfg.steps}
    if cfg.checkpoint_every:
        saves |= set(range(cfg.checkpoint_every, cfg.steps, cfg.checkpoint_every))
    stops = sorted(s for s in evals | saves if s > start)
    return stops, evals, saves


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
    stops, evals, saves = boundaries(cfg, engine.step)
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
        stops_recorded(run, log, engine, usage, resumed_at),
    ):
        if engine.step == 0:
            log.on_eval(0, engine.evaluate(val, token_bytes))
        for stop in stops:
            log.begin_segment()
            engine.run_steps(stop, next_batch, on_step, should_stop)
            log.end_segment()
            if engine.step < stop:  # a stop was requested: keep what was done, then leave
                log.flush()
                save_checkpoint(run, engine, data, cfg, log.elapsed())
                raise Interrupted(
                    getattr(should_stop, "signum", None) or signal.SIGTERM,
                    f"stopped at step {engine.step} and saved a checkpoint; continue with: "
                    f"{resume_command(run.path, engine.layout.world)}",
                )
            if stop in evals:
                log.on_eval(stop, engine.evaluate(val, token_bytes))
                if watch_stages and stop < cfg.steps:  # the last step's come with the summary
                    log.on_stages(stop, engine.stage_reports(digests=False))
            log.flush()
            if stop in saves:
                save_checkpoint(run, engine, data, cfg, log.elapsed())
        stages = engine.stage_reports()
        log.on_stages(engine.step, stages)
    if not leader:
        return None
    summary = run_summary(log, engine, usage, resumed_at, stages)
    run.write_summary(summary)
    print(summary_line(summary, run.path, engine.layout.world, mc), flush=True)
    return summary
