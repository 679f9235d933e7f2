"""One rule for sizes: every command's numbers are checked by one rule (nobubble.config.flags,
from the same Range a setting declares), refused in one line that names the flag, what it
accepts and why, with exit 2 and before any work; the boundary itself is accepted."""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable, Sequence

import pytest

from nobubble.bench.cli import REPEATS, RETRIES
from nobubble.cli import build_parser, main
from nobubble.config.parallel import ParallelSettings
from nobubble.corrections_cli import TERMS_RANGE
from nobubble.data import prepare
from nobubble.planning import cli as plan_cli
from nobubble.planning.estimate import ClusterPlan, estimate
from nobubble.planning.hardware import DEVICES, LINKS
from nobubble.planning.shapes import PLANNING_SHAPES
from nobubble.schedules.registry import PIPELINE_SCHEDULES
from nobubble.sweeping.grid import RUNS, SweepError, load_sweep


def refused(capsys, command: Callable[[list[str]], int | None], argv: Sequence[str]) -> str:
    """The one line of a refusal (exit 2, nothing on stdout)."""
    try:
        code = command(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 2 and captured.err.count("\n") == 1 and not captured.out, captured
    return captured.err


def parsed(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_no_command_takes_a_number_past_the_one_rule():
    """Every flag of every command takes a number through nobubble.config.flags, or one of
    fixed choices, or no number (the training settings: checked by their fields' ranges)."""
    commands = build_parser()._subparsers._group_actions[0].choices
    bare = [
        f"{name} {action.option_strings or action.dest}"
        for name, parser in commands.items()
        for action in parser._actions
        if action.type in (int, float) and action.choices is None
    ]
    assert not bare


# -- corrections --------------------------------------------------------------------------------


@pytest.mark.parametrize("terms", ["100000000", "1001", "0", "-3"])
def test_corrections_terms_past_their_range_are_refused(capsys, terms):
    err = refused(capsys, main, ["corrections", "--terms", terms])
    assert err.startswith(f"nobubble corrections: error: argument --terms: must be {TERMS_RANGE}")
    assert f"got {terms} ({TERMS_RANGE.why})" in err


def test_corrections_take_their_most_terms(capsys):
    assert main(["corrections", "--terms", str(int(TERMS_RANGE.high))]) == 0
    assert parsed("corrections", "--terms", "1").terms == 1


# -- plan ---------------------------------------------------------------------------------------

FLOAT_FLAGS = ["--peak-tflops", "--mfu", "--p2p-gbps", "--p2p-latency-us", "--allreduce-gbps"]
FLOAT_FLAGS += ["--memory-limit-gb", "--tokens"]


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "1e999"])
@pytest.mark.parametrize("flag", FLOAT_FLAGS)
def test_every_float_flag_of_plan_refuses_what_is_not_finite_naming_the_flag(capsys, flag, value):
    err = refused(capsys, main, ["plan", f"{flag}={value}"])
    assert err.startswith(f"nobubble plan: error: argument {flag}: must be ")


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_a_peak_that_is_not_a_positive_finite_number_is_refused_alike(capsys, value):
    """inf and nan were taken, and the plan failed on an internal quantity."""
    err = refused(capsys, main, ["plan", "--peak-tflops", value])
    assert "argument --peak-tflops: must be in [0.001, 1e+06]" in err and "bwd" not in err


def test_the_hardware_figures_at_their_limits_still_give_finite_times(capsys):
    big = str(2**53)
    argv = ["plan", "--preset", "llama3-405b", "--peak-tflops", "1e-3", "--mfu", "1e-3"]
    argv += ["--p2p-gbps", "1e-6", "--allreduce-gbps", "1e-6", "--p2p-latency-us", "1e9"]
    argv += ["--seq-len", big, "--microbatch-size", big, "--dp", big, "--json"]
    main(argv)
    predictions = json.loads(capsys.readouterr().out)["predictions"]
    assert predictions and all(math.isfinite(p["step_s"]) for p in predictions)
    assert main(["plan", "--preset", "tiny", "--seq-len", "1", "--peak-tflops", "1e6"]) == 0


@pytest.mark.parametrize(
    "flag", ["--stages", "--microbatches", "--dp", "--chunks", "--seq-len", "--vocab-size"]
)
def test_plan_counts_stop_where_floating_point_stops_being_exact(capsys, flag):
    for wrong in ("0", str(2**53 + 1)):
        err = refused(capsys, main, ["plan", flag, wrong])
        assert f"argument {flag}: must be in [1, {2**53}], got {wrong} (" in err
    dest = flag[2:].replace("-", "_")
    assert getattr(parsed("plan", flag, str(2**53)), dest) == 2**53


def test_a_grid_of_more_shapes_than_the_limit_is_refused_before_any_is_predicted(
    capsys, monkeypatch
):
    monkeypatch.setattr(plan_cli, "grid", None)  # never reached
    eight = "1,2,3,4,5,6,7,8"
    err = refused(capsys, main, ["plan", "--grid", eight, "--grid-ratios", f"{eight},9"])
    assert f"must be {plan_cli.GRID_SHAPES}, got 72 ({plan_cli.GRID_SHAPES.why})" in err
    plan_cli.check_grid(parsed("plan", "--grid", eight, "--grid-ratios", eight))  # 64: the most
    err = refused(capsys, main, ["plan", "--grid", "2,x"])
    assert "argument --grid: must be a whole number, got 'x'" in err


def test_one_stage_has_no_bubble_not_a_negative_one(capsys):
    """One stage idles never; the busy times summed in floating point passed the step's."""
    plan = ClusterPlan(
        model=PLANNING_SHAPES["llama3-8b"], parallel=ParallelSettings(stages=1, microbatches=16),
        microbatch_size=1, seq_len=4096, device=DEVICES["h100"], mfu=0.4, p2p=LINKS["ib-ndr"],
        allreduce=LINKS["ib-ndr"],
    )  # fmt: skip
    assert all(estimate(plan, name).bubble >= 0.0 for name in PIPELINE_SCHEDULES)
    assert main(["plan", "--stages", "1"]) == 0
    out = capsys.readouterr().out
    assert "-0.0%" not in out and "| 0.0% |" in out


# -- schedule -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "wrong", "accepted"),
    [
        ("--stages", "0", "1"),
        ("--microbatches", "-1", "1"),
        ("--steps", "0", "1"),
        ("--chunks", "0", "2"),
        ("--width", "0", "1"),
        ("--comm", "nan", "0"),
        ("--comm", "-1", "0"),
        ("--fwd", "inf", "1e-9"),
        ("--bwd", "1,nan,1,1", "1,2,1,1"),
        ("--wgrad", "0", "1"),
    ],
)
def test_schedule_numbers_out_of_range_are_one_line(capsys, flag, wrong, accepted):
    err = refused(capsys, main, ["schedule", flag, wrong])
    assert err.startswith(f"nobubble schedule: error: argument {flag}: must be ")
    parsed("schedule", flag, accepted)


# -- bench --------------------------------------------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch) -> None:
    def launched(*args: object) -> None:
        raise AssertionError("a benchmark run was started")

    monkeypatch.setattr("nobubble.bench.cli.run_timed", launched)


@pytest.mark.parametrize(
    ("flag", "wrong", "most"),
    [
        ("--repeats", "0", None),
        ("--repeats", "101", REPEATS),
        ("--busy-retries", "-1", None),
        ("--busy-retries", "11", RETRIES),
        ("--warmup-steps", "-1", None),
        ("--steps", "0", None),
        ("--stages", "0", None),
        ("--dp", "0", None),
        ("--seq-len", "0", None),
    ],
)
def test_bench_counts_out_of_range_are_refused_before_any_run(capsys, no_launch, flag, wrong, most):
    err = refused(capsys, main, ["bench", "--quick", flag, wrong])
    assert err.startswith(f"nobubble bench: error: argument {flag}: must be ")
    if most is not None:
        assert f"({most.why})" in err
        assert getattr(parsed("bench", flag, str(int(most.high))), flag[2:].replace("-", "_"))


def test_bench_steps_are_bounded_by_the_simulation_of_every_run(capsys, no_launch):
    # 2 stages x 2 chunks x 4 microbatches x 12,500 steps = 200,000 forwards: the most
    argv = ["bench", "--quick", "--stages", "2", "--microbatches", "4", "--schedules", "1f1b"]
    err = refused(capsys, main, [*argv, "--steps", "12501"])
    assert "= 200,016 forwards, more than the 200,000" in err and "use fewer steps" in err
    with pytest.raises(AssertionError, match="a benchmark run was started"):
        main([*argv, "--steps", "12500"])


# -- sweep --------------------------------------------------------------------------------------


def test_sweep_jobs_below_one_are_refused(capsys, tmp_path):
    err = refused(capsys, main, ["sweep", "--config", str(tmp_path / "g.toml"), "--jobs", "0"])
    assert "nobubble sweep: error: argument --jobs: must be >= 1, got 0" in err
    assert parsed("sweep", "--config", "g.toml", "--jobs", "1").jobs == 1


def grid_file(tmp_path, seeds: int, lrs: int) -> str:
    path = tmp_path / "grid.toml"
    values = ", ".join(f"{1e-4 * (i + 1):.6g}" for i in range(lrs))
    path.write_text(f"[grid]\nseed = {list(range(seeds))}\nlr = [{values}]\n")
    return str(path)


def test_a_grid_of_more_runs_than_the_limit_is_refused_before_listing_them(tmp_path):
    """Counted from the axes: 10**12 runs are refused at once, not listed first."""
    path = tmp_path / "huge.toml"
    axes = "\n".join(f"{key} = {list(range(1, 101))}" for key in ("seed", "steps", "eval_every"))
    path.write_text(f"[grid]\n{axes}\nlog_every = {list(range(1, 101))}\n")
    with pytest.raises(SweepError, match=re.escape(f"must be {RUNS}, got 10001 (")):
        load_sweep(grid_file(tmp_path, 10001, 1))
    with pytest.raises(SweepError, match=re.escape(f"must be {RUNS}, got 100000000 (")):
        load_sweep(path)
    assert len(load_sweep(grid_file(tmp_path, 100, 100)).phases[0].points()) == RUNS.high


# -- the GPU check, export, eval, report, prepare ---------------------------------------------


@pytest.mark.parametrize("gpus", ["-2", "0"])
def test_the_gpu_check_refuses_fewer_than_one_gpu_and_writes_nothing(capsys, tmp_path, gpus):
    out = tmp_path / "check"
    err = refused(capsys, main, ["gpu-check", "plan", "--gpus", gpus, "--out", str(out)])
    assert f"nobubble gpu-check plan: error: argument --gpus: must be >= 1, got {gpus}" in err
    assert not out.exists()
    assert main(["gpu-check", "plan", "--gpus", "1", "--out", str(out)]) == 0
    assert json.loads((out / "plan.json").read_text())["runs"]


def test_export_and_eval_steps_are_whole_numbers_from_zero(capsys):
    for argv in (["export", "RUN", "OUT"], ["eval", "RUN", "--tasks", "t"]):
        err = refused(capsys, main, [*argv, "--step", "-1"])
        assert f"nobubble {argv[0]}: error: argument --step: must be >= 0, got -1" in err
        assert parsed(*argv, "--step", "0").step == 0


def test_report_paper_tokens_must_be_positive_and_finite(capsys):
    for wrong in ("0", "nan", "inf"):
        err = refused(capsys, main, ["report", "RUNS", "--scaling", "--paper-tokens", wrong])
        assert "argument --paper-tokens: must be positive (> 0) and finite" in err


def test_prepare_shards_fit_the_token_count_of_their_header(capsys, tmp_path):
    for wrong in (str(2**31), "0"):  # 0 looped for ever
        err = refused(
            capsys, prepare.main, ["builtin", str(tmp_path / "x"), "--shard-tokens", wrong]
        )
        assert "argument --shard-tokens: must be in [1, 2147483647]" in err
    assert not (tmp_path / "x").exists()
    prepare.main(
        ["builtin", str(tmp_path / "y"), "--shard-tokens", str(2**31 - 1), "--max-tokens", "9"]
    )
    assert len(list((tmp_path / "y").glob("*.bin"))) == 1
