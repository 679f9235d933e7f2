"""Whether each step runs: the leader's go-ahead, and the other ranks' stop votes.

Before its first action of a step, every rank learns from the leader (stage 0 of replica 0;
under tensor parallelism each tp index has its own, :attr:`ParallelLayout.controller`) whether
the step runs (a first stage is the first to touch any step, so nobody waits long for
that answer). If it does not, every rank drops the actions of that and later steps: what remains
is exactly the schedule of the shorter run, cool-down included. A stop requested on another rank
reaches the leader as that rank's vote.

Votes and go-aheads are CPU tensors, read on the CPU: they travel over the control plane's gloo
group (:class:`~nobubble.pipeline.links.Links`), so reading them never waits for a device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nobubble.layout import ParallelLayout
from nobubble.pipeline.channels import Channel
from nobubble.pipeline.comm import HOST, Messenger, PendingRecv


class StepControl:
    """The go-ahead of every step of this process, over every segment of its run. ``delay``:
    how far (in steps, less one) the leader can run ahead of the last stage."""

    def __init__(self, layout: ParallelLayout, messenger: Messenger, delay: int) -> None:
        self.layout, self.messenger, self.delay = layout, messenger, delay
        self.votes: dict[int, list[PendingRecv]] = {}  # leader: the other ranks' stop votes
        self.peer_stop = False  # leader: a rank asked to stop in the last steps of a segment
        self.others = [
            layout.coordinates(rank) for rank in layout.peers() if rank != layout.controller
        ]

    def clear(self, step: int, should_stop: Callable[[], bool]) -> bool:
        """Whether ``step`` runs: the leader decides and tells every other rank.

        Every other rank first sends the leader its vote: whether a stop was requested there (a
        signal may reach only some processes, e.g. one node of a multi-node job). The leader
        reads the votes of step ``step - (delay + 1)``, its own delay + 1 being how far it can
        run ahead of the last stage; in a running pipeline every rank of its replica has voted on
        that step by then, and the replicas of the first stage, tied to the leader by their
        all-reduce, at most a step's all-reduce later. A stop asked for on another rank thus
        takes effect at most ``delay + 1`` steps later than on the leader.
        """
        if self.layout.rank == self.layout.controller:
            return self._lead(step, should_stop)
        vote = torch.tensor([1.0 if should_stop() else 0.0])
        self.messenger.send(vote, 0, Channel.STOP_VOTE, step, replica=0)
        go = self.messenger.recv(
            (1,),
            torch.float32,
            HOST,
            0,
            Channel.CONTROL,
            step,
            f"the go-ahead for step {step}",
            replica=0,
        )
        return bool(go.item())

    def _lead(self, step: int, should_stop: Callable[[], bool]) -> bool:
        """The leader's decision on ``step``, sent to every other rank, whose votes on it it
        posts the receives of."""
        go = not (should_stop() or self.peer_stop or self.stop_voted(step - self.delay - 1))
        self.peer_stop = False
        self.votes[step] = [
            self.messenger.post_recv(
                (1,),
                torch.float32,
                HOST,
                stage,
                Channel.STOP_VOTE,
                step,
                f"the stop vote for step {step}",
                replica=replica,
            )
            for stage, replica in self.others
        ]
        flag = torch.tensor([1.0 if go else 0.0])
        for stage, replica in self.others:
            self.messenger.send(flag, stage, Channel.CONTROL, step, replica=replica)
        return go

    def stop_voted(self, step: int) -> bool:
        """The leader: whether any other rank asked to stop when it cleared ``step``."""
        votes = [self.messenger.wait(vote).item() for vote in self.votes.pop(step, [])]
        return any(vote > 0 for vote in votes)  # every receive waited for, not just the first

    def count_remaining_votes(self) -> None:
        """The leader, at the end of a segment: read the votes not read yet, keep a stop for
        later."""
        for step in sorted(self.votes):
            self.peer_stop |= self.stop_voted(step)
