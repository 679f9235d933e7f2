"""How a command tells the error that ended it, and the exit status that goes with it.

One of the user's errors (a setting, the data, a checkpoint, a peer stage that failed: what the
user can act on) is one ``nobubble: error: ...`` line, status 2; an abort (a second Ctrl-C) is
``nobubble: interrupted``, 130; anything else (a bug) is shown as Python shows an uncaught
exception, its traceback, status 1.

The command line tells what reaches it (:mod:`nobubble.cli`). A pipeline rank tells its error
itself, before it aborts its process groups (:class:`nobubble.run.torchrun.TorchrunLauncher`),
and hands the command its status as :class:`Told`.
"""

from __future__ import annotations

import sys
import traceback

from nobubble.config import ConfigError


class Told(Exception):
    """An error already told (:func:`tell`); the command exits with ``code``."""

    def __init__(self, code: int) -> None:
        super().__init__(f"an error already told (exit status {code})")
        self.code = code


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors told in one line (imported here: the command line starts without torch)."""
    from nobubble.checkpoint.files import CheckpointError
    from nobubble.data import DataError
    from nobubble.pipeline.comm import PeerFailure
    from nobubble.run.errors import TrainingError
    from nobubble.runfolder.folder import RunWriteError
    from nobubble.schedules import ScheduleError

    return (
        ConfigError,
        DataError,
        TrainingError,
        CheckpointError,
        ScheduleError,
        PeerFailure,
        RunWriteError,
    )


def tell(error: BaseException) -> int:
    """Print ``error`` on standard error as the module's docstring says; its exit status."""
    if isinstance(error, user_errors()):
        print(f"nobubble: error: {error}", file=sys.stderr, flush=True)
        return 2
    if isinstance(error, KeyboardInterrupt):
        print("nobubble: interrupted", file=sys.stderr, flush=True)
        return 130
    traceback.print_exception(error)
    sys.stderr.flush()
    return 1
