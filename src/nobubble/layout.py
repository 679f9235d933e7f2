"""The parallel layout of a run: which rank holds which pipeline stage of which replica.

Three named dimensions: ``pp``, the pipeline degree P (the stages of one model replica),
``dp``, the data-parallel degree (replicas of the whole pipeline), and ``tp``, the
tensor-parallel ranks that share each stage's matrices (:mod:`nobubble.model.tensor_split`).
Ranks are numbered with ``tp`` innermost, then ``dp`` (:func:`global_rank`, the one home of the
order, which the planner's tests check it with)::

    rank = (pp_rank * dp + replica) * tp + tp_rank

which is the row-major order of ``init_device_mesh(device, (pp, dp, tp), mesh_dim_names=("pp",
"dp", "tp"))``, as in torchtitan and Megatron-LM (pipeline outermost). A tensor-parallel group
(an all-reduce after every attention and every MLP) is then consecutive ranks, on one node.
Why dp inside pp: the replicas of one stage all-reduce that stage's whole gradient every step,
while neighbouring stages exchange one microbatch's activations or gradients at a time, far
fewer bytes for a model of any size. With ``dp`` inside ``pp`` the replicas of a stage are near
ranks, on one node whenever a node runs a multiple of ``dp·tp`` processes, so the heavier
traffic gets the faster links (NVLink) and only the pipeline's messages cross nodes. With
``dp = tp = 1`` and one chunk, rank == stage.

Under tensor parallelism each tp index runs its own copy of the pipeline's traffic: the messages
between stages, the go-ahead and the stop votes go between ranks of the same tp index
(:meth:`rank_of` keeps this rank's), which hold matching shards; the run's leader is tp index 0's.

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

MESH_DIMS = ("pp", "dp", "tp")  # outermost first
LOOP, V = "loop", "v"  # placements of model stages on pipeline positions (module docstring)
PLACEMENTS = (LOOP, V)


def first_process() -> bool:
    """Whether this process is the first of its launch (rank 0 under torchrun, the leader of
    every layout; the only process without): the one that prints what is said once a launch."""
    return os.environ.get("RANK", "0") == "0"


@dataclass(frozen=True)
class ParallelLayout:
    """Rank ``rank`` of ``pp * dp * tp`` processes: ``dp`` replicas of a ``pp``-stage pipeline
    whose stages are each split over ``tp`` ranks, each process holding (its share of)
    ``chunks`` model stages placed by ``placement`` (``loop`` or ``v``)."""

    pp: int
    dp: int = 1
    rank: int = 0
    chunks: int = 1
    placement: str = LOOP
    tp: int = 1

    def __post_init__(self) -> None:
        if min(self.pp, self.dp, self.chunks, self.tp) < 1:
            raise ValueError(
                f"parallel degrees must be >= 1 (got pp={self.pp}, dp={self.dp}, "
                f"tp={self.tp}, chunks={self.chunks})"
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
        return cls(cfg.stages, cfg.dp, rank, cfg.chunks, placement, tp=cfg.tp)

    @classmethod
    def from_world(
        cls,
        pp: int,
        dp: int,
        rank: int,
        world: int,
        chunks: int = 1,
        placement: str = LOOP,
        tp: int = 1,
    ) -> ParallelLayout:
        """The layout of ``rank`` in a launch of ``world`` processes; a :class:`ConfigError`
        (saying how to launch instead) if ``world`` is not ``pp * dp * tp``."""
        needed, per_stage = pp * dp * tp, dp * tp
        if world != needed:
            extra = "".join(f" x {k}={v}" for k, v in (("dp", dp), ("tp", tp)) if v > 1)
            asked = f"stages={pp}{extra}" + (f" = {needed} processes" if extra else "")
            fix = f" or pass --stages {world // per_stage}" if world % per_stage == 0 else ""
            raise ConfigError(
                f"torchrun started {world} processes but the config asks for {asked}; run "
                f"`torchrun --nproc-per-node {needed} ...`{fix}"
            )
        return cls(pp, dp, rank, chunks, placement, tp=tp)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def model_stages(self) -> int:
        return self.pp * self.chunks

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(pp_rank, replica) of ``rank``: its place in the mesh, but for its tp index."""
        self._check_rank(rank)
        return divmod(rank // self.tp, self.dp)

    def rank_of(self, stage: int, replica: int | None = None, tp_rank: int | None = None) -> int:
        """The rank holding model stage ``stage`` of ``replica`` at tp index ``tp_rank``
        (defaults: this rank's replica and tp index)."""
        replica = self.replica if replica is None else replica
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        if not (
            0 <= stage < self.model_stages and 0 <= replica < self.dp and 0 <= tp_rank < self.tp
        ):
            raise ValueError(
                f"no stage {stage} of replica {replica} at tp index {tp_rank} in a layout of "
                f"pp={self.pp}, dp={self.dp}, tp={self.tp}, chunks={self.chunks}"
            )
        return global_rank(self.position_of(stage), replica, tp_rank, self.dp, self.tp)

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
    def tp_rank(self) -> int:
        """This process's index in its stage's tensor-parallel group."""
        return self.rank % self.tp

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
        replica 0 at tp index 0 (the pipeline's controller, which is the first to touch any
        step)."""
        return self.rank_of(0, 0, 0)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def controller(self) -> int:
        """The rank that clears each step for this rank's tp index: the first stage of replica 0
        (the leader, at tp index 0)."""
        return self.rank_of(0, 0)

    def peers(self) -> list[int]:
        """The ranks of this rank's tp index (its own included): the pipeline it talks to."""
        return list(range(self.tp_rank, self.world, self.tp))

    @property
    def shard(self) -> int:
        """This rank's checkpoint shard: its pipeline position (one shard per process of a
        replica, holding all its model stages; checkpoints are keyed by parameter name)."""
        return self.pp_rank

    @property
    def shards(self) -> int:
        return self.pp

    def name(self, stage: int | None = None, replica: int | None = None) -> str:
        """Model stage ``stage`` of ``replica`` (defaults: this rank's stages), for messages;
        under tensor parallelism at this rank's tp index (the one it talks to)."""
        stages = self.stages if stage is None else (stage,)
        replica = self.replica if replica is None else replica
        what = f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"
        what = what if self.dp == 1 else f"{what} of replica {replica}"
        return what if self.tp == 1 else f"{what} at tp index {self.tp_rank}"

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not in a layout of {self.world} processes")


def global_rank(pp: int, dp: int, tp: int, dp_degree: int, tp_degree: int) -> int:
    """The rank of the process at pipeline position ``pp``, replica ``dp`` and tensor-parallel
    index ``tp``: pp outermost, tp innermost (the module docstring says why)."""
    return (pp * dp_degree + dp) * tp_degree + tp


def device_mesh(
    layout: ParallelLayout, device_type: str, timeout: datetime.timedelta | None = None
) -> DeviceMesh:
    """The torch device mesh of ``layout`` (dimensions ``MESH_DIMS``; "tp" only with ``tp`` >
    1), under an initialized process group; ``mesh.get_group("dp")`` holds the replicas of this
    rank's stage, ``mesh.get_group("pp")`` the stages of its replica, in stage order, and
    ``mesh["tp"]`` the tensor-parallel ranks of its stage. ``timeout``: that of its "dp" and
    "tp" groups (torch gives a mesh's groups the backend's default, not the default group's; a
    dimension that spans every rank *is* the default group).

    A mesh holds references to the default process group (a dimension that spans every rank
    *is* the default group): drop it before
    :func:`nobubble.pipeline.process_group.close_process_group`, or that teardown cannot free
    the backend.
    """
    from torch.distributed.device_mesh import init_device_mesh

    # without tensor parallelism no "tp" dimension (it would make a group of one per rank)
    dims = MESH_DIMS if layout.tp > 1 else MESH_DIMS[:2]
    shape = (layout.pp, layout.dp, layout.tp)[: len(dims)]
    override = {}
    if timeout is not None:
        for dim, size in zip(dims[1:], shape[1:], strict=True):
            if size < layout.world:  # one that spans every rank is the default group
                override[dim] = _group_options(device_type, timeout)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=dims, backend_override=override)
    place = (layout.pp_rank, layout.replica, layout.tp_rank)[: len(dims)]
    if tuple(mesh.get_coordinate() or ()) != place:
        raise RuntimeError(
            f"the device mesh puts rank {layout.rank} at {dims} = {mesh.get_coordinate()}, the "
            f"layout at {place}; this is a bug in nobubble"
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


def stage_groups(
    layout: ParallelLayout, device_type: str, timeout: datetime.timedelta | None = None
) -> tuple[ProcessGroup | None, DeviceMesh | None]:
    """The process group of this rank's stage's data-parallel replicas (its mesh's "dp" group,
    with ``timeout``; None without data parallelism) and the one-dimensional mesh of its
    stage's tensor-parallel ranks (None without tensor parallelism). Every rank must call it (it
    builds the mesh); drop both before closing the default group (see :func:`device_mesh`)."""
    if layout.dp == 1 and layout.tp == 1:
        return None, None
    mesh = device_mesh(layout, device_type, timeout)
    replicas = mesh.get_group("dp") if layout.dp > 1 else None
    return replicas, mesh["tp"] if layout.tp > 1 else None
