"""Which code produced a run or a measurement, recorded beside its results."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

import nobubble


def source_revision() -> str | None:
    """The git commit of the running nobubble source (``-dirty`` with local changes); None for
    an installed copy (not nobubble's own checkout, even inside some other repository), or
    without git."""
    package = Path(nobubble.__file__).resolve().parent
    checkout = package.parents[1]  # the src layout: CHECKOUT/src/nobubble
    if not (checkout / ".git").exists() or not (checkout / "pyproject.toml").is_file():
        return None
    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=checkout, capture_output=True, text=True
        )
    except OSError:  # no git
        return None
    return done.stdout.strip() or None


def provenance() -> dict[str, str | None]:
    """nobubble's source revision and torch's version."""
    return {"nobubble": source_revision(), "torch": torch.__version__}
