"""Schedule renderers (text grid, PNG, Chrome trace) and the `nobubble schedule` command."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from nobubble.cli import main
from nobubble.schedules import (
    SCHEDULE_NAMES,
    ActionKind,
    chrome_trace,
    generate,
    lower,
    render_png,
    render_text,
    schedule_spec,
    simulate,
)
from nobubble.schedules import cli as schedule_cli
from nobubble.schedules.cli import add_arguments, run
from nobubble.schedules.registry import PIPELINE_SCHEDULES


def result_of(schedule: str, p: int = 3, m: int = 4, steps: int = 2):
    return simulate(lower(generate(schedule, p, m, steps)))


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args(list(argv)))


def test_text_grid_by_hand():
    text = render_text(result_of("gpipe", 2, 2, 1), title="gpipe P=2 M=2", width=200)
    lines = text.splitlines()
    assert lines[0] == "gpipe P=2 M=2"
    # 5 characters per time unit: the widest label "F0v0" plus a space fits in F's one unit
    assert "5 characters per time unit" in lines[1]
    assert lines[3] == "   0         2         4         6         8"
    assert lines[4] == "s0 F0v0 F1v0 ...............B0v0      B1v0     |"
    assert lines[5] == "s1 .....F0v0 F1v0 B0v0      B1v0     |.........."


def test_text_grid_wraps_to_width():
    text = render_text(result_of("2bw", 4, 8, 3), width=80)
    assert all(len(line) <= 80 for line in text.splitlines()[1:])
    assert text.count("\ns0 ") > 3
    for k in range(24):  # every microbatch's forward and backward at every stage
        assert text.count(f"F{k}v") == 4 and text.count(f"B{k}v") == 4


def test_png_is_written(tmp_path):
    path = tmp_path / "schedule.png"
    render_png([(name, result_of(name, m=6)) for name in SCHEDULE_NAMES], path)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 20_000


def test_trace_has_one_event_per_compute_action():
    result = result_of("pipedream")
    trace = json.loads(json.dumps(chrome_trace([("pipedream", result)])))
    events = trace["traceEvents"]
    compute = [e for e in events if e["ph"] == "X"]
    actions = [t for stage in result.timeline for t in stage if t.action.kind.is_compute]
    assert len(compute) == len(actions) == 2 * 3 * 8
    assert sum(e["ph"] == "i" for e in events) == 3 * 8  # a STEP per microbatch and stage
    first = next(e for e in compute if e["tid"] == 1)
    assert first["name"] == "F0" and first["ts"] == 1000.0 and first["dur"] == 1000.0
    assert first["args"] == {"stage": 1, "microbatch": 0, "version": 0, "step": 0}
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"pipedream", "stage 0", "stage 1", "stage 2"}


def test_cli_json(capsys):
    assert cli("--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--json") == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["schedule"] == "1f1b" and summary["steps"] == 3
    assert summary["makespan"] == 99
    assert summary["bubble_fraction"]["overall"] == pytest.approx(3 / 11)
    assert summary["bubble_fraction"]["per_stage"] == pytest.approx([3 / 11] * 4)
    assert summary["peak_activations"] == [4, 3, 2, 1]
    assert summary["weight_versions"] == [1, 1, 1, 1]
    assert summary["invariant_violations"] == []


def test_cli_text_png_and_trace(tmp_path, capsys):
    png, trace = tmp_path / "s.png", tmp_path / "s.json"
    argv = ["--schedule", "2bw", "--stages", "2", "--microbatches", "2", "--steps", "2"]
    assert (
        cli(*argv, "--fwd", "1,2", "--comm", "0.5", "--png", str(png), "--trace", str(trace)) == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("2bw P=2 M=2 steps=2\n")
    assert "invariants: all hold" in out
    assert f"wrote PNG {png}" in out
    assert png.stat().st_size > 10_000
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 2 * 2 * 4


def test_cli_all_compares_every_schedule(capsys):
    assert cli("--schedule", "all", "--stages", "2", "--microbatches", "2", "--steps", "2") == 0
    out, err = capsys.readouterr()
    one_stage = [n for n in PIPELINE_SCHEDULES if not schedule_spec(n).interleaved]
    assert out.count("s0 F0v0") == len(one_stage)  # a grid per schedule with one stage per rank
    assert out.count("r0 F0.0v0") == 2  # interleaved-1f1b and zb-v: rank 0 runs two stages
    # dualpipev needs M >= 2P: left out of `all`, named with its rule on stderr
    assert "dualpipev: not drawn: dualpipev needs microbatches >= 2 x stages" in err
    assert cli("--schedule", "all", "--stages", "2", "--microbatches", "2", "--no-grid") == 0
    out = capsys.readouterr().out
    assert "F0v0" not in out
    assert "| schedule | makespan | bubble |" in out
    assert "| 2bw | 21 | 14.3% | 0.286 | [2, 1] | [2, 2] |" in out  # 3 steps by default
    assert cli("--schedule", "all", "--stages", "2", "--microbatches", "2", "--json") == 0
    drawn = [n for n in PIPELINE_SCHEDULES if n != "dualpipev"]
    assert list(json.loads(capsys.readouterr().out)) == drawn
    assert cli("--schedule", "all", "--stages", "2", "--microbatches", "4", "--json") == 0
    assert list(json.loads(capsys.readouterr().out)) == list(PIPELINE_SCHEDULES)


def error_line(capsys, *argv: str) -> str:
    """``nobubble schedule ARGV`` fails with one line (exit status 2); that line."""
    assert main(["schedule", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("nobubble: error: ") and captured.err.count("\n") == 1
    return captured.err


def test_cli_errors(capsys):
    assert "2bw needs microbatches >= stages" in error_line(
        capsys, "--schedule", "2bw", "--stages", "4", "--microbatches", "2"
    )
    assert "fwd lists 3 times" in error_line(capsys, "--stages", "2", "--fwd", "1,1,1")
    with pytest.raises(SystemExit):
        cli("--fwd", "fast")
    assert "argument --fwd: must be a number, got 'fast'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--png", "--trace"])
def test_an_output_file_in_a_missing_folder_is_refused_before_simulating(
    tmp_path, capsys, monkeypatch, flag
):
    monkeypatch.setattr(schedule_cli, "simulate", None)  # never reached
    target = tmp_path / "missing" / "out.file"
    err = error_line(capsys, flag, str(target))
    assert f"{flag} {target}: folder {target.parent} does not exist" in err


@pytest.mark.parametrize("flag", ["--png", "--trace"])
def test_an_output_file_that_cannot_be_written_is_refused_before_simulating(
    tmp_path, capsys, monkeypatch, unwritable, flag
):
    """Under a regular file, or in a folder that takes no files (``unwritable``: see
    conftest.lock_writes for how read-only is simulated)."""
    monkeypatch.setattr(schedule_cli, "simulate", None)  # never reached
    (tmp_path / "file").write_text("keep")
    for target in (tmp_path / "file" / "out.file", unwritable / "out.file"):
        assert f"{flag} {target}: " in error_line(capsys, flag, str(target))
    assert (tmp_path / "file").read_text() == "keep" and list(unwritable.iterdir()) == []


def test_long_computations_show_progress(capsys, monkeypatch):
    """A computation that takes longer than PROGRESS_DELAY_S draws a bar on stderr; with no delay
    every one does, so a small case shows what a long one would."""
    monkeypatch.setattr(schedule_cli, "PROGRESS_DELAY_S", 0.0)
    assert cli("--schedule", "all", "--stages", "3", "--microbatches", "6", "--no-grid") == 0
    bar = capsys.readouterr().err.split("\r")
    assert bar[-1].startswith(f"{PIPELINE_SCHEDULES[-1]}: checking invariants: 100%|")  # all done


def test_python_dash_m_errors_are_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "nobubble.schedules", "--width", "0"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == (
        "python -m nobubble.schedules: error: argument --width: must be >= 1, got 0\n"
    )


def test_python_dash_m():
    out = subprocess.run(
        [sys.executable, "-m", "nobubble.schedules", "--schedule", "gpipe", "--stages", "2",
         "--microbatches", "2", "--steps", "1", "--json"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert json.loads(out)["makespan"] == 9


def test_step_marks_follow_stage_steps():
    result = result_of("1f1b", 2, 2, 2)
    steps = [t for t in result.timeline[0] if t.action.kind is ActionKind.STEP]
    assert [t.start for t in steps] == [9, 18]


def test_the_simulation_reports_its_progress_in_shares_that_add_up_to_one():
    shares: list[float] = []
    simulate(lower(generate("1f1b", 4, 8, 3)), on_progress=shares.append)
    assert len(shares) > 1 and min(shares) >= 0 and sum(shares) == pytest.approx(1.0)


def test_a_shape_too_big_to_simulate_and_draw_is_refused_before_any_work(capsys, monkeypatch):
    monkeypatch.setattr(schedule_cli, "generate", None)  # never reached
    err = error_line(capsys, "--steps", "1000000000")
    assert (
        "2bw: --stages 4 x --microbatches 8 x --steps 1000000000 = 32,000,000,000 forwards" in err
    )
    assert f"more than {schedule_cli.MAX_SIMULATED_FORWARDS:,}" in err
    err = error_line(capsys, "--schedule", "all", "--microbatches", "8", "--steps", "6250")
    assert "interleaved-1f1b: --stages 4 x 2 chunks x --microbatches 8" in err  # 400,000


def test_a_text_grid_too_wide_to_draw_is_refused_before_anything_is_written(tmp_path, capsys):
    """The grid gives the shortest action a label's width: a tiny one makes it huge."""
    png = tmp_path / "timeline.png"
    err = error_line(capsys, "--fwd", "1e-6", "--png", str(png))
    assert "2bw: the text grid would be " in err and "use --no-grid or --json" in err
    assert not png.exists()
    assert cli("--fwd", "1e-6", "--no-grid") == 0
