"""Which code and which machine produced a run or a measurement, recorded beside its results."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

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


def machine() -> dict[str, Any]:
    """The hardware, as far as a result's float rounding depends on it: the CPU's model and
    cores, the vector instructions torch's CPU kernels use, and the GPU (None without one)."""
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        models = [
            line.split(":", 1)[1].strip()
            for line in cpuinfo.read_text().splitlines()
            if line.startswith("model name")
        ]
        cpu = models[0] if models else cpu
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def machine_in_words(record: dict[str, Any]) -> str:
    """A :func:`machine` record as one phrase: "GPU on CPU (N CPUs KERNELS)"."""
    host = f"{record.get('cpu')} ({record.get('cpus')} CPUs {record.get('cpu_capability')})"
    return f"{record['gpu']} on {host}" if record.get("gpu") else host
