"""The run folder and its checkpoints."""

from __future__ import annotations

from dataclasses import dataclass

from nobubble.config.fields import FREE, NON_NEGATIVE, POSITIVE, setting


@dataclass
class CheckpointSettings:
    checkpoint_every: int = setting(
        0,
        "save a checkpoint every N steps (and always at the end)",
        NON_NEGATIVE,
        resume=FREE,
    )
    keep_checkpoints: int = setting(
        2, "how many of the newest checkpoints to keep", POSITIVE, resume=FREE
    )
    out: str | None = setting(None, "run folder (default runs/<name>-<time>)", resume=FREE)
    name: str | None = setting(None, "run name (default: derived from the settings)", resume=FREE)
