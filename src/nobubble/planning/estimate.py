"""Step time, bubble and memory per rank of every schedule, from per-action costs.

The schedule simulator runs each schedule with per-stage forward/backward times (FLOPs at a
stated MFU; activation checkpointing adds a forward of the blocks to every backward) and a
per-message time (latency + size / bandwidth). The steady-state step is the makespan of three
steps minus that of two, so 2bw's and pipedream's one-off fill and drain are left out and a
flushing schedule's fill and drain are in. The data-parallel communication of each rank
(:func:`dp_bytes_per_parameter`: the all-reduce of its FP32 gradients, or with ``zero`` > 0 the
reduction and the all-gather of the new BF16 weights) is exposed after a flushing schedule's
step; 2bw and pipedream overlap it with the next step's compute (as nobubble's runtime does),
so only what outlasts the rank's compute shows.

Memory per rank (:func:`bytes_per_parameter`): the weight versions, the FP32 gradient, the
optimizer state (divided over the ``dp`` replicas with ``zero`` > 0), and, where the reduction
runs behind the next step's compute (2bw, pipedream with dp > 1), the reduced gradient it holds
while the next one accumulates (with ``zero=2`` only this replica's part of it); plus the
activations of the microbatches in flight.

Splits inside a stage (:mod:`nobubble.planning.mesh`): each GPU computes and holds its 1/tp
(:func:`nobubble.planning.costs.per_gpu`), its routed experts 1/(tp·ep), and a stage's forward and
backward take longer by its tensor-parallel all-reduces and expert-parallel all-to-alls
(:func:`split_comm_s`); the data-parallel reduction of a routed expert runs over the dp/ep
replicas that hold it.

Up to :data:`EXACT_MICROBATCHES` microbatches (or 40·P) every one of them is simulated. Above,
a step's simulated timeline repeats with a period of a few microbatches once it has settled
(:mod:`nobubble.schedules.steady`), so every figure grows by the same amount per period: the
model simulates three shapes past that point, one period apart, checks that they grow evenly,
and extends them to M exactly, at a cost that does not grow with M.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from nobubble.config import ConfigError, zero_problem
from nobubble.config.parallel import ParallelSettings
from nobubble.model.presets import ModelConfig
from nobubble.planning.costs import (
    BYTES_GRADIENT,
    BYTES_OPTIMIZER_STATE,
    BYTES_PER_WEIGHT_VERSION,
    StageCost,
    per_gpu,
    stage_costs,
)
from nobubble.planning.hardware import LINKS, Device, Link
from nobubble.planning.mesh import Splits
from nobubble.schedules import SimResult, generate, lower, schedule_spec, simulate
from nobubble.schedules.registry import ScheduleSpec
from nobubble.schedules.steady import Steady, steady_state

# M up to which every microbatch is simulated: the larger of these. Beyond, extending three
# shapes of about 10·P microbatches (their period found in one step of 16·P) costs less.
EXACT_MICROBATCHES = 64
EXACT_PER_STAGE = 40
STEADY_LIMIT = 4096  # the longest step simulated to find where a schedule's timeline repeats

_N = TypeVar("_N", int, float)  # a count or a size


@dataclass(frozen=True)
class ClusterPlan:
    """What the cost model predicts: a model on a cluster, its pipeline and data-parallel shape
    as a training run's ``parallel`` section says it (stages P, microbatches M per step, dp,
    zero, chunks: None for each interleaved schedule's own). Every schedule is predicted, so
    the section's ``schedule`` is not read."""

    model: ModelConfig
    parallel: ParallelSettings
    microbatch_size: int  # sequences per microbatch and replica
    seq_len: int
    device: Device
    mfu: float
    p2p: Link
    allreduce: Link
    activation_checkpointing: bool = False
    splits: Splits = Splits()
    node_link: Link | None = None  # between the GPUs of a node; None: the device's

    def __post_init__(self) -> None:
        problem = zero_problem(self.parallel) or self.splits.problem(self.parallel.dp, self.model)
        if problem:
            raise ConfigError(problem)

    @property
    def node(self) -> Link:
        """The link a node's GPUs share (tensor parallelism's, and expert parallelism's inside
        a node)."""
        return self.node_link or LINKS[self.device.node_link]

    @property
    def ep_link(self) -> Link:
        """The link an expert-parallel group's all-to-all runs on: the node's when every group
        sits inside a node, else the data-parallel link between nodes."""
        return self.node if self.splits.ep_in_node else self.allreduce

    @property
    def gpus(self) -> int:
        """pp × dp × tp."""
        return self.parallel.stages * self.parallel.dp * self.splits.tp

    def shaped(self, **parallel: int) -> ClusterPlan:
        """This plan with ``parallel``'s settings changed (``stages=8, microbatches=32``)."""
        return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, **parallel))

    @property
    def tokens_per_step(self) -> int:
        p = self.parallel
        return p.microbatches * self.microbatch_size * self.seq_len * p.dp


def chunks_of(plan: ClusterPlan, spec: ScheduleSpec) -> int:
    """The stages per rank ``spec`` runs ``plan`` with: the plan's chunks (or the schedule's
    own) for interleaved-1f1b, a V schedule's 2, else one."""
    if not spec.takes_chunks:
        return spec.default_chunks
    return plan.parallel.chunks or spec.default_chunks


@dataclass(frozen=True)
class Estimate:
    schedule: str
    step_s: float
    tokens_per_s: float
    bubble: float  # mean idle share of the ranks' pipeline time per step
    exposed_dp_s: float  # data-parallel communication not hidden behind compute, per step
    memory_gb: list[float]  # per rank

    @property
    def peak_memory_gb(self) -> float:
        return max(self.memory_gb)


def shape_problem(plan: ClusterPlan, schedule: str) -> str | None:
    """Why ``schedule`` cannot run ``plan``'s shape (its M rule, its stages per rank, too few
    blocks for its model stages), or None."""
    spec, p = schedule_spec(schedule), plan.parallel
    chunks = chunks_of(plan, spec)
    problem = spec.microbatch_problem(p.stages, p.microbatches) or spec.chunk_problem(chunks)
    if problem is None and plan.model.n_layers < p.stages * chunks:
        problem = f"{plan.model.n_layers} blocks cannot fill {p.stages * chunks} stages"
    return problem


@dataclass(frozen=True)
class _Times:
    """Per-stage action times of one plan and schedule (seconds)."""

    fwd: list[float]
    bwd: list[float]
    wgrad: list[float]
    comm: float
    activation_bytes: list[float]  # per stage, per microbatch in flight


@dataclass(frozen=True)
class _Simulated:
    """What the cost model reads off the simulator for M microbatches per step."""

    pipeline_s: float  # the steady step: three steps' makespan minus two's
    # per rank: the most activation bytes held at once, each stage's forwards at its size
    peak_activation_bytes: tuple[float, ...]
    stage_weight_versions: tuple[int, ...]  # per stage
    rank_stages: tuple[tuple[int, ...], ...]

    def minus(self, earlier: _Simulated) -> _Simulated:
        """What these figures add to ``earlier``'s (a shape's growth over a period)."""
        return _Simulated(
            self.pipeline_s - earlier.pipeline_s,
            _minus(self.peak_activation_bytes, earlier.peak_activation_bytes),
            _minus(self.stage_weight_versions, earlier.stage_weight_versions),
            self.rank_stages,
        )

    def plus(self, growth: _Simulated, times: int) -> _Simulated:
        """These figures and ``times`` times ``growth``."""
        return _Simulated(
            self.pipeline_s + times * growth.pipeline_s,
            _plus(self.peak_activation_bytes, growth.peak_activation_bytes, times),
            _plus(self.stage_weight_versions, growth.stage_weight_versions, times),
            self.rank_stages,
        )

    def same_as(self, other: _Simulated) -> bool:
        """Equal figures, the time and the bytes to float precision."""
        return (
            math.isclose(self.pipeline_s, other.pipeline_s, rel_tol=1e-9, abs_tol=1e-15)
            and all(
                math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)
                for a, b in zip(
                    self.peak_activation_bytes, other.peak_activation_bytes, strict=True
                )
            )
            and self.stage_weight_versions == other.stage_weight_versions
        )


def _minus(a: tuple[_N, ...], b: tuple[_N, ...]) -> tuple[_N, ...]:
    return tuple(x - y for x, y in zip(a, b, strict=True))


def _plus(a: tuple[_N, ...], d: tuple[_N, ...], times: int) -> tuple[_N, ...]:
    return tuple(x + times * y for x, y in zip(a, d, strict=True))


def _run(
    plan: ClusterPlan, schedule: str, chunks: int, times: _Times, microbatches: int, steps: int
) -> SimResult:
    actions = generate(schedule, plan.parallel.stages, microbatches, steps, chunks)
    return simulate(
        lower(actions),
        fwd=times.fwd,
        bwd=times.bwd,
        comm=times.comm,
        wgrad=times.wgrad,
        activation_sizes=times.activation_bytes,
    )


def _simulated(
    plan: ClusterPlan, schedule: str, chunks: int, times: _Times, microbatches: int
) -> _Simulated:
    """Every microbatch of two and of three steps."""
    two = _run(plan, schedule, chunks, times, microbatches, 2)
    three = _run(plan, schedule, chunks, times, microbatches, 3)
    return _Simulated(
        three.makespan - two.makespan,
        tuple(three.peak_activation_size),
        tuple(three.stage_weight_versions),
        tuple(map(tuple, three.rank_stages)),
    )


def _simulated_up_to(plan: ClusterPlan) -> int:
    """The largest M simulated microbatch by microbatch."""
    return max(EXACT_MICROBATCHES, EXACT_PER_STAGE * plan.parallel.stages)


def _steady(plan: ClusterPlan, schedule: str, chunks: int, times: _Times, cool_down: int) -> Steady:
    """Where one long step of ``schedule`` repeats: steps of doubling length, up to
    :data:`STEADY_LIMIT` microbatches."""
    length = 16 * plan.parallel.stages  # a multiple of P, as interleaved schedules need
    while length <= STEADY_LIMIT:
        steady = steady_state(_run(plan, schedule, chunks, times, length, 1), cool_down)
        if steady is not None:
            return steady
        length *= 2
    raise ConfigError(
        f"--microbatches {plan.parallel.microbatches}: a simulated step of {schedule} did not "
        f"settle into a repeating pattern within {STEADY_LIMIT} microbatches, so its figures "
        "cannot be extended from a bounded simulation; use --microbatches "
        f"{_simulated_up_to(plan)} or fewer (simulated microbatch by microbatch)"
    )


def _figures(plan: ClusterPlan, schedule: str, chunks: int, times: _Times) -> _Simulated:
    """The simulator's figures for the plan's microbatches: simulated, or extended exactly from
    three simulated shapes a period apart once the steps repeat (see the module's note)."""
    m = plan.parallel.microbatches
    if m <= _simulated_up_to(plan):
        return _simulated(plan, schedule, chunks, times, m)
    # the last microbatches, whose actions a step's end reorders: those within a warm-up (at
    # most 2P forwards ahead, zb-h2) and, interleaved, their group of P
    cool_down = 3 * plan.parallel.stages + 2
    steady = _steady(plan, schedule, chunks, times, cool_down)
    # interleaved schedules take M in multiples of P: so do the shapes simulated
    period = math.lcm(steady.period, plan.parallel.stages) if chunks > 1 else steady.period
    base = steady.settled + cool_down + period
    base += (m - base) % period
    if m <= base + 2 * period:
        return _simulated(plan, schedule, chunks, times, m)
    first, second, third = (
        _simulated(plan, schedule, chunks, times, base + i * period) for i in range(3)
    )
    growth = second.minus(first)
    if not growth.same_as(third.minus(second)):
        raise ConfigError(
            f"--microbatches {m}: {schedule}'s simulated steps of {base}, {base + period} and "
            f"{base + 2 * period} microbatches do not grow evenly, so its figures cannot be "
            f"extended from them; use --microbatches {_simulated_up_to(plan)} or fewer "
            "(simulated microbatch by microbatch)"
        )
    return third.plus(growth, (m - base) // period - 2)


def bytes_per_parameter(
    plan: ClusterPlan, versions: int, behind_compute: bool, replicas: int
) -> float:
    """What a rank holds per parameter of its stages that ``replicas`` ranks hold alike (dp,
    or dp/ep for a routed expert's): ``versions`` BF16 weight copies, the FP32 gradient, the
    optimizer state (1/replicas of it with zero > 0) and, where the reduction runs behind the
    next step's compute (``behind_compute`` with replicas > 1), the reduced gradient it holds
    meanwhile (all of it; 1/replicas with zero=2)."""
    held = BYTES_PER_WEIGHT_VERSION * versions + BYTES_GRADIENT
    held += BYTES_OPTIMIZER_STATE / (replicas if plan.parallel.zero else 1)
    if behind_compute and replicas > 1:
        held += BYTES_GRADIENT / (replicas if plan.parallel.zero == 2 else 1)
    return held


def dp_bytes_per_parameter(plan: ClusterPlan, replicas: int) -> float:
    """What a rank sends (and receives) each step over the data-parallel link per parameter
    of its stages that ``replicas`` ranks hold alike: a ring all-reduce of the FP32 gradient,
    2(r-1)/r of it; with zero=1 that and an all-gather of the new BF16 weights, (r-1)/r of
    them; with zero=2 a reduce-scatter, (r-1)/r of the gradient, and the all-gather."""
    share = (replicas - 1) / replicas
    gather = share * BYTES_PER_WEIGHT_VERSION if plan.parallel.zero else 0.0
    reduce = (1 if plan.parallel.zero == 2 else 2) * share * BYTES_GRADIENT
    return reduce + gather


def _per_replicas(
    plan: ClusterPlan, cost: StageCost, per_parameter: Callable[[int], float]
) -> float:
    """``per_parameter(replicas)`` summed over one GPU's share of a stage: its dense weights
    are held by the dp replicas alike, its routed experts by dp/ep of them."""
    dp = plan.parallel.dp
    dense = cost.parameters - cost.expert_parameters
    return dense * per_parameter(dp) + cost.expert_parameters * per_parameter(dp // plan.splits.ep)


def tp_all_reduce_s(plan: ClusterPlan, cost: StageCost) -> float:
    """One ring all-reduce of a stage's activation (s·b·h 16-bit numbers: ``cost`` is the
    whole stage's) over its tp GPUs on the node's link: latency + 2(tp-1)/tp of its bytes over
    the bandwidth; 0 at tp = 1. Under sequence parallelism it is a reduce-scatter and an
    all-gather of the same bytes, counted with one latency."""
    tp = plan.splits.tp
    if tp == 1:
        return 0.0
    link = plan.node
    return link.latency_us * 1e-6 + 2 * (tp - 1) / tp * cost.message_bytes / (link.gb_per_s * 1e9)


def ep_all_to_all_s(plan: ClusterPlan, cost: StageCost) -> float:
    """One all-to-all of an MoE block's routed tokens over its ep GPUs (``cost`` is the whole
    stage's): each GPU sends its 1/tp of the tokens, k copies of each, h 16-bit numbers, of
    which (ep-1)/ep leave it; latency + those bytes over :attr:`ClusterPlan.ep_link`; 0 at
    ep = 1. A capacity factor's padding and dropped tokens are not counted."""
    ep = plan.splits.ep
    if ep == 1:
        return 0.0
    routed = cost.message_bytes / plan.splits.tp * plan.model.moe_top_k
    link = plan.ep_link
    return link.latency_us * 1e-6 + (ep - 1) / ep * routed / (link.gb_per_s * 1e9)


def split_comm_s(plan: ClusterPlan, cost: StageCost) -> tuple[float, float]:
    """What the splits inside a stage add to its forward and its backward per microbatch
    (``cost``: the whole stage's), on the critical path (no overlap with compute modelled):
    tp all-reduces, 2 per block in the forward (after the attention and after the MLP) and 2
    in the backward (their inputs' gradients), 1 in the embedding's forward and 1 in the head's
    backward (vocabulary-parallel); ep all-to-alls, 2 per MoE block each way (dispatch and
    combine). Activation checkpointing runs the blocks' forward again in the backward, its
    collectives with it."""
    ar, a2a = tp_all_reduce_s(plan, cost), ep_all_to_all_s(plan, cost)
    blocks = 2 * cost.blocks * ar + 2 * cost.moe_blocks * a2a
    forward = blocks + (ar if cost.embedding else 0.0)
    backward = blocks + (ar if cost.head else 0.0)
    return forward, backward + (blocks if plan.activation_checkpointing else 0.0)


def estimate(plan: ClusterPlan, schedule: str) -> Estimate:
    spec = schedule_spec(schedule)
    chunks = chunks_of(plan, spec)
    whole = stage_costs(
        plan.model,
        plan.parallel.stages * chunks,
        plan.seq_len,
        plan.microbatch_size,
        plan.activation_checkpointing,
    )
    costs = [per_gpu(c, plan.splits) for c in whole]
    flops_per_s = plan.device.peak_tflops * 1e12 * plan.mfu
    split = [split_comm_s(plan, c) for c in whole]
    compute = [c.forward_flops / flops_per_s for c in costs]
    fwd = [f + forward for f, (forward, _) in zip(compute, split, strict=True)]
    bwd = [
        2 * f + c.recompute_flops / flops_per_s + backward
        for f, c, (_, backward) in zip(compute, costs, split, strict=True)
    ]
    wgrad = [c.weight_flops / flops_per_s for c in costs]
    comm = plan.p2p.latency_us * 1e-6 + costs[0].message_bytes / (plan.p2p.gb_per_s * 1e9)
    activation_bytes = [c.activation_bytes for c in costs]
    simulated = _figures(plan, schedule, chunks, _Times(fwd, bwd, wgrad, comm, activation_bytes))
    pipeline_s = simulated.pipeline_s
    ranks = simulated.rank_stages
    busy = [plan.parallel.microbatches * sum(fwd[s] + bwd[s] for s in stages) for stages in ranks]
    exposed = 0.0
    if plan.parallel.dp > 1:  # pipedream updates, and so communicates, after every microbatch
        per_step = plan.parallel.microbatches if spec.step_per_microbatch else 1
        for r, stages in enumerate(ranks):
            dp_bytes = sum(
                _per_replicas(plan, costs[s], lambda r: dp_bytes_per_parameter(plan, r))
                for s in stages
            )
            dp_s = dp_bytes / (plan.allreduce.gb_per_s * 1e9)
            hidden = 0.0 if spec.flushes else busy[r] / per_step
            exposed = max(exposed, per_step * max(dp_s - hidden, 0.0))
    step_s = pipeline_s + exposed
    memory = []
    for r, stages in enumerate(ranks):
        weights = sum(
            _per_replicas(
                plan,
                costs[s],
                lambda r, s=s: bytes_per_parameter(
                    plan, simulated.stage_weight_versions[s], not spec.flushes, r
                ),
            )
            for s in stages
        )
        recompute = max(costs[s].recompute_bytes for s in stages)
        activations = simulated.peak_activation_bytes[r] + recompute
        memory.append((weights + activations) / 1e9)
    return Estimate(
        schedule=schedule,
        step_s=step_s,
        tokens_per_s=plan.tokens_per_step / step_s,
        # a share, never below 0: the busy times' sum may pass the step's by a rounding error
        bubble=max(0.0, 1 - sum(busy) / (len(busy) * pipeline_s)),
        exposed_dp_s=exposed,
        memory_gb=memory,
    )
