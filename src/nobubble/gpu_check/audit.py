"""The audit of synchronizations: ``nobubble train`` with every action of one step run under
``torch.cuda.set_sync_debug_mode("warn")``, each synchronization found written down by action
and line (``OUT/audit/rank_R.json``), and the audit's verdict from those files."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from nobubble.json_files import write_json_atomic
from nobubble.pipeline.runtime import ActionRunner
from nobubble.schedules import Action

SYNC_WARNING = "called a synchronizing CUDA operation"  # set_sync_debug_mode("warn")'s words
AUDIT_STEP = 1  # the step traced (the second: the first allocates, connects and compiles)


def audited(
    execute: Callable[[Any, Action], None],
    found: list[dict[str, Any]],
    debug_mode: Callable[[str], None],
) -> Callable[[Any, Action], None]:
    """``execute`` (the runtime's run of one action) that, for the actions of step
    :data:`AUDIT_STEP`, turns ``debug_mode`` to warn and adds each synchronization warned of to
    ``found``, with the action and the line that synchronized."""

    def run(segment: Any, action: Action) -> None:
        if action.step != AUDIT_STEP:
            execute(segment, action)
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            debug_mode("warn")
            try:
                execute(segment, action)
            finally:
                debug_mode("default")
        found.append({"action": str(action), "syncs": []})
        for warning in caught:
            if SYNC_WARNING in str(warning.message):
                where = f"{warning.filename}:{warning.lineno}"
                found[-1]["syncs"].append(where)

    return run


def audit_main(folder: Path, train: list[str], command_line: Callable[[Sequence[str]], int]) -> int:
    """``command_line(train)`` (the ``nobubble train`` of the audited row) with every action of
    step :data:`AUDIT_STEP` audited (:func:`audited`); what this process found goes into
    ``folder/rank_R.json``."""
    found: list[dict[str, Any]] = []
    ActionRunner.execute = audited(ActionRunner.execute, found, torch.cuda.set_sync_debug_mode)
    try:
        return command_line(train)
    finally:
        folder.mkdir(parents=True, exist_ok=True)
        rank = os.environ.get("RANK", "0")
        write_json_atomic(folder / f"rank_{rank}.json", {"rank": int(rank), "actions": found})


def audit_verdict(folder: Path) -> str:
    """``no sync in actions``; ``SYNCS`` (some action synchronized: ``folder``'s files say
    which, where); ``failed`` (no process audited an action)."""
    actions = [
        action
        for path in sorted(folder.glob("rank_*.json"))
        for action in json.loads(path.read_text())["actions"]
    ]
    if not actions:
        return "failed"
    return "SYNCS" if any(action["syncs"] for action in actions) else "no sync in actions"
