"""The parallel layout of a run: which rank holds which pipeline stage of which replica.

Two named dimensions: ``pp``, the pipeline degree P (the stages of one model replica), and
``dp``, the data-parallel degree (replicas of the whole pipeline). Ranks are numbered with ``dp``
innermost::

    rank = pp_rank * dp + replica

which is the row-major order of ``init_device_mesh(device, (pp, dp), mesh_dim_names=("pp",
"dp"))``, as in torchtitan and Megatron-LM (pipeline outermost). Why: the replicas of one stage
all-reduce that stage's whole gradient every step, while neighbouring stages exchange one
microbatch's activations or gradients at a time, far fewer bytes for a model of any size. With
``dp`` innermost the replicas of a stage are neighbouring ranks, on one node whenever a node runs
a multiple of ``dp`` processes, so the heavier traffic gets the faster links (NVLink) and only the
pipeline's messages cross nodes. With ``dp = 1`` and one chunk, rank == stage.

With ``chunks`` v > 1 (interleaved schedules' virtual stages) the model is cut into P·v model
stages and the process at pipeline position r holds model stages r, P + r, ..., (v-1)·P + r, as
in Megatron-LM (the ``loop`` placement). The ``v`` placement (ZB-V, DualPipeV) cuts the model into
2P model stages and gives position r stages r and 2P-1-r: the model runs down the ranks and back
up, so the hand-off at the bottom of the V (stage P-1 to P, both at position P-1) stays in memory
and the first and the last model stage share position 0. Messages and the schedule's actions name
model stages, and :meth:`rank_of` maps a model stage to its process. The layout is the one home
of the count of model stages (:attr:`model_stages`, built from a config by
:meth:`ParallelLayout.of`) and of the placements' maps.

Everything that needs "my stage", a neighbour, the logging rank or a checkpoint shard asks the
layout; its maps are pure (no process group needed). In the one-process engine a layout is a
description only.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nobubble.config import ConfigError, TrainConfig

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("pp", "dp")  # outermost first
LOOP, V = "loop", "v"  # placements of model stages on pipeline positions (module docstring)
PLACEMENTS = (LOOP, V)


def first_process() -> bool:
    """Whether this process is the first of its launch (rank 0 under torchrun, the leader of
    every layout; the only process without): the one that prints what is said once a launch."""
    return os.environ.get("RANK", "0") == "0"


@dataclass(frozen=True)
class ParallelLayout:
    """Rank ``rank`` of ``pp * dp`` processes: ``dp`` replicas of a ``pp``-stage pipeline, each
    process holding ``chunks`` model stages placed by ``placement`` (``loop`` or ``v``)."""

    pp: int
    dp: int = 1
    rank: int = 0
    chunks: int = 1
    placement: str = LOOP

    def __post_init__(self) -> None:
        if min(self.pp, self.dp, self.chunks) < 1:
            raise ValueError(
                f"parallel degrees must be >= 1 (got pp={self.pp}, dp={self.dp}, "
                f"chunks={self.chunks})"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"unknown placement {self.placement!r}; choose one of: {', '.join(PLACEMENTS)}"
            )
        if self.placement == V and self.chunks != 2:
            raise ValueError(
                f"the V placement puts exactly 2 model stages on each pipeline position (r and "
                f"2P-1-r), got chunks={self.chunks}; use chunks=2"
            )
        self._check_rank(self.rank)

    @classmethod
    def of(cls, cfg: TrainConfig, rank: int = 0, placement: str = LOOP) -> ParallelLayout:
        """The layout ``cfg`` asks for, seen from ``rank`` (as a description, rank 0 will do);
        ``chunks`` must be resolved (:func:`nobubble.configure.build_config` does).
        ``placement``: the schedule's (its registry entry's, which this layer cannot read; the
        count of model stages does not depend on it)."""
        if cfg.chunks is None:
            raise ValueError("chunks is not resolved: build the config with build_config")
        return cls(cfg.stages, cfg.dp, rank, cfg.chunks, placement)

    @classmethod
    def from_world(
        cls, pp: int, dp: int, rank: int, world: int, chunks: int = 1, placement: str = LOOP
    ) -> ParallelLayout:
        """The layout of ``rank`` in a launch of ``world`` processes; a :class:`ConfigError`
        (saying how to launch instead) if ``world`` is not ``pp * dp``."""
        needed = pp * dp
        if world != needed:
            asked = f"stages={pp}" if dp == 1 else f"stages={pp} x dp={dp} = {needed} processes"
            fix = f" or pass --stages {world // dp}" if world % dp == 0 else ""
            raise ConfigError(
                f"torchrun started {world} processes but the config asks for {asked}; run "
                f"`torchrun --nproc-per-node {needed} ...`{fix}"
            )
        return cls(pp, dp, rank, chunks, placement)

    @property
    def world(self) -> int:
        return self.pp * self.dp

    @property
    def model_stages(self) -> int:
        return self.pp * self.chunks

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(pp_rank, replica) of ``rank``: its place in the mesh."""
        self._check_rank(rank)
        return divmod(rank, self.dp)

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        """The rank holding model stage ``stage`` of ``replica`` (default: this rank's)."""
        replica = self.replica if replica is None else replica
        if not (0 <= stage < self.model_stages and 0 <= replica < self.dp):
            raise ValueError(
                f"no stage {stage} of replica {replica} in a layout of pp={self.pp}, "
                f"dp={self.dp}, chunks={self.chunks}"
            )
        return self.position_of(stage) * self.dp + replica

    def position_of(self, stage: int) -> int:
        """The pipeline position (pp rank) holding model stage ``stage``."""
        chunk, offset = divmod(stage, self.pp)
        return self.pp - 1 - offset if self.placement == V and chunk % 2 else offset

    def stages_of(self, pp_rank: int) -> tuple[int, ...]:
        """The model stages the processes at pipeline position ``pp_rank`` hold, in order."""
        if self.placement == V:
            return (pp_rank, 2 * self.pp - 1 - pp_rank)
        return tuple(chunk * self.pp + pp_rank for chunk in range(self.chunks))

    def chunk_of(self, stage: int) -> int:
        """Which of its process's model stages ``stage`` is (0 for the first; both placements
        put stage c·P + i in chunk c)."""
        return stage // self.pp

    def holds(self, stage: int) -> bool:
        """Whether this process holds model stage ``stage``."""
        return stage in self.stages

    def same_process(self, stage: int, other: int) -> bool:
        """Whether model stages ``stage`` and ``other`` sit on one process (of each replica): a
        hand-off between them stays in memory, no message (the bottom of the V; the first and
        the last stage under V)."""
        return self.position_of(stage) == self.position_of(other)

    @property
    def replica(self) -> int:
        return self.coordinates(self.rank)[1]

    @property
    def pp_rank(self) -> int:
        """This process's position in its pipeline (its stage when chunks = 1)."""
        return self.coordinates(self.rank)[0]

    @property
    def stages(self) -> tuple[int, ...]:
        """The model stages this process holds."""
        return self.stages_of(self.pp_rank)

    @property
    def is_first_stage(self) -> bool:
        """Whether this process holds model stage 0 (the embedding)."""
        return self.pp_rank == self.position_of(0)

    @property
    def is_last_stage(self) -> bool:
        """Whether this process holds the last model stage (the head; position 0 under V)."""
        return self.pp_rank == self.position_of(self.model_stages - 1)

    @property
    def leader(self) -> int:
        """The rank that opens the run folder, builds the data first and logs: the first stage of
        replica 0 (the pipeline's controller, which is the first to touch any step)."""
        return self.rank_of(0, 0)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def shard(self) -> int:
        """This rank's checkpoint shard: its pipeline position (one shard per process of a
        replica, holding all its model stages; checkpoints are keyed by parameter name)."""
        return self.pp_rank

    @property
    def shards(self) -> int:
        return self.pp

    def name(self, stage: int | None = None, replica: int | None = None) -> str:
        """Model stage ``stage`` of ``replica`` (defaults: this rank's stages), for messages."""
        stages = self.stages if stage is None else (stage,)
        replica = self.replica if replica is None else replica
        what = f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"
        return what if self.dp == 1 else f"{what} of replica {replica}"

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not in a layout of {self.world} processes")


def device_mesh(
    layout: ParallelLayout, device_type: str, timeout: datetime.timedelta | None = None
) -> DeviceMesh:
    """The torch device mesh of ``layout`` (dimensions ``MESH_DIMS``), under an initialized
    process group; ``mesh.get_group("dp")`` holds the replicas of this rank's stage and
    ``mesh.get_group("pp")`` the stages of its replica, in stage order. ``timeout``: that of
    its "dp" groups (torch gives a mesh's groups the backend's default, not the default
    group's; a "dp" dimension that spans every rank *is* the default group).

    A mesh holds references to the default process group (with ``dp = 1`` its "pp" group *is*
    the default group): drop it before :func:`nobubble.pipeline.process_group.close_process_group`,
    or that teardown cannot free the backend.
    """
    from torch.distributed.device_mesh import init_device_mesh

    override = {}
    if timeout is not None and layout.pp > 1:
        override["dp"] = _group_options(device_type, timeout)
    mesh = init_device_mesh(
        device_type, (layout.pp, layout.dp), mesh_dim_names=MESH_DIMS, backend_override=override
    )
    if tuple(mesh.get_coordinate() or ()) != layout.coordinates(layout.rank):
        raise RuntimeError(
            f"the device mesh puts rank {layout.rank} at (pp, dp) = {mesh.get_coordinate()}, the "
            f"layout at ({layout.pp_rank}, {layout.replica}); this is a bug in nobubble"
        )
    return mesh


def _group_options(device_type: str, timeout: datetime.timedelta) -> tuple[str, object]:
    """The backend of a mesh on ``device_type`` and its options with ``timeout``."""
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    options = (
        dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    )
    options._timeout = timeout
    return backend, options


def replica_group(
    layout: ParallelLayout, device_type: str, timeout: datetime.timedelta | None = None
) -> ProcessGroup | None:
    """The process group of this rank's stage's data-parallel replicas (its mesh's "dp"
    group, with ``timeout``), or None without data parallelism. Every rank must call it (it
    builds the mesh)."""
    if layout.dp == 1:
        return None
    return device_mesh(layout, device_type, timeout).get_group("dp")
