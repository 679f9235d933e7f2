import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nobubble.faults.inject import stop_writes
from nobubble.model.presets import PRESETS, ModelConfig


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
