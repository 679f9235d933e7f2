"""Stage reports (summary.json's ``stages`` entries): one format, and the earlier one still read.

Both producers (our pipeline, torch's baseline) are compared key for key on real runs in
tests/test_bench.py (``same_report_keys``).
"""

from __future__ import annotations

import json
from pathlib import Path

from nobubble.bench.measure import read_run
from nobubble.stage_report import StageReport, read_stage_report
from nobubble.tracking import stage_scalars


def report(pp_rank: int, replica: int) -> dict:
    """A report of this version: process ``pp_rank`` of an interleaved run (model stages
    ``pp_rank`` and ``pp_rank + 2``), with a digest and the all-reduce's measurements."""
    action_s = {str(s): {"F": 1.0, "B": 2.0, "STEP": 0.1} for s in (pp_rank, pp_rank + 2)}
    new = StageReport(
        pp_rank=pp_rank,
        model_stages=(pp_rank, pp_rank + 2),
        replica=replica,
        blocks=2,
        train_wall_s=10.0,
        idle_s=1.0 + pp_rank,
        peak_mem_mb=500.0 + replica,
        param_mb=6.0,
        state_mb=12.0,
        weight_versions_peak=2,
        action_s=action_s,
    ).as_dict()
    return new | {"weights_sha256": "ab", "allreduce_s": 0.4, "allreduce_wait_s": 0.1,
                  "allreduce_mb": 24.0}  # fmt: skip


def earlier(new: dict) -> dict:
    """The same report as an earlier version wrote it: the pipeline rank as ``stage``, the model
    stages as ``stages``, in the same place among the keys."""
    names = {"pp_rank": "stage", "model_stages": "stages"}
    return {names.get(key, key): value for key, value in new.items()}


def run_folder(path: Path, reports: list[dict]) -> Path:
    """A finished run of 2 processes x 2 replicas, 4 steps, with ``reports``."""
    path.mkdir()
    config = {"schedule": "interleaved-1f1b", "stages": 2, "dp": 2, "microbatches": 4}
    (path / "config.json").write_text(json.dumps(config | {"steps": 4, "batch_size": 8}))
    summary = {"stopped": "finished", "steps": 4, "tokens_per_s": 100.0, "stages": reports}
    (path / "summary.json").write_text(json.dumps(summary))
    lines = [{"step": s, "train_loss": 5.0 - s, "tokens": 256 * s, "tokens_per_s": 100.0}
             for s in range(1, 5)]  # fmt: skip
    (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_report_of_an_earlier_version_reads_like_a_new_one(tmp_path):
    new = [report(pp_rank, replica) for pp_rank in range(2) for replica in range(2)]
    old = [earlier(r) for r in new]
    assert old[3]["stage"] == 1 and old[3]["stages"] == [1, 3] and "pp_rank" not in old[3]
    assert [read_stage_report(r) for r in old] == new
    assert stage_scalars(old) == stage_scalars(new)
    assert stage_scalars(new)["stage1/replica1/idle_fraction"] == 0.2
    read_old = read_run(run_folder(tmp_path / "old", old), skip_tokens=0)
    read_new = read_run(run_folder(tmp_path / "new", new), skip_tokens=0)
    assert read_old == read_new
    assert [r["pp_rank"] for r in read_old.ranks] == [0, 0, 1, 1]  # the names of this version
    assert read_old.stages[1].idle_fraction == 0.2 and read_old.stages[1].replicas == 2


def test_idle_fraction_is_none_where_idle_time_is_not_measured():
    """Torch's baseline on NCCL cannot time its waits on peers."""
    blind = StageReport(0, (0,), 0, 4, 10.0, None, 1.0, 1.0, 2.0, 1).as_dict()
    assert blind["idle_s"] is None and blind["idle_fraction"] is None and blind["action_s"] is None
    assert StageReport(0, (0,), 0, 4, 0.0, 0.0, 1.0, 1.0, 2.0, 1).idle_fraction == 0.0
