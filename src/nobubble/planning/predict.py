"""Step time, bubble and memory per rank of every schedule, from per-action costs.

The schedule simulator runs each schedule with per-stage forward/backward times (FLOPs at a
stated MFU) and a per-message time (latency + size / bandwidth). The steady-state step is the
makespan of three steps minus that of two, so 2bw's and pipedream's one-off fill and drain are
left out and a flushing schedule's fill and drain are in. The data-parallel all-reduce of each
rank's FP32 gradients (ring: 2·(dp-1)/dp of the bytes over the all-reduce bandwidth) is exposed
after a flushing schedule's step; 2bw and pipedream overlap it with the next step's compute (as
nobubble's runtime does), so only what outlasts the rank's compute shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from nobubble.model.presets import ModelConfig
from nobubble.planning.costs import BYTES_PER_WEIGHT_VERSION, BYTES_STATE_PER_PARAMETER, stage_costs
from nobubble.planning.hardware import Device, Link
from nobubble.schedules import generate, lower, schedule_spec, simulate

GRADIENT_BYTES = 4


@dataclass(frozen=True)
class Plan:
    model: ModelConfig
    stages: int  # pipeline ranks P
    microbatches: int  # M per step
    microbatch_size: int  # sequences
    seq_len: int
    dp: int
    device: Device
    mfu: float
    p2p: Link
    allreduce: Link
    chunks: int = 2  # stages per rank of interleaved schedules

    @property
    def tokens_per_step(self) -> int:
        return self.microbatches * self.microbatch_size * self.seq_len * self.dp


@dataclass(frozen=True)
class Prediction:
    schedule: str
    step_s: float
    tokens_per_s: float
    bubble: float  # mean idle share of the ranks' pipeline time per step
    exposed_allreduce_s: float
    memory_gb: list[float]  # per rank

    @property
    def peak_memory_gb(self) -> float:
        return max(self.memory_gb)


def shape_problem(plan: Plan, schedule: str) -> str | None:
    """Why ``schedule`` cannot run ``plan``'s shape (its M rule, its stages per rank, too few
    blocks for its model stages), or None."""
    spec = schedule_spec(schedule)
    chunks = plan.chunks if spec.interleaved else 1
    problem = spec.microbatch_problem(plan.stages, plan.microbatches) or spec.chunk_problem(chunks)
    if problem is None and plan.model.n_layers < plan.stages * chunks:
        problem = f"{plan.model.n_layers} blocks cannot fill {plan.stages * chunks} stages"
    return problem


def predict(plan: Plan, schedule: str) -> Prediction:
    spec = schedule_spec(schedule)
    chunks = plan.chunks if spec.interleaved else 1
    costs = stage_costs(plan.model, plan.stages * chunks, plan.seq_len, plan.microbatch_size)
    flops_per_s = plan.device.peak_tflops * 1e12 * plan.mfu
    fwd = [c.forward_flops / flops_per_s for c in costs]
    bwd = [2 * f for f in fwd]
    wgrad = [c.weight_flops / flops_per_s for c in costs]
    comm = plan.p2p.latency_us * 1e-6 + costs[0].message_bytes / (plan.p2p.gb_per_s * 1e9)

    def run(steps: int):
        actions = generate(schedule, plan.stages, plan.microbatches, steps, chunks)
        return simulate(lower(actions), fwd=fwd, bwd=bwd, comm=comm, wgrad=wgrad)

    two, three = run(2), run(3)
    pipeline_s = three.makespan - two.makespan
    ranks = three.rank_stages
    busy = [plan.microbatches * sum(fwd[s] + bwd[s] for s in stages) for stages in ranks]
    exposed = 0.0
    if plan.dp > 1:  # pipedream updates, and so all-reduces, after every microbatch
        ring = 2 * (plan.dp - 1) / plan.dp
        per_step = plan.microbatches if spec.step_per_microbatch else 1
        for r, stages in enumerate(ranks):
            grad_bytes = GRADIENT_BYTES * sum(costs[s].parameters for s in stages)
            allreduce_s = ring * grad_bytes / (plan.allreduce.gb_per_s * 1e9)
            hidden = 0.0 if spec.flushes else busy[r] / per_step
            exposed = max(exposed, per_step * max(allreduce_s - hidden, 0.0))
    step_s = pipeline_s + exposed
    memory = []
    for r, stages in enumerate(ranks):
        weights = sum(
            costs[s].parameters
            * (
                BYTES_PER_WEIGHT_VERSION * three.stage_weight_versions[s]
                + BYTES_STATE_PER_PARAMETER
            )
            for s in stages
        )
        per_activation = sum(costs[s].activation_bytes for s in stages) / len(stages)
        memory.append((weights + three.peak_activations[r] * per_activation) / 1e9)
    return Prediction(
        schedule=schedule,
        step_s=step_s,
        tokens_per_s=plan.tokens_per_step / step_s,
        bubble=1 - sum(busy) / (len(busy) * pipeline_s),
        exposed_allreduce_s=exposed,
        memory_gb=memory,
    )
