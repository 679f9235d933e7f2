"""Bounded work: what an integer setting sizes is made as it is used, or refused past a limit.

Plans made as they are run: a schedule's actions cost what is read of them, never the whole run.

The pipeline runtime reads each process's actions from a stream (``segment_actions``); these
tests hold that stream to the whole lists of :func:`nobubble.schedules.generate` (the plan
before it ran in windows), a stopped run's stream to the shorter run's lists, and the making of
a run of 10**12 steps to the few actions read of it (counted, not timed). The training loop's
pauses (evaluations, checkpoints) are likewise found one at a time.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from nobubble.cli import main
from nobubble.config import ConfigError, TrainConfig
from nobubble.configure import build_config
from nobubble.data import build
from nobubble.data.build import build_from_source
from nobubble.data.errors import DataError
from nobubble.data.sources import HFDataset
from nobubble.data.tokenizer import ByteTokenizer
from nobubble.layout import ParallelLayout
from nobubble.pipeline.plan import RECV_AHEAD, ActionWindow, segment_actions
from nobubble.run.loop import Pause, pauses
from nobubble.schedules import (
    SCHEDULE_NAMES,
    Action,
    ActionKind,
    generate,
    generators,
    lower,
    rank_actions,
    until_step,
)
from nobubble.schedules.registry import schedule_spec
from nobubble.versions import gradient_version

# (P, M) shapes every schedule can run: M a multiple of P (interleaved) and at least P (2bw)
SHAPES = [(1, 1), (1, 3), (2, 2), (2, 4), (3, 3), (3, 6), (4, 4), (4, 8)]


def config(schedule: str, stages: int, microbatches: int) -> TrainConfig:
    # pipedream steps after every microbatch: its training config has M = 1
    micro = 1 if schedule == "pipedream" else microbatches
    micro = max(micro, 2 * stages) if schedule == "dualpipev" else micro
    chunks = schedule_spec(schedule).default_chunks  # what building the config resolves
    return TrainConfig(schedule=schedule, stages=stages, microbatches=micro, chunks=chunks)


def whole_segment(cfg: TrainConfig, pp_rank: int, start: int, stop: int) -> list[Action]:
    """A process's actions for steps [start, stop) from the whole lists, shifted to the run."""
    chunks = cfg.chunks
    lowered = lower(
        generate(
            cfg.schedule,
            cfg.stages,
            cfg.microbatches,
            stop - start,
            chunks if chunks > 1 else None,
        )
    )
    delays = schedule_spec(cfg.schedule).delays(ParallelLayout.of(cfg).model_stages)

    def shifted(a: Action) -> Action:  # an F&B's halves alike
        step = a.step + start
        version = step + 1 if a.kind is ActionKind.STEP else gradient_version(step, delays[a.stage])
        micro = None if a.microbatch is None else a.microbatch + start * cfg.microbatches
        paired = None if a.paired is None else shifted(a.paired)
        return dataclasses.replace(a, step=step, microbatch=micro, version=version, paired=paired)

    return [shifted(a) for a in lowered[pp_rank]]


def layout(cfg: TrainConfig, pp_rank: int) -> ParallelLayout:
    return ParallelLayout.of(cfg, pp_rank, schedule_spec(cfg.schedule).placement)


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
@pytest.mark.parametrize(("stages", "microbatches"), SHAPES)
def test_the_streamed_segment_is_the_whole_segments_plan(schedule, stages, microbatches):
    """For every schedule, shape, process and segment [start, stop): the same actions in the
    same order as the whole plan of the segment (what bitwise parity rests on)."""
    cfg = config(schedule, stages, microbatches)
    for pp_rank, (start, stop) in itertools.product(range(stages), [(0, 1), (0, 4), (3, 5)]):
        streamed = list(segment_actions(cfg, layout(cfg, pp_rank), start, stop))
        assert streamed == whole_segment(cfg, pp_rank, start, stop), (pp_rank, start, stop)


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
@pytest.mark.parametrize(("stages", "microbatches"), SHAPES)
def test_a_stopped_run_is_the_shorter_runs_plan_cool_down_included(schedule, stages, microbatches):
    """Stopping a run of 6 steps at step t leaves exactly the lists of a run of t steps, and
    reads the longer run no further than its first backward of step t."""
    if schedule == "pipedream":  # its steps are microbatches: a run of t steps is M = 1
        microbatches = 1
    microbatches = max(microbatches, 2 * stages) if schedule == "dualpipev" else microbatches
    for t, rank in itertools.product(range(1, 7), range(stages)):
        shorter = generate(schedule, stages, microbatches, t)[rank]
        stopped = list(until_step(rank_actions(schedule, stages, microbatches, 6, rank), t))
        assert stopped == shorter, (t, rank)


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_a_process_stopped_at_a_step_runs_the_shorter_segment(schedule):
    """The runtime's plan, read as it reads it (a few actions ahead) and stopped at the first
    action of step t, runs exactly the actions of the segment [start, t)."""
    cfg = config(schedule, 3, 6)
    start, stop = 2, 8
    for pp_rank, t in itertools.product(range(cfg.stages), range(start + 1, stop)):
        plan, ran = ActionWindow(cfg, layout(cfg, pp_rank), start, stop), []
        while (action := plan.peek()) is not None:
            plan.ahead(RECV_AHEAD)
            if action.step == t:
                plan.stop_at(t)
                continue
            ran.append(action)
            plan.pop()
        assert ran == list(segment_actions(cfg, layout(cfg, pp_rank), start, t)), (pp_rank, t)


class _Counted(Action):
    """An Action that counts how many were made, and refuses to be made past a budget (so that
    planning a whole run fails the test instead of hanging it)."""

    made = 0
    budget = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _Counted.made += 1
        if _Counted.made > _Counted.budget:
            raise AssertionError(f"planned more than {_Counted.budget} actions")


@pytest.fixture
def counted(monkeypatch):
    monkeypatch.setattr(generators, "Action", _Counted)
    monkeypatch.setattr(_Counted, "made", 0)
    monkeypatch.setattr(_Counted, "budget", 50_000)
    return _Counted


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_a_run_of_a_trillion_steps_plans_only_what_is_read(counted, schedule):
    """The first 1,000 actions of each process of a 10**12-step segment are those of a run
    long enough to hold them, and reading them makes about as many (each is made, then placed
    in the run: twice), not the run's."""
    cfg = dataclasses.replace(config(schedule, 4, 8), steps=10**12)
    enough = 1000 // cfg.microbatches + 10  # steps: more actions than read, per process
    for pp_rank in range(cfg.stages):
        counted.made = 0
        first = list(itertools.islice(segment_actions(cfg, layout(cfg, pp_rank), 0, 10**12), 1000))
        assert counted.made <= 2 * 1000 + 100  # and the few a step's plan makes beyond them
        counted.made = 0
        assert first == list(segment_actions(cfg, layout(cfg, pp_rank), 0, enough))[:1000]


def test_stopping_a_trillion_step_segment_ends_it(counted):
    """A stop decided at step 3 of a 10**12-step segment ends the plan after step 3's
    cool-down, reading a few actions past it."""
    cfg = dataclasses.replace(config("2bw", 4, 8), steps=10**12)
    stopped = list(until_step(segment_actions(cfg, layout(cfg, 0), 0, 10**12), 3))
    assert counted.made < 1000
    assert stopped == list(segment_actions(cfg, layout(cfg, 0), 0, 3))


@pytest.mark.parametrize("start", [0, 3, 12])
@pytest.mark.parametrize(("steps", "eval_every", "checkpoint_every"), [
    (12, 0, 0), (12, 5, 0), (12, 0, 4), (12, 4, 6), (13, 4, 6), (12, 12, 1), (7, 20, 30),
])  # fmt: skip
def test_training_pauses_where_it_evaluates_or_saves(steps, eval_every, checkpoint_every, start):
    cfg = TrainConfig(steps=steps, eval_every=eval_every, checkpoint_every=checkpoint_every)
    evals = {s for s in range(1, steps + 1) if s == steps or (eval_every and s % eval_every == 0)}
    saves = {
        s
        for s in range(1, steps + 1)
        if s == steps or (checkpoint_every and s % checkpoint_every == 0)
    }
    expected = [Pause(s, s in evals, s in saves) for s in sorted(evals | saves) if s > start]
    assert list(pauses(cfg, start)) == expected


def test_a_trillion_step_run_finds_its_pauses_as_it_reaches_them():
    cfg = TrainConfig(steps=10**12, eval_every=1000, checkpoint_every=1500)
    first = list(itertools.islice(pauses(cfg, 0), 3))
    assert first == [Pause(1000, True, False), Pause(1500, False, True), Pause(2000, True, False)]
    assert list(pauses(cfg, 10**12 - 1)) == [Pause(10**12, True, True)]


def test_threads_are_bounded_before_any_is_made():
    """Each torch thread is an OS thread made at the first parallel operation: a million would
    be refused by the OS mid-run; the setting is refused first."""
    with pytest.raises(ConfigError, match=r"threads must be in \[0, 1024\], got 1000000"):
        build_config({"threads": 1000000})
    assert build_config({"threads": 1024}).threads == 1024


def test_a_streamed_validation_set_past_memory_is_refused_before_reading(monkeypatch):
    """A streamed dataset is read for every validation token before training: 10**9 batches
    would read the stream's whole validation side into memory."""
    monkeypatch.setattr(build, "iter_records", None)  # the stream is never opened
    cfg = TrainConfig(data="hf:org/name", eval_batches=10**9)
    with pytest.raises(DataError, match=r"= 4,096,000,000,000 validation tokens, .* at most"):
        build_from_source(HFDataset("org/name", None, "text"), cfg, None, ByteTokenizer())


def test_a_model_too_large_for_memory_is_one_line_and_leaves_no_run(tmp_path, capsys):
    """A shape whose weights cannot be allocated (here 10^11 embeddings of 256: 100 TB) is
    refused in one line, before the run folder is made."""
    out = tmp_path / "big"
    args = ["train", "--out", str(out), "vocab_size=100000000000", "steps=1", "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "the model does not fit in memory" in err and "Traceback" not in err
    assert not out.exists()
