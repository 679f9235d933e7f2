"""Data parallelism (torchrun, gloo): dp replicas of a P-stage pipeline against one process.

Tolerance. A replica computes each microbatch's loss over its 1/dp of the rows and the replicas
average their gradients, where one process takes the mean over all rows at once: the same sum in
another order, so the gradient differs in the last bits (float32 relative rounding, ~1e-7) and
those differences go through a few optimizer steps. With the SMALL model and six steps, losses
agree to a relative 1e-5 and weights to an absolute 1e-5 (measured: about 6e-7; the bounds leave a
factor of ten, and an off-by-one weight version or a replica reading the wrong rows moves the
losses in the third decimal). Muon orthogonalizing in float32 keeps these bounds: measured 8e-8
(losses) and 2e-7 (weights). In bfloat16 (muon_ns_dtype=auto's choice on CUDA and on CPUs with
bfloat16 matrix instructions) it is looser: a last-bit difference of the float32 input can round
to a neighbouring bfloat16 value (a relative 2^-8 of that element of the update); measured over
six steps: losses within a relative 1e-5, weights within 3e-4, so the bounds are 1e-4 and 1e-3.
The run's summary.json says which dtype it used. What does not depend on summation order is
bitwise: the replicas of a stage hold identical weights at the end (their all-reduced gradient is
the same bytes).
"""

import os
import signal

import pytest

from nobubble.config import ConfigError
from nobubble.configure import build_config
from nobubble.faults.inject import workers
from tests.helpers.pipeline import (
    EXTENDED,
    assert_same_run,
    nobubble,
    run_train,
)
from tests.helpers.runs import LONG, assert_close_runs, stage_reports, steps_logged, wait_until

pytestmark = pytest.mark.slow

CASES = [
    # (stages, schedule, microbatches, extra settings)
    (2, "sync", 2, ["optim=adamw"]),
    # sync runs as 1f1b: another IR, the same semantics
    pytest.param(2, "gpipe", 2, ["optim=muon"], marks=EXTENDED),
    pytest.param(2, "2bw", 2, ["optim=adamw"], marks=EXTENDED),  # the ef case's path, less EF
    (2, "2bw", 2, ["optim=adamw", "correction=ef"]),
    (2, "2bw", 2, ["optim=muon", "p2p_routes=per-edge"]),  # NCCL's routes, per replica
    pytest.param(2, "2bw", 2, ["optim=muon", "correction=ef"], marks=EXTENDED),
    (2, "pipedream", 1, ["optim=adamw"]),
    # SGD without clipping moves with the gradient's scale, which AdamW and Muon barely notice: a
    # gradient not divided by dp is caught here
    (2, "2bw", 2, ["optim=sgd", "momentum=0.9", "grad_clip=0"]),
    # two model stages a process, the tied copies' all-reduce beside the replicas'
    (2, "interleaved-1f1b", 2, ["optim=adamw", "tie_embeddings=true"]),
    (1, "sync", 2, ["optim=adamw"]),  # plain data parallelism: one stage, two replicas
]


@pytest.mark.parametrize(("stages", "schedule", "micro", "extra"), CASES)
def test_replicas_equal_one_process_with_the_same_global_batch(
    tmp_path, stages, schedule, micro, extra
):
    settings = [f"schedule={schedule}", f"stages={stages}", f"microbatches={micro}", "steps=6"]
    settings += ["eval_every=3", *extra]
    nobubble(tmp_path / "dp", *settings, "dp=2", stages=stages * 2)
    nobubble(tmp_path / "one", *settings)
    assert_close_runs(tmp_path / "dp", tmp_path / "one")
    reports = stage_reports(tmp_path / "dp")
    assert sorted((r["pp_rank"], r["replica"]) for r in reports) == [
        (s, r) for s in range(stages) for r in range(2)
    ]
    for stage in range(stages):
        digests = {r["weights_sha256"] for r in reports if r["pp_rank"] == stage}
        assert len(digests) == 1, f"the replicas of stage {stage} hold different weights"
        assert all(r["allreduce_mb"] > 0 for r in reports)


def test_batches_the_replicas_cannot_share_equally_are_refused():
    with pytest.raises(ConfigError, match="multiple of microbatches x dp = 8"):
        build_config({"batch_size": 12, "microbatches": 4, "dp": 2})


def test_a_launch_of_the_wrong_size_says_how_many_processes_to_start(tmp_path):
    result = nobubble(tmp_path / "run", "stages=2", "dp=2", stages=2, check=False)
    assert result.returncode != 0
    assert "--nproc-per-node 4" in result.stderr


def test_a_signal_to_one_rank_of_another_replica_stops_every_rank_and_resume_is_exact(
    tmp_path, in_background
):
    """SIGTERM to stage 1 of replica 1 alone (one node of a job preempted): its vote reaches the
    leader, every rank stops after the same step, and the resumed run continues bitwise."""
    settings = [*LONG, "steps=60", "eval_every=30", "schedule=2bw", "stages=2", "dp=2"]
    settings += ["microbatches=2"]
    proc = in_background(tmp_path / "cut", *settings, stages=4)
    wait_until(lambda: steps_logged(tmp_path / "cut") >= 25)
    os.kill(workers(proc.pid)[3], signal.SIGTERM)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0, output
    assert f"torchrun --nproc-per-node 4 -m nobubble train --resume {tmp_path / 'cut'}" in output
    stopped = steps_logged(tmp_path / "cut")
    assert stopped < 60
    assert (tmp_path / "cut" / "checkpoints" / f"step_{stopped:06d}" / "manifest.json").is_file()

    done = run_train("--resume", str(tmp_path / "cut"), stages=4)
    assert done.returncode == 0, done.stderr
    nobubble(tmp_path / "full", *settings, stages=4)
    assert_same_run(tmp_path / "full", tmp_path / "cut")
