import dataclasses
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nobubble.faults.inject import stop_writes
from nobubble.model.presets import PRESETS, ModelConfig
from tests.helpers.pipeline import SMALL, env, train_command


@pytest.fixture
def tiny_mc() -> ModelConfig:
    """A very small model config with a resolved vocabulary (fast on CPU)."""
    return dataclasses.replace(
        PRESETS["tiny"],
        d_model=32,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=64,
        vocab_size=64,
    )


@pytest.fixture
def lock_writes() -> Iterator[Callable[[Path], Path]]:
    """``lock_writes(folder)``: the folder takes no new files until the test ends, as on a
    read-only file system (:func:`nobubble.faults.inject.stop_writes`: its write permission
    removed, or as root ``chattr +i``). Skipped where neither stops a write."""
    undo: list[Callable[[], None]] = []

    def lock(folder: Path) -> Path:
        release = stop_writes(folder)
        if release is None:
            pytest.skip("no way to stop writes here (root, and no chattr +i)")
        undo.append(release)
        return folder

    yield lock
    for release in reversed(undo):
        release()


@pytest.fixture
def unwritable(tmp_path, lock_writes) -> Path:
    """An empty folder that takes no new files (:func:`lock_writes`)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    return lock_writes(folder)


@pytest.fixture
def in_background() -> Iterator[Callable[..., subprocess.Popen]]:
    """``in_background(out, *args, stages=0, torchrun_args=())``: start ``nobubble train`` with
    the small settings into ``out`` and return at once, in a process group of its own (output
    merged on stdout); whatever is still running when the test ends is killed."""
    launched: list[subprocess.Popen] = []

    def start(
        out: Path, *args: str, stages: int = 0, torchrun_args: tuple[str, ...] = ()
    ) -> subprocess.Popen:
        command = train_command(
            "--out", str(out), *SMALL, *args, stages=stages, torchrun_args=torchrun_args
        )
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env(),
            start_new_session=True,
        )
        launched.append(proc)
        return proc

    yield start
    for proc in launched:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
