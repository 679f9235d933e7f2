import dataclasses
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

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
    read-only file system.

    Simulated by removing its write permission; as root, who writes there anyway, by making it
    immutable (``chattr +i``, which stops root too). Skipped where neither stops a write.
    """
    undo: list[Callable[[], object]] = []

    def takes_files(folder: Path) -> bool:
        try:
            with tempfile.TemporaryFile(dir=folder):
                return True
        except OSError:
            return False

    def lock(folder: Path) -> Path:
        mode = folder.stat().st_mode
        folder.chmod(0o500)
        undo.append(lambda: folder.chmod(mode))
        if takes_files(folder):
            try:
                subprocess.run(["chattr", "+i", folder], check=True, capture_output=True)
            except (OSError, subprocess.CalledProcessError):
                pytest.skip("no way to stop writes here (root, and no chattr +i)")
            undo.append(lambda: subprocess.run(["chattr", "-i", folder], check=True))
        if takes_files(folder):
            pytest.skip("no way to stop writes here")
        return folder

    yield lock
    for step in reversed(undo):
        step()


@pytest.fixture
def unwritable(tmp_path, lock_writes) -> Path:
    """An empty folder that takes no new files (:func:`lock_writes`)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    return lock_writes(folder)
