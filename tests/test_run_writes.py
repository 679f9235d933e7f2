"""A write into the run folder that fails while a run trains (a full disk, a read-only folder)
ends the run in one line that names the file, the problem and the fix, with summary.json saying
why where it can still be written, and leaves everything written before intact: the resume is
exact."""

import errno
import json
from types import SimpleNamespace

import pytest

from nobubble.cli import main
from nobubble.layout import ParallelLayout
from nobubble.pipeline import runtime
from nobubble.pipeline.comm import PeerFailure
from nobubble.run import loop
from nobubble.runfolder import folder as runfolder
from tests.helpers.pipeline import SMALL, assert_same_run, metrics, snapshot

SETTINGS = ["steps=6", "eval_every=3", "checkpoint_every=2", "keep_checkpoints=5"]


def train(out, *args: str) -> int:
    return main(["train", "--no-progress", "--out", str(out), *SMALL, *SETTINGS, *args])


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("nobubble: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("summary_too", [False, True], ids=["metrics", "whole-disk"])
def test_a_full_disk_ends_in_one_line_and_the_resume_is_exact(
    tmp_path, capsys, monkeypatch, summary_too
):
    """The disk fills while metrics.jsonl takes a line (half of it written, then ENOSPC); with
    ``summary_too`` summary.json cannot be written either."""
    assert train(tmp_path / "full") == 0
    run = tmp_path / "cut"
    write_all, write_json, calls = runfolder.write_all, runfolder.write_json_atomic, []

    def fills_up(fd: int, data: bytes) -> None:
        calls.append(data)
        if len(calls) < 5:
            return write_all(fd, data)
        write_all(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    def no_space(path, payload) -> None:  # once the disk is full
        if len(calls) < 5:
            return write_json(path, payload)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(runfolder, "write_all", fills_up, raising=False)
    if summary_too:
        monkeypatch.setattr(runfolder, "write_json_atomic", no_space)
    capsys.readouterr()
    assert train(run) == 2
    err = one_line(capsys)
    assert f"cannot write {run / 'metrics.jsonl'}: no space left on device" in err
    assert "free space on its disk" in err and f"nobubble train --resume {run}" in err
    metrics(run)  # every line whole: the half line was cut off again
    if summary_too:
        assert "summary.json could not be written either" in err
        assert not (run / "summary.json").exists()
    else:
        assert "summary.json says why it stopped" in err
        summary = json.loads((run / "summary.json").read_text())
        assert summary["stopped"] == "error" and "no space left on device" in summary["reason"]
    monkeypatch.undo()
    assert train(run, "--auto-resume") == 0
    assert_same_run(tmp_path / "full", run)


@pytest.mark.parametrize("locked", ["checkpoints", "run folder"])
def test_a_read_only_run_folder_ends_in_one_line_and_changes_nothing(
    tmp_path, capsys, monkeypatch, lock_writes, locked
):
    """The run folder (or only its checkpoints folder) turns read-only before the checkpoint of
    step 4 (``lock_writes``: see conftest); summary.json says why where it can be written."""
    run = tmp_path / "r"
    save, before = loop.save_checkpoint, {}

    def locks_first(run_folder, engine, *args) -> None:
        if engine.step == 4:
            lock_writes(run / "checkpoints")
            if locked == "run folder":
                lock_writes(run / "metrics.jsonl")
                lock_writes(run)
            before.update(snapshot(run))
        save(run_folder, engine, *args)

    monkeypatch.setattr(loop, "save_checkpoint", locks_first)
    assert train(run) == 2
    err = one_line(capsys)
    assert f"cannot write {run / 'checkpoints'}" in err and "make it writable" in err
    assert f"nobubble train --resume {run}" in err
    if locked == "run folder":
        assert "summary.json could not be written either" in err
        assert snapshot(run) == before
    else:
        assert "summary.json says why it stopped" in err
        after = snapshot(run)
        assert json.loads(after.pop("summary.json")[1])["stopped"] == "error"
        assert after == before


def test_a_rank_whose_peer_left_at_a_checkpoint_ends_in_the_peer_failure_line(monkeypatch):
    """The leader could not write the checkpoint and exited: a rank waiting for it at the
    checkpoint's barrier gets the peer-failure line, not gloo's error."""

    def closed() -> None:
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    monkeypatch.setattr(runtime.dist, "barrier", closed)
    rank = SimpleNamespace(step=4, layout=ParallelLayout(pp=2, rank=1))
    with pytest.raises(PeerFailure) as failure:
        runtime.PipelineEngine.barrier(rank)
    message = str(failure.value)
    assert message.startswith("stage 1 stopped waiting for the other processes of the run")
    assert "exited, crashed or is stuck" in message and "Connection closed by peer" in message
