"""Checkpoints and exact resume in one process: interrupted + resumed == uninterrupted."""

import json
import os
import shutil
import signal
import warnings
from pathlib import Path

import pytest

from nobubble.checkpoint.files import verify_checkpoint
from nobubble.one_process import OneProcessEngine
from tests.helpers.pipeline import assert_same_run, metrics, snapshot
from tests.helpers.runs import cut_back_to, resume, train

RUNS = {
    "sync": ["schedule=sync"],
    "2bw+ef": ["schedule=2bw", "correction=ef", "microbatches=2"],
    "pipedream": ["schedule=pipedream", "stages=3", "optim=muon"],
    # delay compensation's state: each parameter's last D applied changes (D = 2, 1, 0)
    "pipedream+dc": ["schedule=pipedream", "stages=3", "correction=dc", "dc_lambda=1000"],
}


@pytest.mark.parametrize("kind", RUNS)
def test_resume_is_identical_to_an_uninterrupted_run(tmp_path, kind):
    settings = [*RUNS[kind], "steps=10", "eval_every=5", "checkpoint_every=3", "keep_checkpoints=5"]
    assert train(tmp_path / "full", *settings) == 0
    assert train(tmp_path / "cut", *settings) == 0
    cut_back_to(tmp_path / "cut", 6)
    assert resume(tmp_path / "cut") == 0
    assert_same_run(tmp_path / "full", tmp_path / "cut")
    assert json.loads((tmp_path / "cut" / "summary.json").read_text())["resumed_at_step"] == 6


TIME_KEYS = ("tokens_per_s", "train_time_s", "mfu")  # differ from run to run


def lines_but_times(run: Path) -> list[dict]:
    return [{k: v for k, v in line.items() if k not in TIME_KEYS} for line in metrics(run)]


def test_the_checkpoint_s_own_metrics_line_cut_short_is_written_again(tmp_path):
    """The newest checkpoint is of step 6, which evaluated, and metrics.jsonl's last line, step
    6's, was cut short after it was saved (a hard kill, a machine that lost its page cache): the
    resumed run starts after step 6, so the line comes back from the checkpoint, val_loss and
    all, and the run's lines are the uninterrupted run's."""
    settings = ["schedule=2bw", "correction=ef", "microbatches=2", "steps=8", "eval_every=3"]
    settings += ["checkpoint_every=6", "keep_checkpoints=5"]
    assert train(tmp_path / "full", *settings) == 0
    cut = tmp_path / "cut"
    assert train(cut, *settings) == 0
    shutil.rmtree(cut / "checkpoints" / "step_000008")
    (cut / "summary.json").unlink()
    lines = (cut / "metrics.jsonl").read_text().splitlines(keepends=True)
    step6 = next(i for i, line in enumerate(lines) if json.loads(line)["step"] == 6)
    (cut / "metrics.jsonl").write_text("".join(lines[:step6]) + lines[step6][:40])
    with pytest.warns(UserWarning, match="dropping 1 damaged line"):
        assert resume(cut) == 0
    assert lines_but_times(cut) == lines_but_times(tmp_path / "full")
    assert "val_loss" in next(line for line in metrics(cut) if line["step"] == 6)


def test_checkpoints_are_kept_pruned_and_verified(tmp_path):
    assert train(tmp_path / "r", "steps=7", "checkpoint_every=2", "keep_checkpoints=2") == 0
    folders = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert folders == ["step_000006", "step_000007"]
    manifest = verify_checkpoint(tmp_path / "r" / "checkpoints" / "step_000007")
    assert set(manifest["files"]) == {
        "shard_0/weights.safetensors",
        "shard_0/state.safetensors",
        "shard_0/state.json",
        "shard_0/meta.json",
    }
    assert manifest["format"] == 2 and set(manifest["params"].values()) == {0}


def test_2bw_checkpoint_holds_both_weight_versions(tmp_path):
    from safetensors import safe_open

    assert train(tmp_path / "r", "schedule=2bw", "steps=4", "microbatches=2") == 0
    path = tmp_path / "r" / "checkpoints" / "step_000004" / "shard_0" / "weights.safetensors"
    with safe_open(path, "pt") as f:
        versions = {key.split("/")[0] for key in f.keys()}  # noqa: SIM118
    assert versions == {"v3", "v4"}


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_manifest"])
def test_a_corrupt_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
    settings = ["steps=8", "checkpoint_every=3", "keep_checkpoints=3", "schedule=2bw"]
    assert train(tmp_path / "full", *settings) == 0
    assert train(tmp_path / "cut", *settings) == 0
    cut_back_to(tmp_path / "cut", 6)
    newest = tmp_path / "cut" / "checkpoints" / "step_000006"
    weights = newest / "shard_0" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "flip":
        data[-5] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(bytes(data[: len(data) // 2]))
    else:
        (newest / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="falling back to an older checkpoint"):
        assert resume(tmp_path / "cut") == 0
    assert_same_run(tmp_path / "full", tmp_path / "cut")  # replayed from step 3


def test_resume_refuses_changes_that_make_another_run(tmp_path, capsys):
    assert train(tmp_path / "r", "steps=4") == 0
    for change, field in [
        ("d_model=64", "d_model"),
        ("schedule=2bw", "schedule"),
        ("tokenizer=bpe", "tokenizer"),
        ("optim=muon", "optim"),
    ]:
        assert resume(tmp_path / "r", change) == 2
        err = capsys.readouterr().err
        assert f"cannot continue {tmp_path / 'r'} with {field}=" in err
        assert "Traceback" not in err


def cut_run_saved_without(tmp_path, settings: list[str], key: str) -> tuple[Path, dict]:
    """Train ``full`` and ``cut`` with ``settings`` (6 steps, a checkpoint at 3), take ``cut``
    back to step 3 and drop ``key`` from its config.json, as a version before ``key`` saved it:
    (that config.json, what it now holds)."""
    assert train(tmp_path / "full", *settings) == 0
    assert train(tmp_path / "cut", *settings) == 0
    cut_back_to(tmp_path / "cut", 3)
    config = tmp_path / "cut" / "config.json"
    saved = json.loads(config.read_text())
    del saved[key]
    config.write_text(json.dumps(saved))
    return config, saved


def test_a_run_saved_before_muon_ns_dtype_continues_exactly_in_bfloat16(tmp_path):
    """Such a run orthogonalized in bfloat16 (torch's Muon) and its config.json lacks the key,
    which reads as auto (float32 on a CPU). muon_ns_dtype may change on resume, so the run
    continues as it was trained."""
    settings = ["optim=muon", "muon_ns_dtype=bfloat16", "steps=6", "checkpoint_every=3"]
    config, _ = cut_run_saved_without(tmp_path, settings, "muon_ns_dtype")
    assert resume(tmp_path / "cut", "muon_ns_dtype=bfloat16") == 0
    assert_same_run(tmp_path / "full", tmp_path / "cut")
    assert json.loads(config.read_text())["muon_ns_dtype"] == "bfloat16"


def test_a_run_saved_before_the_partition_key_continues_with_its_split(tmp_path):
    """Such a run was split by partition=blocks (stages filled from the front, 1, 2, 1, 0 here)
    and its config.json lacks the key; today's default (flops) splits 1, 1, 1, 1, which under
    pipedream would move blocks to other delays. The key reads as it was meant then."""
    settings = ["schedule=pipedream", "stages=4", "partition=blocks", "steps=6"]
    settings += ["checkpoint_every=3"]
    config, saved = cut_run_saved_without(tmp_path, settings, "partition")
    assert saved["stage_layers"] is None  # the rule, not a split, as every such run saved it
    assert resume(tmp_path / "cut") == 0
    assert_same_run(tmp_path / "full", tmp_path / "cut")
    assert json.loads(config.read_text())["partition"] == "blocks"  # pinned from now on


def test_resume_may_extend_the_run(tmp_path):
    assert train(tmp_path / "r", "steps=4", "lr_schedule=constant") == 0
    assert resume(tmp_path / "r", "steps=6", "eval_every=2") == 0
    rows = metrics(tmp_path / "r")
    assert [r["step"] for r in rows if "train_loss" in r] == [1, 2, 3, 4, 5, 6]
    assert json.loads((tmp_path / "r" / "config.json").read_text())["steps"] == 6


def test_resume_detects_a_changed_tokenizer(tmp_path, capsys):
    assert train(tmp_path / "r", "steps=3", "tokenizer=bpe", "bpe_vocab_size=300") == 0
    tokenizer = tmp_path / "r" / "tokenizer.json"
    spec = json.loads(tokenizer.read_text())
    spec["model"]["vocab"]["zzz"] = 299
    tokenizer.write_text(json.dumps(spec))
    assert resume(tmp_path / "r", "steps=4") == 2
    assert "is not the tokenizer" in capsys.readouterr().err


def test_resume_without_a_checkpoint_says_so(tmp_path, capsys):
    assert train(tmp_path / "r", "steps=3") == 0
    shutil.rmtree(tmp_path / "r" / "checkpoints")
    assert resume(tmp_path / "r") == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err


def test_a_folder_holding_another_run_is_left_alone(tmp_path, capsys):
    assert train(tmp_path / "r", "steps=3") == 0
    before = {p: p.read_bytes() for p in (tmp_path / "r").rglob("*") if p.is_file()}
    assert train(tmp_path / "r", "steps=3", "lr=1e-3") == 2
    assert "already holds files" in capsys.readouterr().err
    assert before == {p: p.read_bytes() for p in (tmp_path / "r").rglob("*") if p.is_file()}
    assert train(tmp_path / "r", "steps=2", "--overwrite") == 0
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 2


def test_auto_resume_continues_the_same_run_and_refuses_another(tmp_path, capsys):
    settings = ["steps=6", "checkpoint_every=2", "keep_checkpoints=5"]
    assert train(tmp_path / "full", *settings) == 0
    assert train(tmp_path / "cut", *settings) == 0
    cut_back_to(tmp_path / "cut", 4)
    assert train(tmp_path / "cut", *settings, "--auto-resume") == 0
    assert_same_run(tmp_path / "full", tmp_path / "cut")
    assert train(tmp_path / "cut", *settings, "lr=1e-2", "--auto-resume") == 2
    assert "cannot continue" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["corrupt checkpoints", "no checkpoints", "only config.json"])
def test_auto_resume_never_deletes_a_run_it_cannot_continue(tmp_path, capsys, damage):
    run, settings = tmp_path / "r", ["steps=4", "checkpoint_every=2"]
    assert train(run, *settings) == 0
    if damage == "corrupt checkpoints":
        for weights in run.glob("checkpoints/step_*/shard_0/weights.safetensors"):
            weights.write_bytes(weights.read_bytes()[:-1])
    elif damage == "no checkpoints":
        shutil.rmtree(run / "checkpoints")
    else:  # what a setup that crashed before training anything could have left
        for path in run.iterdir():
            if path.name != "config.json":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    before = snapshot(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warnings naming each corrupt checkpoint
        assert train(run, *settings, "--auto-resume") == 2
    err = capsys.readouterr().err
    assert f"{run} holds no complete checkpoint to resume from" in err
    assert "--overwrite" in err and "Traceback" not in err
    assert snapshot(tmp_path) == before


def test_auto_resume_starts_a_run_in_an_empty_folder(tmp_path):
    (tmp_path / "r").mkdir()
    assert train(tmp_path / "r", "steps=2", "--auto-resume") == 0
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 2


@pytest.mark.parametrize("how", ["--resume", "--auto-resume"])
def test_a_finished_run_says_so_and_changes_nothing(tmp_path, capsys, how):
    run = tmp_path / "r"
    assert train(run, "steps=3") == 0
    capsys.readouterr()
    before = snapshot(tmp_path)
    assert (resume(run) if how == "--resume" else train(run, "steps=3", how)) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and f"{run} is finished: it trained all 3 steps" in out
    assert resume(run, "steps=2") == 2
    assert "trained 3 steps, more than steps=2" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


def test_training_time_adds_up_over_resumes(tmp_path):
    """train_s, tokens_per_s and wall_s describe the whole run, and train_time_s goes on."""
    run = tmp_path / "r"
    assert train(run, "steps=12") == 0
    first = json.loads((run / "summary.json").read_text())
    assert resume(run, "steps=13") == 0
    whole = json.loads((run / "summary.json").read_text())
    times = [r["train_time_s"] for r in metrics(run) if "train_time_s" in r]
    assert [r["step"] for r in metrics(run) if "train_time_s" in r] == [0, 12, 13]
    assert times[0] == 0 and times[1] == first["train_s"] and times[2] == whole["train_s"]
    assert whole["train_s"] > first["train_s"] and whole["wall_s"] > first["wall_s"]
    assert whole["tokens_per_s"] == pytest.approx(13 * 8 * 32 / whole["train_s"])


def stop_at_step(monkeypatch, step: int, stop) -> None:
    """Make training stop with ``stop()`` when the engine reaches ``step`` (a segment later)."""
    train_segment = OneProcessEngine.run_steps

    def run_steps(self, until, *args):
        if self.step >= step:
            stop()
        return train_segment(self, until, *args)

    monkeypatch.setattr(OneProcessEngine, "run_steps", run_steps)


def summary_of(run) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_a_run_stopped_by_an_error_says_why_in_its_summary(tmp_path, monkeypatch):
    """An error: summary.json says so, with the step reached and the last evaluation; a session
    that then trains no step leaves a finished run's summary as it was."""
    run = tmp_path / "r"

    def fail():
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        stop_at_step(patch, 2, fail)
        with pytest.raises(OSError):
            train(run, "steps=4", "eval_every=2", "checkpoint_every=2")
    summary = summary_of(run)
    assert summary["stopped"] == "error" and summary["steps"] == 2
    assert summary["reason"] == "OSError: [Errno 28] No space left on device"
    assert summary["last_eval"]["step"] == 2 and "final_val_loss" not in summary
    assert resume(run) == 0
    finished = summary_of(run)
    assert finished["stopped"] == "finished" and finished["steps"] == 4
    with monkeypatch.context() as patch:  # the next session fails before its first step
        stop_at_step(patch, 4, fail)
        with pytest.raises(OSError):
            resume(run, "steps=6")
    assert summary_of(run) == finished


def test_a_run_stopped_by_a_signal_says_so_in_its_summary(tmp_path, monkeypatch, capsys):
    run = tmp_path / "r"
    stop_at_step(monkeypatch, 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
    assert train(run, "steps=6", "eval_every=2") == 128 + signal.SIGTERM
    summary = summary_of(run)
    saved = [p.name for p in (run / "checkpoints").iterdir()]
    assert summary["stopped"] == "signal" and saved == [f"step_{summary['steps']:06d}"]
    assert summary["reason"].startswith("SIGTERM: stopped at step")
    assert f"continue with: nobubble train --resume {run}" in summary["reason"]
