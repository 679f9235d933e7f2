"""A train command that is refused or fails leaves every file as it was; --overwrite replaces the
old run only once the new one is ready to start."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nobubble.cli import main
from nobubble.run import setup
from nobubble.runfolder.lock import FolderBusy, hold_folder
from tests.helpers.pipeline import SMALL, snapshot
from tests.helpers.runs import train


def one_clear_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("nobubble: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def bad_setups(tmp_path) -> list[list[str]]:
    """Settings that pass the config check but fail while the run is being set up."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "garbage.json").write_text("{not a tokenizer")
    return [
        [f"data={tmp_path / 'empty.txt'}"],
        [f"tokenizer={tmp_path / 'garbage.json'}"],
    ]


def test_overwrite_keeps_the_old_run_when_the_new_one_cannot_start(tmp_path, capsys, bad_setups):
    run = tmp_path / "r"
    assert train(run, "steps=2") == 0
    before = snapshot(tmp_path)
    for bad in bad_setups:
        assert train(run, "steps=3", *bad, "--overwrite") == 2
        one_clear_line(capsys)
        assert snapshot(tmp_path) == before  # the old run, and nothing next to it
    assert train(run, "steps=3", "--overwrite") == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "garbage.json", "r"]


def test_a_failed_new_run_leaves_an_empty_folder_and_removes_only_what_it_made(
    tmp_path, capsys, bad_setups
):
    (tmp_path / "mine").mkdir()
    before = snapshot(tmp_path)
    for bad in bad_setups:
        assert train(tmp_path / "mine", "steps=2", *bad) == 2
        assert train(tmp_path / "new" / "deeper" / "run", "steps=2", *bad) == 2
        assert snapshot(tmp_path) == before
    assert train(tmp_path / "mine", "steps=2") == 0
    assert (tmp_path / "mine" / "summary.json").is_file()


def test_overwrite_replaces_only_a_run_folder(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("not a run")
    before = snapshot(tmp_path)
    assert train(tmp_path / "notes", "steps=2", "--overwrite") == 2
    assert "not a nobubble run folder" in one_clear_line(capsys)
    assert snapshot(tmp_path) == before


def test_a_failed_swap_puts_the_old_run_back(tmp_path, capsys, monkeypatch):
    run = tmp_path / "r"
    assert train(run, "steps=2") == 0
    before = snapshot(tmp_path)
    rename = os.rename

    def new_run_cannot_move_in(src, dst):
        if os.fspath(dst) == os.fspath(run) and ".new-" in os.fspath(src):
            raise OSError("disk trouble")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", new_run_cannot_move_in)
    assert train(run, "steps=3", "--overwrite") == 2
    assert "disk trouble" in one_clear_line(capsys)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("flags", [[], ["--overwrite"], ["--auto-resume"]])
def test_an_overwrite_cut_short_between_its_renames_is_reported(tmp_path, capsys, flags):
    """A crash after the old run was moved aside and before the new one moved in."""
    assert train(tmp_path / "r", "steps=2") == 0
    (tmp_path / "r").rename(tmp_path / ".r.old-4242")
    before = snapshot(tmp_path)
    assert train(tmp_path / "r", "steps=2", *flags) == 2
    err = one_clear_line(capsys)
    assert f"mv {tmp_path / '.r.old-4242'} {tmp_path / 'r'}" in err
    assert snapshot(tmp_path) == before


def test_resume_refuses_another_out(tmp_path, capsys):
    assert train(tmp_path / "r", "steps=2") == 0
    before = snapshot(tmp_path)
    for out in (["--out", str(tmp_path / "x")], [f"out={tmp_path / 'x'}"]):
        assert main(["train", "--no-progress", "--resume", str(tmp_path / "r"), *out]) == 2
        assert "--resume continues" in one_clear_line(capsys)
        assert snapshot(tmp_path) == before


def test_auto_resume_needs_out(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--no-progress", *SMALL, "steps=2", "--auto-resume"]) == 2
    assert "--auto-resume needs --out" in one_clear_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_out_under_a_file_is_one_line_and_touches_nothing(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    before = snapshot(tmp_path)
    for out in (tmp_path / "file" / "run", tmp_path / "file"):
        assert train(out, "steps=2") == 2
        assert "not a folder" in one_clear_line(capsys)
        assert snapshot(tmp_path) == before


def test_out_in_a_folder_that_may_not_be_written_is_one_line(capsys, unwritable):
    """``unwritable``: see conftest.lock_writes for how read-only is simulated."""
    assert train(unwritable / "run", "steps=2") == 2
    err = one_clear_line(capsys)
    assert f"--out {unwritable / 'run'}: cannot write in {unwritable}" in err
    assert list(unwritable.iterdir()) == []


@pytest.mark.parametrize("flag", ["--resume", "--auto-resume"])
def test_continuing_a_run_folder_that_may_not_be_written_is_one_line(
    tmp_path, capsys, lock_writes, flag
):
    """``lock_writes``: see conftest for how read-only is simulated."""
    run = tmp_path / "r"
    assert train(run, "steps=2") == 0
    before = snapshot(tmp_path)
    lock_writes(run)
    capsys.readouterr()
    given = ["--resume", str(run)] if flag == "--resume" else ["--out", str(run), flag]
    assert main(["train", "--no-progress", *given, *SMALL, "steps=4"]) == 2
    named = "--resume" if flag == "--resume" else "--out"
    assert f"{named} {run}: cannot write in {run}" in one_clear_line(capsys)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("flag", ["--overwrite", "--auto-resume"])
def test_resume_takes_no_other_run_folder_flag(tmp_path, flag):
    assert train(tmp_path / "r", "steps=2") == 0
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit):
        main(["train", "--no-progress", "--resume", str(tmp_path / "r"), flag])
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("out", ["/proc/nobubble-test", "/proc/nobubble-test/run", "/sys/x"])
def test_out_in_a_system_folder_is_one_line(capsys, out):
    if not Path(out).parents[-2].is_dir():
        pytest.skip(f"no {Path(out).parents[-2]} here")
    assert train(out, "steps=2") == 2
    assert f"--out {out}: cannot write in" in one_clear_line(capsys)


def test_a_name_that_is_not_a_plain_folder_name_is_refused(tmp_path, capsys, monkeypatch):
    """Without --out the run folder is runs/<name>-<time>: a name with '/' would put it
    elsewhere (name=../../escaped: outside runs/)."""
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    before = snapshot(tmp_path)
    for name in ("../../escaped", "sub/run", "/abs"):
        assert main(["train", "--no-progress", *SMALL, "steps=2", f"name={name}"]) == 2
        assert "is not a plain folder name" in one_clear_line(capsys)
        assert snapshot(tmp_path) == before
    assert main(["train", "--no-progress", *SMALL, "steps=1", "name=..plain"]) == 0
    assert [p.name[:8] for p in (work / "runs").iterdir()] == ["..plain-"]


def test_a_run_through_a_symlink_goes_where_it_points_and_keeps_the_link(tmp_path):
    target, link = tmp_path / "disk" / "run", tmp_path / "link"
    link.symlink_to(target)  # dangling until the run is made
    assert train(link, "steps=2") == 0
    assert train(link, "steps=3", "--overwrite") == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads((target / "summary.json").read_text())["steps"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "link"]  # nothing left over
    assert [p.name for p in (tmp_path / "disk").iterdir()] == ["run"]
    assert main(["train", "--no-progress", "--resume", str(link), "steps=4"]) == 0
    assert json.loads((target / "summary.json").read_text())["steps"] == 4


def ended_process() -> int:
    """The id of a process of this machine that has ended."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


@pytest.mark.parametrize("how", ["--overwrite", "--resume"])
def test_leftovers_of_killed_commands_are_cleaned_up_or_reported(tmp_path, how):
    """A setup folder whose process on this machine has ended is deleted; one in use is left
    alone; every other leftover (another machine's setup folder, a replaced run that was not
    completely deleted) gets a warning naming it and what to do."""
    run, host = tmp_path / "r", socket.gethostname()
    assert train(run, "steps=2") == 0
    ended, alive = ended_process(), os.getppid()
    killed_setup = tmp_path / f".r.new-{host}-{ended}"
    busy_setup = tmp_path / f".r.new-{host}-{alive}"
    foreign_setup = tmp_path / ".r.new-elsewhere-12"
    half_deleted = tmp_path / f".r.old-{host}-{ended}"
    for leftover in (killed_setup, busy_setup, foreign_setup, half_deleted):
        leftover.mkdir()
        (leftover / "config.json").write_text("{}")
    with pytest.warns(UserWarning) as caught:
        if how == "--resume":
            assert main(["train", "--no-progress", "--resume", str(run), "steps=3"]) == 0
        else:
            assert train(run, "steps=3", "--overwrite") == 0
    warned = [str(w.message) for w in caught if str(tmp_path) in str(w.message)]
    assert not killed_setup.exists()
    assert busy_setup.exists() and foreign_setup.exists() and half_deleted.exists()
    assert len(warned) == 2, warned
    assert (
        f"{foreign_setup} is the setup folder" in warned[0]
        and f"rm -r {foreign_setup}" in warned[0]
    )
    assert f"{half_deleted} holds a run of r" in warned[1] and f"rm -r {half_deleted}" in warned[1]


HOLDER = (
    "import sys\n"
    "from pathlib import Path\n"
    "from nobubble.runfolder.lock import hold_folder\n"
    "hold_folder(Path(sys.argv[1]), 'it', 'wait')\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)


def test_a_run_folder_in_use_by_another_process_is_refused_and_left_as_it_was(tmp_path, capsys):
    """Two processes training into one folder (two --auto-resume jobs, an --overwrite of a run in
    progress) would interleave their checkpoints and metrics: the second is refused, in one line,
    before it reads or changes anything; once the first has ended, the folder is free."""
    run = tmp_path / "r"
    assert train(run, "steps=2") == 0
    before = snapshot(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        for second in (
            lambda: train(run, "steps=3", "--auto-resume"),
            lambda: train(run, "steps=3", "--overwrite"),
            lambda: main(["train", "--no-progress", "--resume", str(run), "steps=3"]),
        ):
            assert second() == 2
            line = one_clear_line(capsys)
            assert f"run folder {run} is in use by another process" in line, line
        assert snapshot(tmp_path) == before
    finally:
        holder.kill()
        holder.wait()
    assert main(["train", "--no-progress", "--resume", str(run), "steps=3"]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 3


@pytest.mark.parametrize("how", ["new", "--overwrite", "--resume"])
def test_the_run_folder_stays_locked_while_it_trains(tmp_path, monkeypatch, how):
    """The lock is on the folder itself: a new run's setup folder is locked and renamed into
    place, so the run folder is held from its setup to its last step, whichever way it opened."""
    run = tmp_path / "r"
    if how != "new":
        assert train(run, "steps=2") == 0
    trained = setup.run_training
    seen = []

    def training_while_held(cfg, mc, folder, *rest):
        with pytest.raises(FolderBusy):
            os.close(hold_folder(run, "it", "wait"))
        seen.append(folder.path)
        return trained(cfg, mc, folder, *rest)

    monkeypatch.setattr(setup, "run_training", training_while_held)
    if how == "--resume":
        assert main(["train", "--no-progress", "--resume", str(run), "steps=3"]) == 0
    else:
        assert train(run, "steps=3", *([how] if how != "new" else [])) == 0
    assert seen == [run]
    os.close(hold_folder(run, "it", "wait"))  # released at the end
