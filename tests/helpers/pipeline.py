"""Running nobubble as a user would (CLI, torchrun) and reading what the runs wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nobubble.checkpoint.files import newest_weights
from nobubble.staleness import DRIFT
from tests.helpers.launcher import run_nobubble

# A model and data small enough for 4 processes on 2 cores, big enough to have 4 blocks.
SMALL = [
    "d_model=32",
    "n_layers=4",
    "n_heads=4",
    "n_kv_heads=2",
    "d_ff=64",
    "seq_len=32",
    "batch_size=8",
    "eval_batches=1",
    "threads=1",
    "lr=3e-3",
    "warmup_steps=2",
]
# 4 experts of width 32, 2 per token and a shared one, on blocks 1-3 (block 0 stays dense),
# bias balancing on and fast enough to change the routing within a few steps
MOE = [
    "moe_experts=4",
    "moe_top_k=2",
    "moe_d_ff=32",
    "moe_shared_experts=1",
    "moe_layers=[1, 2, 3]",
    "moe_bias_rate=0.01",
]
# A case that repeats a path another case of `make test` already runs (another optimizer, another
# schedule of the same family): `make test` leaves it out, `make test-all` runs it.
EXTENDED = pytest.mark.extended

# NOBUBBLE_TEST_DEVICE=cuda (or cpu) pins the device of every run that uses these settings;
# unset, runs use device=auto (a GPU where one is visible). scripts/gpu_check.sh sets it to cuda
# so that a missing GPU fails instead of falling back to the CPU.
if os.environ.get("NOBUBBLE_TEST_DEVICE"):
    SMALL.append(f"device={os.environ['NOBUBBLE_TEST_DEVICE']}")


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def train_command(*args: str, stages: int = 0, torchrun_args: tuple[str, ...] = ()) -> list[str]:
    """``nobubble train ARGS`` in one process, or under torchrun with ``stages`` processes."""
    launcher = [sys.executable, "-m", "nobubble"]
    if stages:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launcher = [*torchrun, f"--nproc-per-node={stages}", *torchrun_args, *launcher[1:]]
    return [*launcher, "train", "--no-progress", *args]


def nobubble(out: Path, *args: str, stages: int = 0, timeout: int = 300, check: bool = True):
    """Train into ``out`` with the small settings, wait, and return the finished process (see
    :func:`run_train` for how it is started)."""
    result = run_train("--out", str(out), *SMALL, *args, stages=stages, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(result.args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def run_train(*args: str, stages: int = 0, timeout: int = 300) -> subprocess.CompletedProcess:
    """``nobubble train ARGS``, finished: one process, or ``stages`` with torchrun's environment,
    forked from the tests' preloaded server (:mod:`tests.helpers.launcher`). The tests of
    torchrun itself launch it with :func:`train_command`."""
    return run_nobubble(["train", "--no-progress", *args], stages, timeout, env())


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> tuple[list[float], list[float]]:
    rows = metrics(run)
    return [r["train_loss"] for r in rows if "train_loss" in r], [
        r["val_loss"] for r in rows if "val_loss" in r
    ]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    newest = sorted((run / "checkpoints").glob("step_*"))[-1]
    return newest_weights(newest)


def snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every path under ``root``: its modification time and, for a file, its contents."""
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def drifts(run: Path) -> list[tuple[int, list[float | None]]]:
    """Each evaluation's weight drift per model stage (nobubble.staleness)."""
    return [(r["step"], r[DRIFT]) for r in metrics(run) if DRIFT in r]


def assert_same_drift(a: Path, b: Path) -> None:
    """The same weight drift at every evaluation both runs measured over the same number of
    model stages (a run resumed on another stage split measured its first part per stage of its
    first split)."""
    assert [step for step, _ in drifts(a)] == [step for step, _ in drifts(b)]
    for (step, first), (_, second) in zip(drifts(a), drifts(b), strict=True):
        if len(first) == len(second):
            assert first == second, f"the weight drift of step {step}"


def assert_same_run(a: Path, b: Path) -> None:
    """Same loss trajectory, weight drift and final weights, bit for bit."""
    assert losses(a) == losses(b)
    assert_same_drift(a, b)
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        gap = (wa[name] - wb[name]).abs().max()
        assert torch.equal(wa[name], wb[name]), f"{name} differs by {gap}"
