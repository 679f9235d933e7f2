"""The picture of the schedule a pipeline failure shows: a few columns of ``nobubble schedule``'s
grid around the action a process was at, marked, added to the error without changing it.

A real failure (a stage that stops answering) is in tests/test_faults.py.
"""

from __future__ import annotations

import itertools

import pytest

from nobubble.config import TrainConfig
from nobubble.layout import ParallelLayout
from nobubble.pipeline.comm import PeerFailure
from nobubble.pipeline.failure import add_schedule, context_steps, schedule_around
from nobubble.pipeline.plan import segment_actions
from nobubble.schedules import generate, lower, schedule_spec, simulate
from nobubble.schedules.render_text import render_excerpt
from nobubble.schedules.timing import split_rank_times

LEGEND = (
    "F/B/I/W<microbatch>v<weight version>; . idle; | optimizer step; 5 characters per time unit"
)


def one_f_one_b() -> list:
    """1f1b on 2 ranks, 4 microbatches, 2 steps, forward 1 and backward 2: rank 1 runs F0 at
    [1, 2), B0 [2, 4), F1 [4, 5), B1 [5, 7), F2 [7, 8), ...; rank 0 F0, F1, waits, B0 [4, 6),
    F2 [6, 7), B1 [7, 9), F3 [9, 10), B2 [10, 12), ... (5 characters per time unit)."""
    return simulate(lower(generate("1f1b", 2, 4, 2)))


def test_an_excerpt_marks_a_compute_action_in_a_few_columns_of_the_grid():
    result = one_f_one_b()
    position = [str(t.action) for t in result.timeline[1]].index("B1v0@s1")
    assert render_excerpt(result, 1, position, columns=40) == "\n".join([
        LEGEND,
        "s0 ..........B0v0      F2v0 B1v0      F3v0",  # columns 10 to 49: time 2 to 10
        "s1 B0v0      F1v0 B1v0      F2v0 B2v0",
        "                  ^^^^^^^^^^",  # B1 at [5, 7): columns 25 to 34
        "",
    ])  # fmt: skip


def test_an_action_that_takes_no_time_is_marked_at_the_compute_beside_it():
    """A receive at the first column of the compute it feeds, a STEP at its bar."""
    result = one_f_one_b()
    names = [str(t.action) for t in result.timeline[1]]
    receive = render_excerpt(result, 1, names.index("RECV_ACT2v0@s1<-s0"), columns=40)
    assert receive.splitlines()[2:] == [
        "s1      F1v0 B1v0      F2v0 B2v0      F3v0",  # columns 15 to 54
        "                       ^",  # F2 starts at time 7: column 35
    ]
    step = render_excerpt(result, 1, names.index("STEP0->v1@s1"), columns=20)
    *_, row, mark = step.splitlines()
    assert row[mark.index("^")] == "|" and mark.count("^") == 1


def config(schedule: str, stages: int, microbatches: int) -> TrainConfig:
    micro = 1 if schedule == "pipedream" else microbatches
    chunks = schedule_spec(schedule).default_chunks
    return TrainConfig(schedule=schedule, stages=stages, microbatches=micro, chunks=chunks)


@pytest.mark.parametrize("schedule", ["1f1b", "2bw", "pipedream", "interleaved-1f1b", "zb-h2"])
def test_the_picture_of_an_action_is_the_grid_of_its_segment_around_it(schedule):
    """The picture simulates a few steps around the action, numbered as the run's: it is what
    simulating the whole segment draws around the same action (a segment short enough to
    simulate, whose last steps are those the picture simulates, so that labels as wide and the
    same characters per time unit)."""
    cfg = config(schedule, 2, 2)
    margin = context_steps(cfg)
    steps = 2 * margin + 2  # the picture of step margin + 1 simulates steps 1 to the end
    actions = generate(cfg.schedule, 2, cfg.microbatches, steps, cfg.chunks)
    whole = simulate(lower(actions), split_rank_times(1.0, actions), split_rank_times(2.0, actions))
    for pp_rank in range(2):
        layout = ParallelLayout(pp=2, rank=pp_rank, chunks=cfg.chunks)
        timeline = whole.timeline[pp_rank]
        for action in segment_actions(cfg, layout, 0, steps):
            if action.step != margin + 1:
                continue
            position = next(i for i, t in enumerate(timeline) if t.action == action)
            head, picture = schedule_around(cfg, layout, action, 0, steps).split("\n", 1)
            assert head.startswith(f"where {layout.name()} stopped: {action} (step {margin + 2})")
            assert picture == render_excerpt(whole, pp_rank, position)


def test_the_picture_of_a_run_of_any_length_costs_a_few_steps():
    """An action at step 10**9 of a segment of 10**12 steps: drawn from a few steps around it,
    with this run's numbers, a few lines of a few columns."""
    cfg = config("2bw", 4, 4)
    layout = ParallelLayout(pp=4, rank=1)
    start, stop = 10**9, 10**9 + 10**12
    actions = segment_actions(cfg, layout, start, stop)
    backward = next(a for a in actions if a.step == start + 5 and a.kind.is_backward)
    picture = schedule_around(cfg, layout, backward, start, stop)
    lines = picture.splitlines()
    assert lines[0].startswith(f"where stage 1 stopped: {backward} (step {start + 6}), marked ^")
    assert len(lines) == 2 + 4 + 1 and max(map(len, lines[2:])) <= 3 + 72
    label = f"B{backward.microbatch}v{backward.version}"  # B4000000021v1000000004
    row, mark = lines[3], lines[4]
    assert row.startswith("s1 ") and row[mark.index("^") :].startswith(label)
    assert picture == schedule_around(cfg, layout, backward, start, start + 12)


def test_an_error_keeps_its_type_and_text_and_gains_the_picture():
    """A peer failure is printed as its message alone (a user's error): the picture joins the
    message; any other error's traceback shows it as a note."""
    failure = PeerFailure("stage 0 gave up waiting for the gradient")
    add_schedule(failure, "the picture")
    assert type(failure) is PeerFailure and str(failure) == (
        "stage 0 gave up waiting for the gradient\nthe picture"
    )
    bug = RuntimeError("shapes do not match")
    add_schedule(bug, "the picture")
    assert str(bug) == "shapes do not match" and bug.__notes__ == ["the picture"]


def test_too_large_a_picture_is_not_simulated_but_named():
    cfg = config("2bw", 64, 512)
    layout = ParallelLayout(pp=64, rank=3)
    action = next(itertools.islice(segment_actions(cfg, layout, 0, 10), 5, None))
    text = schedule_around(cfg, layout, action, 0, 10)
    assert "too large to draw here" in text and "\n" not in text
    assert "nobubble schedule --schedule 2bw --stages 64 --microbatches 512" in text
