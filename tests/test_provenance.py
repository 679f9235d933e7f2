"""A run records which code produced it."""

import subprocess
from pathlib import Path

import torch

import nobubble
from nobubble.provenance import provenance


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
