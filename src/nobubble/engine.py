"""What the training loop needs from a backend (the update both apply:
:mod:`nobubble.stage_update`)."""

from __future__ import annotations

import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from nobubble.evaluation import EvalSums
from nobubble.layout import ParallelLayout
from nobubble.model.moe import Routing


@dataclass
class StepStats:
    step: int  # 0-based index of the update: w[step] -> w[step + 1]
    loss: float  # mean loss of the step's microbatches (at the weights they were run with)
    grad_norm: float  # sqrt of the sum of the stages' squared norms, before clipping
    lr: float
    skipped_stages: list[int] = field(default_factory=list)
    routing: Routing = field(default_factory=dict)  # MoE blocks' routing sums (nobubble.model.moe)
    # what the step measured (staleness_every, applied_error_every): a metrics.jsonl key of
    # nobubble.staleness (STEP_MEASURES) -> one value per model stage (None: not measured there)
    measured: dict[str, list[float | None]] = field(default_factory=dict)


class StepHooks(Protocol):
    """Told before a step's first action and once its update is applied (the profiler of
    ``profile_steps``, :mod:`nobubble.profiling`, or one that does nothing)."""

    def before_step(self, step: int) -> None: ...

    def after_step(self, step: int) -> None: ...


class Engine(Protocol):
    """A backend that trains: the one-process engine or one rank of the pipeline."""

    step: int
    layout: ParallelLayout  # this process's place: its stage, replica, shard, whether it leads
    device: torch.device
    # told before a step's first action and once its update is applied (profile_steps)
    profiler: StepHooks

    def barrier(self) -> None:
        """Wait for every rank (a no-op in one process)."""

    def run_steps(
        self,
        stop: int,
        next_batch: Callable[[], torch.Tensor],
        on_step: Callable[[StepStats], None],
    ) -> None:
        """Train from ``self.step`` up to ``stop``; ``on_step`` sees every step's stats (leader)."""

    def evaluate(self, batches: Sequence[torch.Tensor], token_bytes: torch.Tensor) -> EvalSums:
        """Validation totals at the newest weights (meaningful on the leader)."""

    def weight_drift(self) -> list[float | None] | None:
        """Each model stage's relative weight drift ‖w[t] - w[t-d]‖ / ‖w[t]‖ (None for a stage
        without a delay), on the leader (a collective call); None where no stage has a delay,
        and on the other ranks (:mod:`nobubble.staleness`)."""

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every weight version this process holds, as ``v{version}/{parameter name}``."""

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything else needed to continue exactly: the step and the optimizer state (error
        feedback included) by parameter name, so that any layout can load it."""

    def restore(self, tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        """Continue from a checkpoint written by any layout the config allows: ``tensors`` holds
        (at least) this process's parameters, ``state`` as :meth:`checkpoint_state` wrote it."""

    def stage_reports(self, digests: bool = True) -> list[dict[str, float]] | None:
        """Per-stage idle time and memory of a pipeline, on the leader (collective); else None.
        ``digests``: with the weights' digests (which read every weight)."""


def peak_memory_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated by tensors, or on the CPU the process's peak resident size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
