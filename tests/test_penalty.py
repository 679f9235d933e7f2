"""The delay's penalty in steps on hand-made curves, against hand-computed answers."""

import pytest

from nobubble.reporting.penalty import first_reach, penalty

SYNC = [(0, 5.0), (100, 3.0), (200, 2.0), (300, 1.5)]


def test_first_reach_interpolates_between_evaluations():
    assert first_reach(SYNC, 2.0) == 200  # on an evaluation
    assert first_reach(SYNC, 2.5) == pytest.approx(150)  # halfway from 3.0 (100) to 2.0 (200)
    assert first_reach(SYNC, 1.6) == pytest.approx(280)  # 200 + 0.4 / 0.5 * 100
    assert first_reach(SYNC, 6.0) == 0  # the first evaluation is already there
    assert first_reach(SYNC, 1.4) is None  # never


def test_first_reach_takes_the_first_crossing_of_a_curve_that_rises_again():
    curve = [(0, 5.0), (10, 2.0), (20, 3.0), (30, 1.0)]
    assert first_reach(curve, 2.5) == pytest.approx(10 * 2.5 / 3)  # 5.0 -> 2.0 over 10 steps


def test_a_delayed_run_that_ends_above_sync():
    delayed = [(0, 5.0), (100, 3.5), (200, 2.8), (300, 2.5)]
    p = penalty(SYNC, delayed)
    assert not p.beats_sync
    assert p.steps == 300
    assert p.sync_steps == pytest.approx(150)  # sync reaches 2.5 at step 150
    assert p.excess_steps == pytest.approx(300 / 150 - 1)  # 1.0: twice the steps
    assert p.delayed_steps is None  # it never reaches sync's 1.5


def test_a_delayed_run_that_reaches_sync_at_its_last_evaluation_costs_nothing():
    p = penalty(SYNC, [(0, 5.0), (150, 2.5), (300, 1.5)])
    assert p.sync_steps == 300 and p.excess_steps == 0
    assert p.delayed_steps == 300


def test_a_delayed_run_that_ends_below_sync_beats_it_and_has_no_excess_steps():
    delayed = [(0, 5.0), (100, 3.0), (200, 1.4), (300, 1.45)]
    p = penalty(SYNC, delayed)
    assert p.beats_sync
    assert p.sync_steps is None and p.excess_steps is None
    # the inverse exists: it first reaches sync's 1.5 between 3.0 (100) and 1.4 (200)
    assert p.delayed_steps == pytest.approx(100 + 1.5 / 1.6 * 100)


def test_a_delayed_run_no_better_than_sync_at_step_zero_has_no_excess_steps():
    p = penalty(SYNC, [(0, 5.0), (300, 5.5)])
    assert p.sync_steps == 0 and p.excess_steps is None and not p.beats_sync


def test_an_empty_curve_is_refused():
    with pytest.raises(ValueError):
        penalty([], SYNC)
