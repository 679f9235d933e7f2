"""How a fault is done: to a launch's processes (found through /proc), to a run folder (writes
stopped, a file system filled), to a checkpoint file (damaged).

:func:`stop_writes` is also how the tests simulate a read-only folder (``lock_writes`` in
tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from nobubble.children import descendants

Undo = Callable[[], None]


def workers(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the torchrun workers started by ``launcher_pid`` (their RANK)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid != launcher_pid:
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(proc.name)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL of ``pid`` and every process below it, whatever their sessions."""
    for process, _ in descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(process, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def takes_writes(path: Path) -> bool:
    """Whether a new file can be made in the folder ``path``, or the file ``path`` opened for
    writing (creating nothing, changing nothing)."""
    try:
        if path.is_dir():
            with tempfile.TemporaryFile(dir=path):
                return True
        with path.open("ab"):
            return True
    except OSError:
        return False


def stop_writes(path: Path) -> Undo | None:
    """Make the folder ``path`` take no new files, or the file ``path`` no writes (an open one
    too, as root), as on a read-only file system; returns what undoes it, or None (and changes
    nothing) where nothing here stops a write.

    Done by removing write permission; as root, who writes anyway, by making it immutable
    (``chattr +i``, which stops root too and the files a process already has open).
    """
    mode = path.stat().st_mode
    path.chmod(0o500 if path.is_dir() else 0o400)
    undo: list[Undo] = [lambda: path.chmod(mode)]

    def undo_all() -> None:
        for step in reversed(undo):
            step()

    def writable() -> None:
        subprocess.run(["chattr", "-i", path], check=True)

    if takes_writes(path):
        try:
            subprocess.run(["chattr", "+i", path], check=True, capture_output=True)
            undo.append(writable)
        except (OSError, subprocess.CalledProcessError):
            pass
    if takes_writes(path):
        undo_all()
        return None
    return undo_all


def stop_writes_below(root: Path) -> Undo | None:
    """:func:`stop_writes` for the folder ``root`` and everything in it, each folder before it
    is listed (so nothing new appears in one after); None (and nothing changed) where the root
    cannot be stopped."""
    undone: list[Undo] = []

    def undo_all() -> None:
        for step in reversed(undone):
            step()

    def stop(path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile
            step = stop_writes(path)
            if step is not None:
                undone.append(step)
            if path.is_dir() and not path.is_symlink():
                for inside in sorted(path.iterdir()):
                    stop(inside)

    first = stop_writes(root)
    if first is None:
        return None
    undone.append(first)
    for inside in sorted(root.iterdir()):
        stop(inside)
    return undo_all


@contextlib.contextmanager
def small_disk(folder: Path, size_mb: int = 64) -> Iterator[Path]:
    """A file system of its own (a tmpfs of ``size_mb``) mounted on ``folder`` (made if
    needed) within the block, unmounted after; root only (``mount`` fails otherwise:
    :class:`subprocess.CalledProcessError`)."""
    folder.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(folder)]
    subprocess.run(mount, check=True, capture_output=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True, capture_output=True)


def small_disks_here(probe: Path) -> str | None:
    """Why :func:`small_disk` cannot be used here (None: it can), tried on ``probe``, a
    folder that does not exist yet (removed after)."""
    try:
        with small_disk(probe, 1):
            pass
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        return f"cannot mount a tmpfs ({detail.decode(errors='replace').strip() or exc})"
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
    return None


def fill(folder: Path) -> Path:
    """Fill the file system of ``folder`` to the last byte with one file, returned (deleting it
    frees the space)."""
    filler = folder / ".filler"
    with filler.open("wb", buffering=0) as fh:
        for chunk in (1 << 20, 1 << 12, 1):  # to the last MiB, page, byte
            try:
                while True:
                    fh.write(b"\0" * chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    return filler


def damage(path: Path, how: str) -> None:
    """``flip`` one byte in the middle of ``path``, or ``truncate`` it to half its length."""
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
        return
    middle = len(data) // 2
    data[middle] ^= 0xFF
    path.write_bytes(bytes(data))
