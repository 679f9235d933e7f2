"""Watching a run: TensorBoard and W&B beside metrics.jsonl, MFU, the summary line."""

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from nobubble.cli import main
from nobubble.configure import build_config
from nobubble.data import load_tokenizer
from nobubble.model.flops import flops_per_token
from nobubble.model.presets import PRESETS
from nobubble.model.resolve import model_config
from nobubble.run.steplog import StepLogger
from nobubble.run.summary import summary_line
from nobubble.tracking import TensorBoardLogger, stage_scalars
from tests.helpers.pipeline import SMALL, metrics, run_train
from tests.helpers.runs import cut_back_to

PEAK = 0.5  # TFLOP/s of the one device: a made-up peak, so that the run has an MFU
SETTINGS = ["steps=6", "eval_every=2", "checkpoint_every=3", "keep_checkpoints=5"]


def train(out, *args: str) -> tuple[int, str]:
    """``nobubble train`` in this process; its exit code and what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["train", "--no-progress", "--out", str(out), *SMALL, *args])
    return code, printed.getvalue()


def resume(run, *args: str) -> tuple[int, str]:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["train", "--no-progress", "--resume", str(run), *args])
    return code, printed.getvalue()


def tensorboard_scalars(run) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of ``run/tb`` as TensorBoard reads it (purged steps left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(event.step, event.value) for event in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }


def metrics_scalars(run) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as TensorBoard stores it: every numeric key by step, as float32; a
    per-model-stage staleness list as one scalar per stage that measured it."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for line in metrics(run):
        for key, value in line.items():
            if key in ("weight_drift", "grad_cosine"):
                named = {f"{key}/model_stage{s}": v for s, v in enumerate(value) if v is not None}
            elif key != "step" and isinstance(value, int | float):
                named = {key: value}
            else:
                continue
            for name, number in named.items():
                scalars.setdefault(name, []).append((line["step"], float(np.float32(number))))
    return scalars


@pytest.fixture(scope="module")
def tb_run(tmp_path_factory):
    """A finished simulator run logging to TensorBoard, with an MFU (``peak_tflops``)."""
    run = tmp_path_factory.mktemp("tracking") / "run"
    code, printed = train(run, *SETTINGS, "logger=tensorboard", f"peak_tflops={PEAK}")
    assert code == 0
    return run, printed


def test_tensorboard_holds_the_metrics_lines_step_by_step(tb_run):
    run, _ = tb_run
    scalars = tensorboard_scalars(run)
    assert scalars == metrics_scalars(run)
    assert {"train_loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu"} <= scalars.keys()
    assert [step for step, _ in scalars["val_bpb"]] == [0, 2, 4, 6]


def test_a_resumed_run_continues_the_event_files_without_repeating_a_step(tb_run, tmp_path):
    """The run died after its step-6 checkpoint was lost: events of steps 4-6 were written, and
    the resumed run writes them again; TensorBoard shows each step once, with the new values."""
    run = tmp_path / "run"
    shutil.copytree(tb_run[0], run)
    cut_back_to(run, 3)
    code, printed = resume(run)
    assert code == 0 and "resuming step_000003" in printed
    scalars = tensorboard_scalars(run)
    assert scalars == metrics_scalars(run)
    assert [step for step, _ in scalars["train_loss"]] == [1, 2, 3, 4, 5, 6]
    assert len(list((run / "tb").glob("events.out.tfevents.*"))) == 2
    assert scalars["tokens_per_s"][3:] != metrics_scalars(tb_run[0])["tokens_per_s"][3:]


def test_mfu_is_in_every_metrics_line_and_the_summary(tb_run):
    run, _ = tb_run
    cfg = build_config(json.loads((run / "config.json").read_text()))
    vocab = load_tokenizer(run).vocab_size  # 257 bytes and <eos>: 320 rows, a multiple of 64
    per_token = flops_per_token(model_config(cfg, vocab), cfg.seq_len)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["flops_per_token"] == per_token and summary["devices"] == 1
    assert summary["peak_tflops"] == PEAK and summary["peak_source"] == "peak_tflops"
    for line in [*[r for r in metrics(run) if "train_loss" in r], summary]:
        model_tflops = per_token * line["tokens_per_s"] / 1e12
        assert line["mfu"] == pytest.approx(model_tflops / PEAK, rel=1e-12)
    assert summary["model_tflops"] == pytest.approx(summary["mfu"] * PEAK, rel=1e-12)


def test_the_run_ends_with_a_summary_line(tb_run):
    run, printed = tb_run
    summary = json.loads((run / "summary.json").read_text())
    last = printed.splitlines()[-1]
    assert last.startswith("nobubble: done: 6 steps in ")
    for part in [
        f"val_loss {summary['final_val_loss']:.4f}, val_bpb {summary['final_val_bpb']:.4f}",
        f"{summary['tokens_per_s']:,.0f} tok/s, MFU {summary['mfu']:.1%}",
        f"run folder: {run}",
        f"more steps: nobubble train --resume {run} steps=N",
        f"export: nobubble export {run} OUT --format hf",
    ]:
        assert part in last


def test_without_a_peak_the_summary_line_gives_model_tflops_and_says_why_no_mfu(tmp_path):
    summary = {
        "steps": 3, "wall_s": 200.0, "final_val_loss": 2.0, "final_val_bpb": 3.0,
        "tokens_per_s": 12345.6, "model_tflops": 0.0123,
        "peak_source": "no peak known on cpu: set peak_tflops",
    }  # fmt: skip
    line = summary_line(summary, tmp_path / "my run", processes=2, mc=PRESETS["tiny"])
    said = ["3 steps", "3 min 20 s", "val_loss 2.0000", "val_bpb 3.0000", "12,346 tok/s"]
    said += ["0.0123 model TFLOP/s", summary["peak_source"]]  # no MFU, and why (the fix)
    assert [part for part in said if part not in line] == []
    quoted = f"'{tmp_path / 'my run'}'"
    assert f"torchrun --nproc-per-node 2 -m nobubble train --resume {quoted} steps=N" in line


def test_a_moe_run_s_summary_line_offers_no_export_which_refuses_moe_models(tmp_path, capsys):
    out = tmp_path / "moe"
    code, printed = train(out, "steps=1", "moe_experts=4", "moe_top_k=2")
    assert code == 0
    last = printed.splitlines()[-1]
    assert last.startswith("nobubble: done: 1 steps") and f"--resume {out} steps=N" in last
    assert "export" not in last
    assert main(["export", str(out), str(tmp_path / "hf")]) == 2
    assert "mixture-of-experts" in capsys.readouterr().err


def test_wandb_online_without_an_api_key_is_refused_before_anything_is_written(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    out = tmp_path / "runs" / "r"
    assert main(["train", "--out", str(out), *SMALL, "logger=wandb", "wandb_mode=online"]) == 2
    err = capsys.readouterr().err
    assert "wandb_mode=online" in err and "`wandb login`" in err and "WANDB_API_KEY" in err
    assert "wandb_mode=offline" in err and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("ending", ["signal", "error"])
def test_loggers_are_closed_however_the_run_ends(tmp_path, monkeypatch, ending):
    closed = []
    close = TensorBoardLogger.close
    monkeypatch.setattr(
        TensorBoardLogger, "close", lambda self, error: (closed.append(error), close(self, error))
    )
    on_step = StepLogger.on_step

    def step_then(self, stats, last=False):
        on_step(self, stats, last)
        if stats.step + 1 == 2:
            if ending == "error":
                raise RuntimeError("a bug at step 2")
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the run: stops after this step

    monkeypatch.setattr(StepLogger, "on_step", step_then)
    if ending == "error":
        with pytest.raises(RuntimeError, match="a bug at step 2"):
            train(tmp_path / "r", "steps=4", "logger=tensorboard")
    else:
        assert train(tmp_path / "r", "steps=4", "logger=tensorboard")[0] == 128 + signal.SIGTERM
    expected = {"signal": "Interrupted", "error": "RuntimeError"}[ending]
    assert [type(error).__name__ for error in closed] == [expected]
    scalars = tensorboard_scalars(tmp_path / "r")  # written out, up to the last step done
    assert scalars == metrics_scalars(tmp_path / "r")
    assert [step for step, _ in scalars["train_loss"]] == [1, 2]


def test_stage_scalars_are_named_by_stage_and_replica():
    """``stage{p}``: the pipeline rank, the name the scalars had before reports called it
    ``pp_rank``; what names the process (its model stages too) is no scalar."""
    report = {"pp_rank": 1, "model_stages": [1, 3], "replica": 0, "blocks": 2}
    report |= {"idle_fraction": 0.25, "weights_sha256": "ab"}
    assert stage_scalars([report]) == {"stage1/idle_fraction": 0.25}
    second = {**report, "replica": 1, "idle_fraction": 0.5}
    assert stage_scalars([report, second]) == {
        "stage1/replica0/idle_fraction": 0.25,
        "stage1/replica1/idle_fraction": 0.5,
    }


def wandb_history(folder) -> tuple[str, list[dict]]:
    """(run id, history records) of an offline W&B run folder, read with W&B's own reader."""
    wandb = shutil.which("wandb", path=os.path.dirname(sys.executable))
    done = subprocess.run(
        [wandb, "leet", "inspect", "--json", str(folder)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    run_id = next(r["run"]["run_id"] for r in records if r["type"] == "run")
    return run_id, [r["history"]["item"] for r in records if r["type"] == "history"]


@pytest.mark.slow
def test_wandb_offline_writes_the_metrics_and_a_resume_continues_the_same_run(
    tmp_path, monkeypatch
):
    for variable in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    settings = ["steps=4", "eval_every=2", "checkpoint_every=2", "keep_checkpoints=3"]
    assert train(run, *settings, "logger=wandb", "wandb_mode=offline")[0] == 0
    run_id = json.loads((run / "wandb.json").read_text())["run_id"]
    (first,) = sorted((run / "wandb").glob("offline-run-*"))
    assert wandb_history(first)[0] == run_id

    def same_as_metrics(history: list[dict], steps: range) -> None:
        lines = {line["step"]: line for line in metrics(run)}
        assert [item["_step"] for item in history] == list(steps)
        for item in history:
            line = lines[item["_step"]]
            assert {k: v for k, v in item.items() if not k.startswith("_")} == {
                k: v for k, v in line.items() if k != "step"
            }

    same_as_metrics(wandb_history(first)[1], range(0, 5))
    cut_back_to(run, 2)
    assert resume(run)[0] == 0
    second = next(p for p in sorted((run / "wandb").glob("offline-run-*")) if p != first)
    resumed_id, history = wandb_history(second)
    assert resumed_id == run_id
    same_as_metrics(history, range(3, 5))  # from the checkpoint on, each step once


@pytest.mark.slow
def test_a_pipeline_run_logs_per_stage_scalars_and_ends_with_the_summary_line(tmp_path):
    run = tmp_path / "run"
    done = run_train(
        "--out", str(run), *SMALL, "schedule=2bw", "stages=2", "microbatches=2",
        "steps=4", "eval_every=2", "logger=tensorboard", stages=2,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    scalars = tensorboard_scalars(run)
    assert {k: v for k, v in scalars.items() if not k.startswith("stage")} == metrics_scalars(run)
    summary = json.loads((run / "summary.json").read_text())
    for report in summary["stages"]:
        for measure in ("idle_fraction", "peak_mem_mb", "weight_versions_peak", "param_mb"):
            logged = scalars[f"stage{report['pp_rank']}/{measure}"]
            assert [step for step, _ in logged] == [2, 4]  # at the evaluation, at the end
            assert logged[-1][1] == np.float32(report[measure])
        assert report["weight_versions_peak"] == 2  # 2bw
        # the time of each kind of action, blocked time left out (the cost model's F:B split)
        (times,) = report["action_s"].values()
        assert list(report["action_s"]) == [str(report["pp_rank"])]
        assert {"F", "B", "STEP"} <= times.keys() and min(times.values()) > 0
        assert sum(times.values()) < report["train_wall_s"] - report["idle_s"]
    last = done.stdout.splitlines()[-1]
    assert last.startswith("nobubble: done: 4 steps in ") and f"run folder: {run}" in last
    assert f"torchrun --nproc-per-node 2 -m nobubble train --resume {run} steps=N" in last
