"""Where a command writes, checked before any work: one rule for every output path.

A destination is refused with a :class:`~nobubble.config.ConfigError` of one line that names the
flag, the path, the problem and the fix (the command line prints it and exits 2) when

- it holds a NUL character, a part of it is a file (``notes.txt/report``), or a name in it that
  does not exist yet is longer than its file system takes;
- it exists as the other kind: a file where a folder goes, a folder where a file goes; a file
  must go into a folder that exists;
- the folder it would be made in takes no new file: a read-only file system, a folder without
  write permission, /proc. Probed by creating an unnamed file there and closing it (which
  removes it): the one test that root, ACLs and read-only mounts cannot fool.

The checks create nothing and leave everything that is there as it was. Symbolic links are
followed: a link is checked where it points.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from nobubble.config import ConfigError

CHOOSE = "choose another path"


def _nearest(path: str | Path, what: str, fix: str) -> tuple[Path, Path]:
    """(``path`` resolved, the nearest of it and its parents that exists), refusing a path with
    a NUL, and a name that does not exist yet and is too long for the file system."""
    if "\0" in str(path):
        raise ConfigError(f"{what!r}: holds a NUL character; {fix}")
    full = Path(os.path.realpath(path))
    missing = []
    existing = full
    while not os.path.exists(existing):  # os.path: a name too long is missing, no error
        missing.append(existing.name)
        existing = existing.parent
    try:
        longest = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):  # the file system does not say
        return full, existing
    for name in missing:
        if len(os.fsencode(name)) > longest:
            raise ConfigError(
                f"{what}: the name {name[:16]}... is longer than {longest} bytes, the most "
                f"{existing} takes; {fix}"
            )
    return full, existing


def _probe(folder: Path, what: str, fix: str) -> None:
    """Refuse ``folder`` unless a new file can be made in it."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        reason = "it takes no new files" if exc.errno == errno.ENOENT else exc.strerror
        raise ConfigError(f"{what}: cannot write in {folder} ({reason}); {fix}") from None


def check_output_folder(
    path: str | Path, flag: str, *, whole: bool = False, fix: str = CHOOSE
) -> None:
    """``path`` is, or can be made, a folder that takes files; nothing is created.

    ``whole``: the folder is made beside ``path`` and renamed into place (a run folder, an
    export), so its parent must take new entries even where ``path`` exists.
    """
    what = f"{flag} {path}"
    full, existing = _nearest(path, what, fix)
    if not existing.is_dir():
        raise ConfigError(f"{what}: {existing} is not a folder; {fix}")
    _probe(full.parent if whole and existing == full else existing, what, fix)


def make_output_folder(path: str | Path, flag: str) -> Path:
    """Check ``path`` (:func:`check_output_folder`), then create it with its parents."""
    check_output_folder(path, flag)
    try:
        Path(os.path.realpath(path)).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot create it ({exc.strerror}); {CHOOSE}") from None
    return Path(path)


def check_output_file(path: str | Path, flag: str) -> None:
    """``path`` can be written as a file: it is no folder, and its folder exists and takes new
    files; nothing is created."""
    what = f"{flag} {path}"
    full, existing = _nearest(path, what, CHOOSE)
    if existing == full:
        if full.is_dir():
            raise ConfigError(f"{what}: is a folder; give a file name")
        existing = full.parent
    if not existing.is_dir():
        raise ConfigError(f"{what}: {existing} is not a folder; {CHOOSE}")
    if existing != full.parent:
        raise ConfigError(f"{what}: folder {full.parent} does not exist; create it or {CHOOSE}")
    _probe(existing, what, CHOOSE)
