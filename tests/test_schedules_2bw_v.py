"""2bw-v, a candidate under study (issue 39; docs/schedules.md, "An asynchronous V (2bw-v)"):
2bw's one-step delay, no flush, the V placement. Its wave and generated lists against a
hand-drawn case, the invariants over a grid, the rule on M shown tight, the refusals, and the
figures of experiments/async_v.py's table (exact: times are multiples of half a forward)."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from nobubble.config import ConfigError
from nobubble.configure import build_config
from nobubble.schedules import (
    Action,
    ActionKind,
    ScheduleError,
    check_invariants,
    generate,
    lower,
    schedule_spec,
    simulate,
)
from nobubble.schedules.registry import CANDIDATES, SCHEDULE_NAMES
from nobubble.schedules.timing import split_rank_times
from nobubble.schedules.v_wave import wave_lag, wave_offsets, wave_peak_activations

K = ActionKind
F, B = K.F, K.B
SPEC = CANDIDATES["2bw-v"]
ROOT = Path(__file__).resolve().parents[1]


def _study():
    """experiments/async_v.py, the script that prints the table."""
    spec = importlib.util.spec_from_file_location("async_v", ROOT / "experiments" / "async_v.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def a(kind: ActionKind, k: int, s: int) -> Action:
    return Action(kind, s, k, 0, 0)


def step(s: int) -> Action:
    return Action(K.STEP, s, None, 1, 0)


def test_the_wave_of_two_ranks_by_hand() -> None:
    # F one slot, B two, a period of 6: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2;
    # microbatch 0 runs F0 F1 F2 F3 in slots 0-3, B3 in 4-5 (rank 0), B2 in 9-10 (rank 1, whose
    # slots 1, 2 mod 6 hold its forwards), B1 in 11-12, B0 in 13-14 (rank 0: slots 1, 2 mod 6)
    assert wave_offsets(2) == {
        (F, 0): 0, (F, 1): 1, (F, 2): 2, (F, 3): 3, (B, 3): 4, (B, 2): 9, (B, 1): 11, (B, 0): 13
    }  # fmt: skip
    assert wave_lag(2) == 2
    # rank 0 runs, per period j: F(j)@0, B(j-2)@0, F(j)@3, B(j)@3
    assert generate(SPEC, 2, 2, 1) == [
        [a(F, 0, 0), a(F, 0, 3), a(B, 0, 3), a(F, 1, 0), a(F, 1, 3), a(B, 1, 3), step(3),
         a(B, 0, 0), a(B, 1, 0), step(0)],
        [a(F, 0, 1), a(F, 0, 2), a(F, 1, 1), a(F, 1, 2), a(B, 0, 2), a(B, 0, 1), a(B, 1, 2),
         step(2), a(B, 1, 1), step(1)],
    ]  # fmt: skip


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 8])
def test_the_generated_lists_keep_the_invariants(ranks: int) -> None:
    # every dependency, the per-edge send order, 2bw's versions (a delay of 1, at most two
    # versions per stage) and the activation budget the wave promises
    low = max(wave_lag(ranks), 1)
    for microbatches in sorted({low, low + 1, 2 * ranks}):
        for steps in (1, 3):
            actions = generate(SPEC, ranks, microbatches, steps)
            assert check_invariants(actions, SPEC) == [], (ranks, microbatches, steps)


@pytest.mark.parametrize(("ranks", "lag"), [(2, 2), (3, 4), (4, 4), (5, 6), (8, 10)])
def test_the_rule_on_microbatches_is_tight(ranks: int, lag: int) -> None:
    assert wave_lag(ranks) == lag
    with pytest.raises(ScheduleError, match=f"2bw-v needs microbatches >= {lag} on {ranks}"):
        generate(SPEC, ranks, lag - 1, 1)
    # one microbatch fewer and the forwards of step 2 would need a version not made yet
    unchecked = dataclasses.replace(SPEC, microbatch_rule=lambda stages, microbatches: None)
    problems = check_invariants(generate(unchecked, ranks, lag - 1, 3), unchecked)
    assert any("not produced yet" in p for p in problems)


def test_no_engine_takes_it() -> None:
    assert "2bw-v" not in SCHEDULE_NAMES
    with pytest.raises(ScheduleError, match="'2bw-v' is not supported yet"):
        schedule_spec("2bw-v")
    with pytest.raises(ConfigError, match="'2bw-v' is not supported yet"):
        build_config({"schedule": "2bw-v"})


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_the_steady_state_has_no_bubble_and_the_wave_peak(ranks: int) -> None:
    microbatches = 2 * ranks

    def run(steps: int):
        actions = generate(SPEC, ranks, microbatches, steps)
        return simulate(
            lower(actions),
            fwd=split_rank_times(1.0, actions),
            bwd=split_rank_times(2.0, actions),
        )

    three, four = run(3), run(4)
    assert four.makespan - three.makespan == microbatches * 3.0  # a step adds M (F + B)
    assert four.peak_activations == [wave_peak_activations(r, ranks) for r in range(ranks)]
    assert four.stage_weight_versions == [2] * 2 * ranks


def test_the_table() -> None:
    study = _study()
    rows = {(r.schedule, r.ranks): r for r in study.rows([(2, 4), (4, 8), (8, 16)], steps=4)}
    # activations on each rank, in a loop stage's (a V stage's microbatch counts half)
    assert rows["2bw", 4].activations == (4, 3, 2, 1)
    assert rows["zb-v", 4].activations == (4, 4, 4, 4)
    assert rows["2bw-v", 4].activations == (3, 3, 2.5, 3)
    assert rows["2bw-v", 8].activations == (5.5, 6, 6, 5.5, 6, 6, 5.5, 6)
    fullest = {(name, p): rows[name, p].fullest for name, p in rows}
    assert [fullest["2bw", p] for p in (2, 4, 8)] == [2, 4, 8]
    assert [fullest["2bw-v", p] for p in (2, 4, 8)] == [2, 3, 6]  # no gain at P = 2, 1/4 after
    assert [fullest["zb-v", p] for p in (2, 4, 8)] == [2, 4, 8]
    assert [fullest["1f1b", p] for p in (2, 4, 8)] == [2, 4, 8]
    # weight versions per rank, in a loop stage's weights: two for both asynchronous ones
    for p in (2, 4, 8):
        assert rows["2bw-v", p].weight_versions == rows["2bw", p].weight_versions == (2,) * p
        assert rows["zb-v", p].weight_versions == (1,) * p
    # the same steady step as 2bw; a fill within half a forward of 2bw's
    assert [rows["2bw", p].idle for p in (2, 4, 8)] == [3, 9, 21]
    assert [rows["2bw-v", p].idle for p in (2, 4, 8)] == [3.5, 9, 21.5]
    assert rows["2bw-v", 4].step_time == rows["2bw", 4].step_time == 26.25
    assert "| 4 | 8 | 2bw-v | 3 | 3, 3, 2.5, 3 | 2, 2, 2, 2 | 26.25 | 9 |" in study.markdown(
        list(rows.values())
    )
    # the wave alone: fullest rank, 2bw's, the ratio, the bound (P+1)/2, the least M
    wave = study.wave_markdown((3, 8, 64)).splitlines()[2:]
    assert wave == [
        "| 3 | 3 | 3 | 1.00 | 2 | 4 |",
        "| 8 | 6 | 8 | 0.75 | 4.5 | 10 |",
        "| 64 | 43 | 64 | 0.67 | 32.5 | 84 |",
    ]


@pytest.mark.parametrize(
    ("fwd", "bwd", "comm"), [(1.0, 1.0, 0.0), (1.0, 3.0, 0.5), (2.0, 2.5, 1.0)]
)
def test_other_times_run_the_order_too(fwd: float, bwd: float, comm: float) -> None:
    # the order is the wave's (B = 2F) but follows the dependencies, so any times run it
    actions = generate(SPEC, 4, 6, 3)
    result = simulate(lower(actions), fwd=fwd, bwd=bwd, comm=comm)
    assert result.violations == []
    assert check_invariants(actions, SPEC, result) == []
