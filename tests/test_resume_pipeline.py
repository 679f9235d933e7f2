"""Run folders and resume under torchrun: the pipeline sets a new run up beside its folder like
one process does. (A checkpoint continues in either launcher: tests/test_checkpoint_names.py.)"""

import json
import subprocess

import pytest

from tests.helpers.pipeline import SMALL, env, nobubble, snapshot, train_command

pytestmark = pytest.mark.slow


def test_pipeline_overwrite_replaces_the_run_only_when_every_stage_is_ready(tmp_path):
    run, empty = tmp_path / "r", tmp_path / "empty.txt"
    empty.write_text("")
    nobubble(run, "steps=2")
    before = snapshot(tmp_path)
    failed = nobubble(run, "stages=2", f"data={empty}", "--overwrite", stages=2, check=False)
    assert failed.returncode != 0 and str(empty) in failed.stderr
    assert snapshot(tmp_path) == before
    # a trained BPE: the last stage must read rank 0's tokenizer from the setup folder
    bpe = ["tokenizer=bpe", "bpe_vocab_size=300"]
    nobubble(run, "stages=2", "steps=3", *bpe, "--overwrite", stages=2)
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    assert json.loads((run / "config.json").read_text())["tokenizer"] == "bpe"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "r"]


def test_torchrun_restarts_need_a_fixed_run_folder(tmp_path):
    command = train_command(*SMALL, "stages=2", stages=2, torchrun_args=("--max-restarts=1",))
    result = subprocess.run(
        command, capture_output=True, text=True, env=env(), timeout=300, cwd=tmp_path
    )
    assert result.returncode != 0
    assert "--max-restarts" in result.stderr and "--out" in result.stderr  # why, and the fix
    assert list(tmp_path.iterdir()) == []


def test_torchrun_restarts_without_periodic_checkpoints_are_warned_about(tmp_path):
    """A restart can only resume from a checkpoint; with checkpoint_every=0 there is none."""
    args = ("--out", str(tmp_path / "r"), *SMALL, "stages=2", "steps=2", "eval_every=0")
    command = train_command(*args, stages=2, torchrun_args=("--max-restarts=1",))
    result = subprocess.run(command, capture_output=True, text=True, env=env(), timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("with checkpoint_every=0: a restart resumes") == 1  # rank 0 only
