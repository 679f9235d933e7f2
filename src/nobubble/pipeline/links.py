"""The links of a pipeline: which process group carries each message (the ``p2p_routes``
setting), so that no backend can deadlock on order.

gloo matches a receive to the send with the same peer and tag, in any order; the runtime relies
on that to post receives ahead of need (``RECV_AHEAD``) and send as soon as data is ready. NCCL
ignores tags: between two ranks of one group it pairs the n-th send with the n-th receive, and
runs the pair's operations one after another on one stream in the order each side posted them.
On one shared group, 1F1B on two stages would then hang: stage 0 posts "receive gradient 0"
before "send activation 1", stage 1 posts "receive activation 1" before "send gradient 0".

So with ``per-edge`` routes (the default on NCCL) every data channel (activations, gradients,
evaluation activations) of every pair of neighbouring model stages of a replica gets its own
two-rank group: each carries messages one way, from one stage to one stage, and both stages post
them in microbatch order (checked on every schedule: ``nobubble.schedules.invariants``), so the
n-th send always meets the n-th receive. The small control messages (step statistics, the
leader's go-ahead, stop votes, evaluation sums) go over a gloo group as CPU tensors, where tags
hold; their values are read on the CPU anyway. ``shared`` routes (the default on gloo) send
everything over the default group, as gloo allows; ``per-edge`` on gloo runs the NCCL links on
a CPU machine (its tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from nobubble.config import ConfigError
from nobubble.layout import ParallelLayout
from nobubble.pipeline.channels import Channel

DATA_CHANNELS = (Channel.ACTIVATION, Channel.GRADIENT, Channel.EVAL_ACTIVATION)


def resolve_links(choice: str, backend: str) -> str:
    """The config's ``p2p_routes`` on ``backend``: ``auto`` is per-edge on backends that ignore
    tags (NCCL) and shared on gloo; shared on another backend than gloo is refused."""
    if choice == "auto":
        return "shared" if backend == "gloo" else "per-edge"
    if choice == "shared" and backend != "gloo":
        raise ConfigError(
            f"p2p_routes=shared sends every message over one group, which needs a backend that "
            f"pairs messages by tag (gloo); {backend} pairs them in posting order and would hang "
            "the pipeline. Use p2p_routes=per-edge (or auto)"
        )
    return choice


@dataclass
class Links:
    """The group of every (data channel, receiving stage, replica) (the channel says which
    neighbour sends: the stage before, or after for gradients), and the control plane's group.

    ``None`` stands for the default group; a ``control`` group of its own is gloo beside a
    default group that is not, so control messages on it travel as CPU tensors.
    """

    edges: dict[tuple[Channel, int, int], dist.ProcessGroup | None] = field(default_factory=dict)
    control: dist.ProcessGroup | None = None

    @classmethod
    def build(cls, layout: ParallelLayout, kind: str) -> Links:
        """The routes of ``kind`` (shared or per-edge; see :func:`resolve_links`). Every rank
        must call it at the same point: torch requires every process to create every group, in
        the same order."""
        if kind == "shared":
            return cls()
        routes = cls()
        for replica in range(layout.dp):
            for stage in range(layout.model_stages - 1):
                ranks = sorted({layout.rank_of(stage, replica), layout.rank_of(stage + 1, replica)})
                for channel in DATA_CHANNELS:
                    # a two-rank group per channel and edge (neighbours on one process need none)
                    group = dist.new_group(ranks) if len(ranks) == 2 else None
                    receiver = stage if channel is Channel.GRADIENT else stage + 1
                    routes.edges[(channel, receiver, replica)] = group
        if dist.get_backend() != "gloo":
            routes.control = dist.new_group(backend="gloo")
        return routes

    def group(self, channel: Channel, receiver: int, replica: int) -> dist.ProcessGroup | None:
        """The group of a message on ``channel`` to model stage ``receiver`` of ``replica``."""
        if channel not in DATA_CHANNELS:
            return self.control
        return self.edges[(channel, receiver, replica)] if self.edges else None

    def on_cpu(self, channel: Channel) -> bool:
        """Whether messages on ``channel`` travel as CPU tensors."""
        return self.control is not None and channel not in DATA_CHANNELS
