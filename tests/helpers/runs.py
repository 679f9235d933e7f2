"""Whole runs: training and resuming in this process or under torchrun, cutting a run short,
waiting on a run in the background, comparing runs within a rounding tolerance, and run folders
written by hand for the report's tests."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from nobubble.cli import main
from nobubble.config import TrainConfig
from nobubble.staleness import DRIFT
from tests.helpers.pipeline import SMALL, final_weights, losses, run_train

CONSTANT = ["lr_schedule=constant", "eval_every=3"]  # a run cut at 3 steps continues to 6

# Long enough (a few seconds) that a signal lands in the middle of training.
LONG = ["steps=150", "batch_size=32", "eval_every=50", "checkpoint_every=20", "keep_checkpoints=10"]

# by the dtype that rounds the update: float32, or Muon's Newton–Schulz in bfloat16
# (tests/test_data_parallel.py says how the bounds were measured)
TOLERANCE = {"float32": (1e-5, 1e-5), "bfloat16": (1e-4, 1e-3)}  # (losses: rel, weights: abs)


def train(out, *args: str) -> int:
    """``nobubble train`` in this process with the small settings."""
    return main(["train", "--no-progress", "--out", str(out), *SMALL, *args])


def resume(run, *args: str) -> int:
    return main(["train", "--no-progress", "--resume", str(run), *args])


def launch(*args: str, stages: int) -> None:
    """``nobubble train ARGS`` under torchrun's environment with ``stages`` processes, which
    must succeed."""
    done = run_train(*args, stages=stages, timeout=600)
    assert done.returncode == 0, f"{' '.join(done.args)}:\n{done.stdout}\n{done.stderr}"


def cut_back_to(run, step: int) -> None:
    """Make ``run`` look like it died right after saving the checkpoint of ``step``."""
    for folder in (run / "checkpoints").glob("step_*"):
        if int(folder.name.split("_")[1]) > step:
            shutil.rmtree(folder)
    (run / "summary.json").unlink()
    with open(run / "metrics.jsonl", "a") as fh:  # lines written after the checkpoint
        fh.write(json.dumps({"step": step + 1, "train_loss": 0.0}) + "\n")
        fh.write('{"step": ' + str(step + 2) + ', "train_lo')  # torn by a hard kill


def wait_until(condition: Callable[[], bool], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the run to get there")
        time.sleep(0.05)


def steps_logged(run: Path) -> int:
    """The last training step in the run's metrics.jsonl so far (0 before the first)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return max((r["step"] for r in lines if "train_loss" in r), default=0)


def stage_reports(run) -> list[dict]:
    return json.loads((run / "summary.json").read_text())["stages"]


def assert_close_runs(a, b) -> None:
    """The same losses and final weights within the rounding :data:`TOLERANCE` of the dtype
    that rounded the update (as the run's summary.json names it)."""
    rounding = json.loads((a / "summary.json").read_text()).get("muon_ns_dtype", "float32")
    loss_rtol, weight_atol = TOLERANCE[rounding]
    (train_a, val_a), (train_b, val_b) = losses(a), losses(b)
    assert train_a == pytest.approx(train_b, rel=loss_rtol)
    assert val_a == pytest.approx(val_b, rel=loss_rtol)
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        gap = (wa[name] - wb[name]).abs().max().item()
        assert gap <= weight_atol, f"{name} differs by {gap}"


def make_run(
    root: Path,
    final: float,
    finished: bool = True,
    name_as: str | None = None,
    drift: tuple[list, list] | None = None,
    **settings,
) -> Path:
    """A run folder as training writes it: the loss falls linearly to ``final`` over 100 s;
    ``drift``: the per-stage weight drift of its evaluations at steps 50 and 100."""
    cfg = TrainConfig(**{"steps": 100, **settings})
    folder = root / (name_as or "-".join(f"{k}={v}" for k, v in sorted(settings.items())))
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(cfg.to_json())
    evals = [(0, 5.0, 0.0), (50, final + 1.0, 50.0), (100, final, 100.0)]
    lines = [
        {"step": s, "val_loss": loss, "val_bpb": loss * 1.5, "train_time_s": t}
        for s, loss, t in evals
    ]
    for line, stages in zip(lines[1:], drift or (), strict=False):
        line[DRIFT] = stages
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if finished:
        summary = {"final_val_loss": final, "final_val_bpb": final * 1.5, "train_s": 100.0}
        (folder / "summary.json").write_text(json.dumps(summary))
    return folder
