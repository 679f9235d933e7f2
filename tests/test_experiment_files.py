"""The grid files of experiments/ plan cleanly, and experiments/run_records.sh keeps finished runs
(records only) so that a sweep finds them complete on another machine."""

import shutil
import subprocess
from pathlib import Path

import pytest

from nobubble.sweeping import cli as sweep
from tests.helpers.commands import call, last_line
from tests.helpers.sweeps import TOY_GRID

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
RECORDS = EXPERIMENTS / "run_records.sh"


@pytest.mark.parametrize("grid", sorted(EXPERIMENTS.glob("*.toml")), ids=lambda p: p.name)
def test_every_grid_file_plans_every_run(grid, tmp_path, capsys):
    """A dry run checks every run's config (each best: value with every value it may take)."""
    assert call(sweep, "--config", str(grid), "--out", str(tmp_path / "runs"), "--dry-run") == 0
    assert "to run" in last_line(capsys.readouterr().out)


def records(*args: object) -> str:
    done = subprocess.run(
        ["bash", str(RECORDS), *map(str, args)], capture_output=True, text=True, check=True
    )
    return done.stdout


def test_records_round_trip_into_a_sweep_that_skips_them(tmp_path, capsys):
    grid = tmp_path / "toy.toml"
    grid.write_text(TOY_GRID)
    first, second = tmp_path / "first", tmp_path / "second"
    assert call(sweep, "--config", str(grid), "--out", str(first)) == 0
    unfinished = first / "schedule=unfinished"
    unfinished.mkdir()
    (unfinished / "config.json").write_text("{}")  # no summary.json: not packed
    archive = tmp_path / "runs.tar.xz"
    assert "2 runs" in records("pack", first, archive)

    kept = second / "schedule=2bw"
    kept.mkdir(parents=True)
    (kept / "note.txt").write_text("mine")
    assert "1 runs added, 1 left as they were" in records("unpack", archive, second)
    assert sorted(p.name for p in kept.iterdir()) == ["note.txt"]  # an existing folder is kept
    restored = second / "schedule=sync"
    assert sorted(p.name for p in restored.iterdir()) == [
        "config.json",
        "metrics.jsonl",
        "summary.json",
    ]
    assert not (second / "schedule=unfinished").exists()
    for name in ("config.json", "summary.json", "metrics.jsonl"):
        assert (restored / name).read_bytes() == (first / "schedule=sync" / name).read_bytes()

    shutil.rmtree(kept)
    capsys.readouterr()
    assert call(sweep, "--config", str(grid), "--out", str(second), "--dry-run") == 0
    text = capsys.readouterr().out
    assert "skip  schedule=sync" in text and "run   schedule=2bw" in text


def test_a_failed_pack_keeps_the_old_archive(tmp_path):
    archive = tmp_path / "runs.tar.xz"
    archive.write_bytes(b"old")
    (tmp_path / "empty").mkdir()
    with pytest.raises(subprocess.CalledProcessError):
        records("pack", tmp_path / "empty", archive)
    assert archive.read_bytes() == b"old"
