"""One writer at a time: an advisory lock (``flock``) on a file in a folder nobubble works in, or
on the folder itself, held for as long as the process keeps it open, and released by the kernel
when the process ends however it ends (no stale lock after a crash or a kill)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import IO

from nobubble.config import ConfigError


class FolderBusy(ConfigError):
    """Another process holds the lock."""


def hold(lock_file: Path, what: str, fix: str) -> IO[str]:
    """Take the lock on ``lock_file`` (created if need be) without waiting, or raise
    :class:`FolderBusy` naming ``what``, the holder's pid and ``fix``. Keep the returned file
    open while working; closing it (or exiting) releases the lock."""
    handle = open(lock_file, "a+")  # noqa: SIM115 (the lock lives as long as the file is open)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise FolderBusy(f"{what} is in use by another process (pid {holder}): {fix}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def hold_folder(folder: Path, what: str, fix: str) -> int:
    """Take the lock on the folder ``folder`` itself without waiting, or raise
    :class:`FolderBusy` naming ``what`` and ``fix``; return the descriptor that holds it (close
    it to release). It leaves no file behind, and the lock follows the folder when it is renamed.
    """
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FolderBusy(f"{what} is in use by another process: {fix}") from None
    return fd


def hold_run_folder(folder: Path, held: contextlib.ExitStack, shown: Path) -> None:
    """Lock ``folder`` (the run folder ``shown``, or the setup folder that becomes it) until
    ``held`` closes, or raise :class:`FolderBusy`."""
    fd = hold_folder(
        folder,
        f"run folder {shown}",
        "another `nobubble train` is training in it or setting it up; wait for it to end (or "
        "stop it: it saves a checkpoint), or choose another --out",
    )
    held.callback(os.close, fd)
