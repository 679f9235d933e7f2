"""``nobubble sweep`` end to end on a 2-run toy grid (real training processes), then report."""

import json
import os
import re
import shutil
import tomllib
from pathlib import Path

import pytest

from nobubble.cli import main
from nobubble.configure import build_config
from nobubble.reporting import cli as report
from nobubble.runfolder.lock import hold, hold_folder
from nobubble.sweeping import cli as sweep
from nobubble.sweeping.grid import SweepError
from nobubble.sweeping.planned import PlannedRun, Status
from tests.helpers.commands import call, last_line, line_with
from tests.helpers.pipeline import snapshot
from tests.helpers.sweeps import TOY_GRID


def tally(done: int, skipped: int, failed: int = 0) -> str:
    return f"sweep toy: {done} done, {skipped} skipped (already complete), {failed} failed"


@pytest.fixture
def grid(tmp_path: Path) -> Path:
    path = tmp_path / "toy.toml"
    path.write_text(TOY_GRID)
    return path


def test_dry_run_lists_runs_and_trains_nothing(grid, tmp_path, capsys):
    out = tmp_path / "runs"
    assert call(sweep, "--config", str(grid), "--out", str(out), "--dry-run") == 0
    text = capsys.readouterr().out
    assert "run   schedule=sync" in text and "run   schedule=2bw" in text
    assert (
        last_line(text) == "sweep toy (dry run): 2 to run, 0 complete, 0 waiting for earlier phases"
    )
    assert not out.exists()


def test_toy_sweep_runs_skips_resumes_refuses_and_reports(grid, tmp_path, capsys):
    out = tmp_path / "runs"
    argv = ["--config", str(grid), "--out", str(out), "--jobs", "2"]
    sync, delayed = out / "schedule=sync", out / "schedule=2bw"

    assert call(sweep, *argv) == 0
    assert last_line(capsys.readouterr().out) == tally(done=2, skipped=0)
    for folder, schedule in ((sync, "sync"), (delayed, "2bw")):
        config = json.loads((folder / "config.json").read_text())
        assert (config["schedule"], config["out"], config["progress"]) == (
            schedule,
            str(folder),
            False,
        )
        assert (folder / "summary.json").is_file()
        assert (out / "_sweep" / f"{folder.name}.log").is_file()

    # A second sweep finds both runs complete.
    assert call(sweep, *argv) == 0
    assert last_line(capsys.readouterr().out) == tally(done=0, skipped=2)

    # A half-done run (no summary) is trained again, and only that one.
    kept = (sync / "summary.json").stat().st_mtime_ns
    (delayed / "summary.json").unlink()
    assert call(sweep, *argv) == 0
    assert last_line(capsys.readouterr().out) == tally(done=1, skipped=1)
    assert (delayed / "summary.json").is_file()
    assert (sync / "summary.json").stat().st_mtime_ns == kept

    # One stopped halfway (as by Ctrl-C: a checkpoint, no summary) continues from its checkpoint.
    first_lines = (delayed / "metrics.jsonl").read_text().splitlines()[:2]
    (delayed / "summary.json").unlink()
    shutil.rmtree(delayed / "checkpoints" / "step_000004")
    assert call(sweep, *argv) == 0
    assert last_line(capsys.readouterr().out) == tally(done=1, skipped=1)
    assert "resuming step_000002" in (out / "_sweep" / f"{delayed.name}.log").read_text()
    assert (delayed / "metrics.jsonl").read_text().splitlines()[:2] == first_lines
    assert (delayed / "summary.json").is_file()

    # The report: one row per run, numbers straight from the summaries, a gap 2bw - sync.
    summaries = {f: json.loads((f / "summary.json").read_text()) for f in (sync, delayed)}
    assert call(report, str(out), "--out", str(tmp_path / "report")) == 0
    table = (tmp_path / "report" / "report.md").read_text()
    for s in summaries.values():
        assert f"{s['final_val_loss']:.4f} | {s['final_val_bpb']:.4f}" in table
    gap = summaries[delayed]["final_val_loss"] - summaries[sync]["final_val_loss"]
    assert re.search(rf"\| 2bw \|.*\| {re.escape(f'{gap:+.4f}')} \|", table)
    for png in ("val_loss_vs_step.png", "val_loss_vs_time.png"):
        assert (tmp_path / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A folder that holds another run is never overwritten.
    config = json.loads((sync / "config.json").read_text())
    (sync / "config.json").write_text(json.dumps({**config, "lr": 0.5}))
    (sync / "summary.json").unlink()
    with pytest.raises(
        SweepError, match=r"schedule=sync holds a different run \(lr: folder has 0.5"
    ):
        call(sweep, *argv)
    assert json.loads((sync / "config.json").read_text())["lr"] == 0.5


def test_a_failed_run_does_not_stop_the_others(tmp_path, capsys):
    grid = tmp_path / "fail.toml"
    broken = tmp_path / "missing.txt"
    grid.write_text(
        TOY_GRID.replace('schedule = ["sync", "2bw"]', f'data = ["builtin", "{broken}"]')
    )
    out = tmp_path / "runs"
    assert call(sweep, "--config", str(grid), "--out", str(out)) == 1
    text = capsys.readouterr().out
    assert last_line(text) == tally(done=1, skipped=0, failed=1)
    assert re.search(r"^failed: data=\S*missing.txt: exit 2: nobubble: error: ", text, re.M)
    assert (out / "data=builtin" / "summary.json").is_file()


def test_thread_share_splits_the_cores():
    share = sweep.thread_share(jobs=2, cpus=2)
    assert (share(1), share(2)) == (1, 1)
    share = sweep.thread_share(jobs=1, cpus=8)
    assert (share(1), share(2)) == (8, 4)


def test_a_half_done_run_that_cannot_continue_is_moved_aside_never_deleted(tmp_path, capsys):
    """Its checkpoints all fail verification, and the folder holds a file of the user's: the
    sweep moves the whole folder aside, says where, and trains the run again."""
    grid = tmp_path / "one.toml"
    grid.write_text(TOY_GRID.replace('schedule = ["sync", "2bw"]', 'schedule = ["sync"]'))
    out = tmp_path / "runs"
    argv = ["--config", str(grid), "--out", str(out)]
    run = out / "schedule=sync"
    base = tomllib.loads(TOY_GRID)["base"]  # the run as the sweep would train it, in-process
    settings = [f"{key}={value}" for key, value in base.items()]
    assert main(["train", "--no-progress", "--out", str(run), *settings, "schedule=sync"]) == 0
    (run / "summary.json").unlink()
    for manifest in (run / "checkpoints").glob("step_*/manifest.json"):
        manifest.write_text("{}")
    (run / "notes.txt").write_text("mine")
    capsys.readouterr()
    with pytest.warns(UserWarning, match="falling back to an older checkpoint"):
        assert call(sweep, *argv) == 0
    text = capsys.readouterr().out
    (aside,) = (out / "_sweep" / "set-aside").iterdir()
    assert (aside / "notes.txt").read_text() == "mine" and (aside / "checkpoints").is_dir()
    assert (
        f"set aside schedule=sync: its 2 checkpoint(s) fail verification, so it cannot be "
        f"continued; moved to {aside}" in text
    )
    assert last_line(text) == tally(done=1, skipped=0)
    assert (run / "summary.json").is_file() and not (run / "notes.txt").exists()


def test_a_run_folder_in_use_is_never_set_aside(tmp_path, capsys):
    """A run that has just started has no checkpoint yet and looks half-done: while a process
    trains in it (one a stopped sweep left running), the sweep leaves it where it is and says
    why; once that process has ended, the sweep sets it aside and trains the run again."""
    grid = tmp_path / "one.toml"
    grid.write_text(TOY_GRID.replace('schedule = ["sync", "2bw"]', 'schedule = ["sync"]'))
    out = tmp_path / "runs"
    run = out / "schedule=sync"
    base = tomllib.loads(TOY_GRID)["base"]  # the run as the sweep would train it, in-process
    settings = [f"{key}={value}" for key, value in base.items()]
    assert main(["train", "--no-progress", "--out", str(run), *settings, "schedule=sync"]) == 0
    (run / "summary.json").unlink()  # as it is while it trains, before its first checkpoint
    shutil.rmtree(run / "checkpoints")
    capsys.readouterr()
    before = snapshot(run)
    training = hold_folder(run, "a training run", "")
    try:
        assert call(sweep, "--config", str(grid), "--out", str(out)) == 1
        text = capsys.readouterr().out
        assert (
            f"FAILED schedule=sync: schedule=sync's run folder {run} is in use by another "
            "process: a `nobubble train` is training in it" in text
        )
        assert last_line(text) == tally(done=0, skipped=0, failed=1)
        assert snapshot(run) == before
        assert not (out / "_sweep" / "set-aside").exists()
    finally:
        os.close(training)
    assert call(sweep, "--config", str(grid), "--out", str(out)) == 0
    assert line_with(capsys.readouterr().out, "set aside", "schedule=sync", "no checkpoint")
    assert (run / "summary.json").is_file()


@pytest.mark.parametrize(
    "summary, status",
    [
        (None, Status.PARTIAL),
        ({"stopped": "signal", "steps": 2}, Status.PARTIAL),
        ({"stopped": "error", "steps": 2}, Status.PARTIAL),
        ({"stopped": "non-finite", "steps": 2}, Status.DIVERGED),
        ({"stopped": "finished", "final_val_loss": 2.0}, Status.COMPLETE),
        ({"final_val_loss": 2.0}, Status.COMPLETE),  # written before runs said why they stopped
        ({"stopped": "lunch"}, Status.CONFLICT),
    ],
)
def test_a_runs_status_comes_from_why_its_summary_says_it_stopped(tmp_path, summary, status):
    config = build_config({"steps": 4, "out": str(tmp_path / "run")})
    planned = PlannedRun("", "run", tmp_path / "run", config, "python")
    planned.path.mkdir()
    (planned.path / "config.json").write_text(config.to_json())
    (planned.path / "metrics.jsonl").write_text('{"step": 2, "train_loss": NaN}\n')
    if summary is not None:
        (planned.path / "summary.json").write_text(json.dumps(summary))
    assert planned.status() is status


def test_a_second_sweep_over_a_folder_in_use_is_refused_and_touches_nothing(tmp_path, capsys):
    """Two sweeps over one folder would each set aside the other's run in progress as a
    half-done one: while one holds the output root, another is refused in one line."""
    grid = tmp_path / "one.toml"
    grid.write_text(TOY_GRID.replace('schedule = ["sync", "2bw"]', 'schedule = ["sync"]'))
    out = tmp_path / "runs"
    out.mkdir()
    running = hold(out / sweep.LOCK_FILE, "the first sweep", "")  # what a running sweep holds
    assert main(["sweep", "--config", str(grid), "--out", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        f"nobubble: error: the sweep's output root {out} is in use by another process "
        f"(pid {os.getpid()}): another `nobubble sweep` is running over it; wait for it to "
        "finish or stop it (a sweep started again later skips every run that finished)"
    )
    assert [p.name for p in out.iterdir()] == [sweep.LOCK_FILE]  # nothing planned or trained
    running.close()  # the first sweep ends: the folder is free
    assert call(sweep, "--config", str(grid), "--out", str(out)) == 0
    assert (out / "schedule=sync" / "summary.json").is_file()
