"""A run records which code and which machine produced it."""

import json
import os
import subprocess
from pathlib import Path

import torch

import nobubble
from nobubble.cli import main
from nobubble.provenance import machine, provenance
from tests.helpers.pipeline import SMALL


def test_provenance_names_this_checkout_s_commit_and_torch():
    checkout = Path(nobubble.__file__).resolve().parents[2]  # CHECKOUT/src/nobubble/__init__.py
    found = provenance()
    assert found["torch"] == torch.__version__
    if not (checkout / ".git").exists():  # an installed copy: nothing to name
        assert found["nobubble"] is None
        return
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True
    ).stdout.strip()
    assert found["nobubble"].removesuffix("-dirty").startswith(head[:7])


def test_a_run_records_the_machine_it_ran_on(tmp_path):
    """The CPU, its cores, the vector instructions torch's kernels use on it, and the GPU: what
    the report compares before setting one run's loss against another's."""
    found = machine()
    assert found["cpus"] == os.cpu_count() and found["cpu"]
    assert found["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert found["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    out = tmp_path / "run"
    assert main(["train", "--no-progress", "--out", str(out), *SMALL, "steps=1"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["machine"] == found and summary["code"] == provenance()


def test_a_run_records_the_code_it_started_with(tmp_path, monkeypatch):
    """A checkout that moves on while a run trains (a commit, a merge) does not change what the
    run's summary says trained it: the revision is read when the run starts."""
    out = tmp_path / "run"

    def revision() -> str:  # the checkout moves on once the run has trained a step
        metrics = out / "metrics.jsonl"
        return "moved-on" if metrics.exists() and metrics.read_text() else "started-with"

    monkeypatch.setattr("nobubble.provenance.source_revision", revision)
    assert main(["train", "--no-progress", "--out", str(out), *SMALL, "steps=2"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["code"]["nobubble"] == "started-with"
