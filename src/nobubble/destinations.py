"""Output paths checked before the work that fills them, so that a typo costs a line, not a run.

Each check raises :class:`~nobubble.config.ConfigError` naming the flag, the path and what is
wrong with it (the command line prints it as one line).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from nobubble.config import ConfigError


def _probe(folder: Path, what: str) -> None:
    """Write (and remove) a file in ``folder``: the only test that root and ACLs cannot fool."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(f"{what}: cannot write in {folder} ({exc.strerror})") from None


def check_output_file(path: str | Path, flag: str) -> None:
    """``path`` can be written: its folder exists and takes files, and it is not a folder."""
    path = Path(path)
    what = f"{flag} {path}"
    folder = path.parent
    if not folder.is_dir():
        state = "is not a folder" if folder.exists() else "does not exist"
        raise ConfigError(f"{what}: folder {folder} {state}; create it or choose another path")
    if path.is_dir():
        raise ConfigError(f"{what}: is a folder; give a file name")
    _probe(folder, what)


def make_output_folder(path: str | Path, flag: str) -> Path:
    """Create ``path`` with its parents if need be, and check that it takes files."""
    path = Path(path)
    what = f"{flag} {path}"
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"{what}: {blocker} is not a folder; choose another path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot create it ({exc.strerror})") from None
    _probe(path, what)
    return path
