"""A pipeline process's report on itself: the entries of ``summary.json``'s ``stages`` list.

Both pipelines that write run folders report with :class:`StageReport`: ours
(:meth:`nobubble.pipeline.runtime.PipelineEngine.stage_reports`) and torch's baseline
(:mod:`nobubble.bench.torch_worker`); either adds measurements of its own (digests, all-reduce
times). A report names its process by ``pp_rank`` (its position in the pipeline), ``replica``
and ``model_stages`` (the model stages it holds). Reports written before these names, with
``stage`` for the pipeline rank and ``stages`` for the model stages, are read through
:func:`read_stage_report`, as every reader does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# what names the process, not a measurement of it
IDENTIFIERS = ("pp_rank", "model_stages", "replica", "blocks")
OLD_NAMES = {"stage": "pp_rank", "stages": "model_stages"}  # reports of earlier versions


@dataclass(frozen=True)
class StageReport:
    """What every process reports: who it is, its training time and how much of it it spent
    blocked (``idle_s``; None where it cannot be measured), its memory, the most weight
    versions it held, and its time per model stage and action kind (``action_s``; None where
    not measured)."""

    pp_rank: int
    model_stages: Sequence[int]
    replica: int
    blocks: int  # transformer blocks the process holds
    train_wall_s: float
    idle_s: float | None
    peak_mem_mb: float  # the high-water mark at the end of its latest training segment
    param_mb: float  # one copy of its weights
    state_mb: float  # the optimizer's and the correction's state it holds
    weight_versions_peak: int
    action_s: dict[str, dict[str, float]] | None = None

    @property
    def idle_fraction(self) -> float | None:
        if self.idle_s is None:
            return None
        return self.idle_s / self.train_wall_s if self.train_wall_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The report as ``summary.json`` holds it."""
        return {
            "pp_rank": self.pp_rank,
            "model_stages": list(self.model_stages),
            "replica": self.replica,
            "blocks": self.blocks,
            "train_wall_s": self.train_wall_s,
            "idle_s": self.idle_s,
            "idle_fraction": self.idle_fraction,
            "peak_mem_mb": self.peak_mem_mb,
            "param_mb": self.param_mb,
            "state_mb": self.state_mb,
            "weight_versions_peak": self.weight_versions_peak,
            "action_s": self.action_s,
        }


def read_stage_report(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with the names of this version: one an earlier version wrote (``stage``,
    ``stages``) reads like a new one."""
    return {OLD_NAMES.get(key, key): value for key, value in report.items()}
