"""The files nobubble keeps (JSON records, JSON-lines logs): written atomically, and read knowing
that any of them may have been damaged since: cut short by a full disk or a hard kill,
overwritten with other bytes, replaced by a folder, or deleted. A damaged file is
:class:`DamagedFile`, one line naming the file, what is wrong with it and what to do; never a
traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from nobubble.config import ConfigError


class DamagedFile(ConfigError):
    """A file that cannot be read as what it should be; the message names it and the fix."""


def problem_reading(path: Path, exc: Exception) -> str:
    """What is wrong with ``path``, from the error reading or parsing it raised."""
    if isinstance(exc, FileNotFoundError):
        return "is missing"
    if isinstance(exc, IsADirectoryError):
        return "is a folder, not a file"
    if isinstance(exc, OSError):
        return f"cannot be read ({exc.strerror or exc})"
    if isinstance(exc, UnicodeDecodeError):
        return "is damaged (not UTF-8 text)"
    if isinstance(exc, json.JSONDecodeError):
        return f"is damaged (not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno})"
    return f"is damaged ({exc})"


def damaged(path: Path, problem: str, fix: str) -> DamagedFile:
    """The error for ``path`` with ``problem``; ``fix`` says what to do (may be empty)."""
    return DamagedFile(f"{path} {problem}" + (f"; {fix}" if fix else ""))


def read_json_object(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object ``path`` holds; :class:`DamagedFile` (with ``fix``, what to do) if it is
    missing, not a readable file, not UTF-8 JSON, or JSON of another type."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise damaged(path, problem_reading(path, exc), fix) from None
    if not isinstance(value, dict):
        kind = type(value).__name__
        raise damaged(path, f"is damaged (it holds a JSON {kind}, not an object)", fix)
    return value


def read_json_lines(path: Path, fix: str) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """The lines of a JSON-lines file that hold a JSON object, each as (its text, the object),
    and the number of other non-blank lines (damaged: cut short by a hard kill, or garbage),
    which are skipped. A missing file has no lines; one that cannot be read at all is
    :class:`DamagedFile` (with ``fix``)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return [], 0
    except OSError as exc:
        raise damaged(path, problem_reading(path, exc), fix) from None
    records, bad = [], 0
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
            record = json.loads(text)
        except ValueError:
            bad += 1
            continue
        if isinstance(record, dict):
            records.append((text, record))
        else:
            bad += 1
    return records, bad


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON to ``path`` so that readers see the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
