"""A new run folder: set up in a hidden folder next to its place and moved into place only once
the run is ready to start (:class:`NewRun`), so that a setup that fails, or is killed, leaves the
run folder as it was (absent, empty, or under ``--overwrite`` the old run). What a killed command
leaves beside a run folder is cleaned up or reported by the next command on it
(:func:`tidy_leftovers`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shlex
import shutil
import socket
import warnings
from pathlib import Path

from nobubble.config import ConfigError, NobubbleWarning, TrainConfig
from nobubble.destinations import check_output_folder
from nobubble.runfolder.folder import RunFolder, holds_files, run_path
from nobubble.runfolder.reading import is_run_folder


def _beside(full: Path, kind: str) -> Path:
    """A hidden folder next to ``full`` on the same file system, private to this process (its
    name says which process on which machine made it: :func:`tidy_leftovers`)."""
    return full.parent / f".{full.name}.{kind}-{socket.gethostname()}-{os.getpid()}"


def target_of(path: Path) -> Path:
    """The absolute path of the folder ``path`` names: where a symbolic link points, so that a
    run given ``--out LINK`` goes where the link points and the link stays."""
    full = Path(os.path.abspath(path))
    return Path(os.path.realpath(full)) if full.is_symlink() else full


def create_run(cfg: TrainConfig, overwrite: bool = False) -> RunFolder:
    """Make a new run folder at once (for callers with nothing to set up first)."""
    return NewRun(cfg, run_path(cfg), overwrite).commit()


class NewRun:
    """A new run being set up in a hidden folder beside ``path`` (``work``).

    Nothing at ``path`` changes until :meth:`commit` moves the set-up run there: into an absent or
    empty folder, or under ``overwrite`` in place of the old run (moved aside, then deleted).
    :meth:`discard` removes only what this setup made.
    """

    checkpoint: Path | None = None  # a new run starts from scratch

    def __init__(self, cfg: TrainConfig, path: Path, overwrite: bool = False) -> None:
        self.cfg, self.path, self.full = cfg, path, target_of(path)
        check_can_make(path, self.full)
        self.replaces = holds_files(self.full)
        if self.replaces and not overwrite:
            raise ConfigError(
                f"run folder {path} already holds files; choose another --out, continue it "
                f"with --resume {path}, or pass --overwrite to replace it"
            )
        if self.replaces and not is_run_folder(self.full):
            raise ConfigError(
                f"{path} holds files but is not a nobubble run folder (it has no config.json); "
                "--overwrite only replaces run folders: choose another --out"
            )
        self.made = [p for p in self.full.parents if not p.exists()]  # nearest first
        self.work = _beside(self.full, "new")
        try:
            self.full.parent.mkdir(parents=True, exist_ok=True)
            self.work.mkdir()
        except OSError as exc:
            self._remove_made()
            raise ConfigError(
                f"cannot make run folder {path}: no folder can be made in {self.full.parent} "
                f"({exc.strerror or exc}); choose another --out"
            ) from None
        self.committed = False

    def commit(self) -> RunFolder:
        """Move the set-up run to ``path``; a failure puts everything back as it was."""
        RunFolder(self.work).write_config(self.cfg)
        aside = _beside(self.full, "old")
        try:
            if self.replaces:
                os.rename(self.full, aside)
            try:
                os.rename(self.work, self.full)  # replaces an empty folder too
            except OSError:
                if self.replaces:
                    os.rename(aside, self.full)
                raise
        except OSError as exc:
            raise ConfigError(f"cannot move the new run into {self.path}: {exc}") from None
        self.committed = True
        if self.replaces:
            try:
                shutil.rmtree(aside)
            except OSError as exc:
                warnings.warn(
                    f"could not delete the replaced run {aside}: {exc}; delete it yourself "
                    f"(rm -r {shlex.quote(str(aside))})",
                    NobubbleWarning,
                    stacklevel=2,
                )
        tidy_leftovers(self.full)
        return RunFolder(self.path)

    def discard(self) -> None:
        """Remove the setup folder and the parent folders made for it (if still empty)."""
        if self.committed:
            return
        shutil.rmtree(self.work)
        self._remove_made()

    def _remove_made(self) -> None:
        for folder in self.made:
            with contextlib.suppress(OSError):
                folder.rmdir()


def check_can_make(path: Path, full: Path) -> None:
    """Refuse, before any work, a run folder that cannot be made at ``path`` (``full``).

    Also refuse while an ``--overwrite`` of ``path`` that was cut short between its two renames
    has left the old run aside: the user decides what to keep.
    """
    check_output_folder(path, "--out", whole=True, fix="choose another --out")
    moved_aside = f".{glob.escape(full.name)}.old-*"
    asides = [] if full.exists() else sorted(full.parent.glob(moved_aside))
    if asides:
        raise ConfigError(
            f"{path} is missing and {asides[0]} holds the run that an --overwrite was replacing "
            f"when it was cut short; put it back with `mv {shlex.quote(str(asides[0]))} "
            f"{shlex.quote(str(path))}` (or delete it), then run this command again"
        )


def _owner(name: str, prefix: str) -> tuple[str | None, int | None]:
    """(machine, process id) that made the folder ``name`` (``prefix`` + ``HOST-PID``); older
    versions wrote ``PID`` alone."""
    host, _, pid = name.removeprefix(prefix).rpartition("-")
    return host or None, int(pid) if pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _removed(folder: Path) -> bool:
    try:
        shutil.rmtree(folder)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def tidy_leftovers(full: Path) -> None:
    """Deal with what killed commands left beside the run folder ``full`` (which exists).

    A setup folder (``.NAME.new-HOST-PID``) whose process ran on this machine and has ended is
    provably nobody's: it is deleted. A setup folder of a live process is in use and left alone.
    Every other leftover gets a warning that names it and what to do: a setup folder of another
    machine (or an older nobubble), and a replaced run that ``--overwrite`` did not finish
    deleting (``.NAME.old-HOST-PID``; it may hold files of the user's, so it is never deleted).
    """
    here, me = socket.gethostname(), os.getpid()
    for kind in ("new", "old"):
        prefix = f".{full.name}.{kind}-"
        for entry in sorted(full.parent.glob(f"{glob.escape(prefix)}*")):
            host, pid = _owner(entry.name, prefix)
            local = host == here and pid is not None and pid > 0
            if local and (pid == me or _alive(pid)):
                continue  # this process's own, or another's in use
            quoted = shlex.quote(str(entry))
            made_by = f"process {pid} on {host}" if host else "an older nobubble"
            if kind == "new" and local and _removed(entry):
                continue
            if kind == "new":
                warnings.warn(
                    f"{entry} is the setup folder of a run of {full.name} that {made_by} was "
                    "setting up; it holds nothing of value: once that process has ended, delete "
                    f"it (rm -r {quoted})",
                    NobubbleWarning,
                    stacklevel=2,
                )
            else:
                warnings.warn(
                    f"{entry} holds a run of {full.name} that an --overwrite by {made_by} "
                    f"replaced but did not finish deleting; delete it (rm -r {quoted}) unless "
                    "you want to keep something in it",
                    NobubbleWarning,
                    stacklevel=2,
                )
