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
a CPU machine (its tests). Under ``emulate_nccl=true`` gloo pairs and orders messages as NCCL
does (:mod:`nobubble.pipeline.emulated_nccl`): the routes are NCCL's, and ``shared`` routes
hang there as they would on NCCL (the emulator's negative control).

gloo sends point to point from host memory only, so on gloo with CUDA tensors every message
travels as a CPU tensor (``host``); its all-reduces take CUDA tensors.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.distributed as dist

from nobubble.config import ConfigError
from nobubble.layout import ParallelLayout
from nobubble.pipeline.channels import Channel
from nobubble.pipeline.transport import active

DATA_CHANNELS = (Channel.ACTIVATION, Channel.GRADIENT, Channel.EVAL_ACTIVATION)


def resolve_links(choice: str, backend: str, emulated: bool = False) -> str:
    """The config's ``p2p_routes`` on ``backend`` (``emulated``: gloo under ``emulate_nccl``):
    ``auto`` is per-edge where messages pair in posting order (NCCL, the emulator) and shared on
    gloo; shared on another backend than gloo is refused (under the emulator it is allowed, to
    show the hang NCCL would have)."""
    if choice == "auto":
        return "shared" if backend == "gloo" and not emulated else "per-edge"
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
    host: bool = False  # every message as a CPU tensor (gloo, whatever the device)

    @classmethod
    def build(cls, layout: ParallelLayout, kind: str) -> Links:
        """The routes of ``kind`` (shared or per-edge; see :func:`resolve_links`) on this
        process's transport. Every rank must call it at the same point: torch requires every
        process to create every group, in the same order."""
        transport = active()
        routes = cls(host=transport.host_messages)
        if kind == "shared":
            return routes
        # every rank creates every group (torch's rule) and keeps those of its own tp index
        for replica, tp_rank in itertools.product(range(layout.dp), range(layout.tp)):
            for stage in range(layout.model_stages - 1):
                ends = (stage, replica, tp_rank), (stage + 1, replica, tp_rank)
                ranks = sorted({layout.rank_of(*end) for end in ends})
                for channel in DATA_CHANNELS:
                    # a two-rank group per channel and edge (neighbours on one process need none)
                    name = f"{channel.name.lower()} {stage}->{stage + 1} of replica {replica}"
                    name += f" at tp index {tp_rank}" if layout.tp > 1 else ""
                    group = transport.new_group(ranks, name) if len(ranks) == 2 else None
                    receiver = stage if channel is Channel.GRADIENT else stage + 1
                    if tp_rank == layout.tp_rank:
                        routes.edges[(channel, receiver, replica)] = group
        if not transport.pairs_by_tag:
            routes.control = transport.control_group()
        return routes

    def group(self, channel: Channel, receiver: int, replica: int) -> dist.ProcessGroup | None:
        """The group of a message on ``channel`` to model stage ``receiver`` of ``replica``."""
        if channel not in DATA_CHANNELS:
            return self.control
        return self.edges[(channel, receiver, replica)] if self.edges else None

    def on_cpu(self, channel: Channel) -> bool:
        """Whether messages on ``channel`` travel as CPU tensors."""
        return self.host or (self.control is not None and channel not in DATA_CHANNELS)

    def hang_hint(self) -> str:
        """What to try when a wait gives up where messages pair in posting order (under the
        emulator; per-edge routes there have a control group, shared ones do not)."""
        if self.control is not None or not active().emulated:
            return ""
        return (
            "Every message shares one process group here (p2p_routes=shared), where messages "
            "pair in posting order and wait on each other: use p2p_routes=per-edge (auto's "
            "choice on NCCL and under emulate_nccl)"
        )
