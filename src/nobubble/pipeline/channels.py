"""The kinds of message a pipeline sends (channels), and the tag each message carries."""

from __future__ import annotations

import enum


class Channel(enum.IntEnum):
    ACTIVATION = 0
    GRADIENT = 1
    STATS = 2
    EVAL_ACTIVATION = 3
    EVAL_SUMS = 4
    CONTROL = 5
    STOP_VOTE = 6
    CONNECT = 7  # the warm-up's first message on a stage edge (nobubble.pipeline.warmup)


def tag(channel: Channel, sequence: int, chunk: int = 0, chunks: int = 1) -> int:
    """The p2p tag: unique per channel, sequence and receiving chunk (of ``chunks``)."""
    return (sequence * chunks + chunk) * len(Channel) + int(channel)
