"""Sharded data parallelism (zero=1, 2) under torchrun (gloo) against replicas that hold the
whole state (zero=0), at the same dp.

Tolerance. At dp = 2 the replicas' gradient is the same in every mode (the sum of two numbers
is the same in either order, then halved), and an element-wise optimizer computes each element
of a block of rows as it does in the whole tensor; what differs is the norm the clip divides by:
zero=0 takes the norm of the per-parameter norms, zero=1 the norm of the whole flat bucket and
zero=2 the square root of the replicas' sums of squares, the same sum grouped otherwise, so the
clip factor differs in the last bits (float32, ~1e-7 relative). That goes through six steps of
the optimizer, so the bound is test_data_parallel.py's (losses 1e-5 relative, weights 1e-5
absolute; measured: up to about 1e-7). A gradient not divided by dp, an update of the wrong rows
or a part never gathered is off in the third decimal; SGD (with grad_clip=0) is the case that
sees a wrongly scaled gradient, which AdamW and Muon barely notice.

What does not depend on summation order is bitwise: after every step each replica holds the
bytes the owner of each part computed (an all-gather hands all of them the same bytes), so the
replicas of a stage hold identical weights; summary.json's digests show it at the end (a replica
whose part was not gathered in any step would still differ there: only the part's owner rewrites
it).
"""

import json

import pytest

from tests.helpers.pipeline import EXTENDED, final_weights, nobubble
from tests.helpers.runs import assert_close_runs, launch, stage_reports

pytestmark = pytest.mark.slow

MOE = ["moe_experts=4", "moe_top_k=2", "moe_d_ff=32", "moe_layers=[1, 2, 3]"]

CASES = [
    # (stages, schedule, microbatches, extra settings)
    # flat split, EF's buffers split alike (P=2, dp=2)
    (2, "2bw", 4, ["optim=adamw", "correction=ef"]),
    # whole hidden matrices owned by one replica, the rest split
    (2, "2bw", 4, ["optim=muon", "muon_ns_dtype=float32"]),
    # two model stages a process (each its own chain), the tied copies' sum beside them
    (2, "interleaved-1f1b", 2, ["optim=adamw", "tie_embeddings=true"]),
    # P=1, dp=2; SGD sees a gradient scaled wrongly
    (1, "sync", 2, ["optim=sgd", "momentum=0.9", "grad_clip=0"]),
    pytest.param(2, "2bw", 4, ["optim=sgd", "momentum=0.9", "grad_clip=0"], marks=EXTENDED),
    pytest.param(2, "2bw", 2, ["optim=lion"], marks=EXTENDED),
    pytest.param(2, "2bw", 2, ["optim=adan"], marks=EXTENDED),
    pytest.param(2, "2bw", 2, ["optim=nadamw"], marks=EXTENDED),
    pytest.param(2, "2bw", 2, ["optim=signum", "momentum=0.9"], marks=EXTENDED),
    pytest.param(2, "2bw", 2, ["optim=soap"], marks=EXTENDED),  # every tensor owned whole
    pytest.param(2, "2bw", 2, ["optim=mars"], marks=EXTENDED),  # 2-D owned, 1-D split
    pytest.param(2, "2bw", 2, ["optim=adamw", "correction=nesterov"], marks=EXTENDED),
    pytest.param(2, "2bw", 2, ["optim=sgd", "momentum=0.9", "correction=dc"], marks=EXTENDED),
    pytest.param(2, "pipedream", 1, ["optim=adamw", "correction=spike"], marks=EXTENDED),
    pytest.param(2, "2bw", 2, ["optim=muon", "correction=ef+predict"], marks=EXTENDED),
    pytest.param(2, "2bw", 2, ["optim=muon", "muon_ns_dtype=float32", *MOE], marks=EXTENDED),
    pytest.param(2, "2bw", 2, ["optim=adamw", "tie_embeddings=true"], marks=EXTENDED),
    pytest.param(2, "1f1b", 2, ["optim=adamw"], marks=EXTENDED),
    pytest.param(2, "zb-h2", 4, ["optim=adamw"], marks=EXTENDED),
    pytest.param(2, "gpipe", 2, ["optim=adamw", "p2p_routes=per-edge"], marks=EXTENDED),
]


@pytest.mark.parametrize(("stages", "schedule", "micro", "extra"), CASES)
def test_sharded_state_trains_what_whole_replicas_train(tmp_path, stages, schedule, micro, extra):
    settings = [f"schedule={schedule}", f"stages={stages}", f"microbatches={micro}", "steps=6"]
    settings += ["eval_every=3", "dp=2", *extra]
    runs = {zero: tmp_path / f"zero{zero}" for zero in (0, 1, 2)}
    for zero, run in runs.items():
        nobubble(run, *settings, f"zero={zero}", stages=stages * 2)
    whole = {r["pp_rank"]: r["state_mb"] for r in stage_reports(runs[0])}
    for zero in (1, 2):
        assert_close_runs(runs[0], runs[zero])
        reports = stage_reports(runs[zero])
        for stage in range(stages):
            mine = [r for r in reports if r["pp_rank"] == stage]
            assert len({r["weights_sha256"] for r in mine}) == 1, f"stage {stage} differs"
            # each replica holds its part of the state: together about the whole of it
            assert sum(r["state_mb"] for r in mine) == pytest.approx(whole[stage], rel=0.02)
            assert all(r["zero_comm_mb"] > 0 and "allreduce_s" not in r for r in mine)


def test_a_flat_split_holds_half_of_the_state_on_each_of_two_replicas(tmp_path):
    """AdamW splits every parameter by rows: each replica's state is half of the whole, within a
    row of each parameter (the acceptance figure of summary.json's state_mb)."""
    settings = ["schedule=2bw", "stages=2", "microbatches=2", "steps=2", "eval_every=0", "dp=2"]
    nobubble(tmp_path / "z0", *settings, stages=4)
    nobubble(tmp_path / "z1", *settings, "zero=1", stages=4)
    whole = {r["pp_rank"]: r["state_mb"] for r in stage_reports(tmp_path / "z0")}
    for report in stage_reports(tmp_path / "z1"):
        assert report["state_mb"] == pytest.approx(whole[report["pp_rank"]] / 2, rel=0.02)
        assert report["zero_owned"] == []  # nothing needs a whole matrix under AdamW
    assert final_weights(tmp_path / "z1").keys() == final_weights(tmp_path / "z0").keys()


def test_muon_owns_hidden_matrices_whole_and_records_who(tmp_path):
    """Each hidden matrix is updated by one replica (Newton–Schulz needs all of it), recorded
    per rank; the replicas of a stage own disjoint sets, both some, together every one."""
    settings = ["schedule=2bw", "stages=2", "microbatches=2", "steps=1", "eval_every=0", "dp=2"]
    nobubble(tmp_path / "run", *settings, "optim=muon", "zero=2", stages=4)
    weights = final_weights(tmp_path / "run")
    hidden = {n for n, w in weights.items() if n.startswith("blocks.") and w.ndim == 2}
    owned = [set(r["zero_owned"]) for r in stage_reports(tmp_path / "run")]
    assert all(owned)
    assert sum(len(names) for names in owned) == len(set().union(*owned))
    assert set().union(*owned) == hidden


@pytest.mark.parametrize(
    "extra",
    [
        ["optim=adamw", "correction=dc"],  # AdamW's moments, DC's last change (a slot per delay)
        pytest.param(
            ["optim=muon", "muon_ns_dtype=float32", "correction=ef+predict"], marks=EXTENDED
        ),  # matrices owned whole, three versions a stage
    ],
    ids=["adamw+dc", "muon+ef+predict"],
)
def test_a_run_continues_across_dp_and_zero(tmp_path, extra):
    """dp=2 zero=1 -> dp=4 zero=2 -> dp=1 zero=0 (two 2bw stages: the two versions every stage
    holds, the optimizer's and the correction's state) equals the uninterrupted dp=2 zero=1 run
    within the dp tolerance: a checkpoint holds the whole state whatever zero wrote it, and each
    replica takes its part of it. A replica that took another's part, or state that lost its
    correction, would be off in the third decimal."""
    common = ["lr_schedule=constant", "eval_every=2", "schedule=2bw", "stages=2", "microbatches=2"]
    common += extra
    nobubble(tmp_path / "full", *common, "dp=2", "zero=1", "steps=6", stages=4)
    nobubble(tmp_path / "cut", *common, "dp=2", "zero=1", "steps=2", stages=4)
    launch("--resume", str(tmp_path / "cut"), "dp=4", "zero=2", "steps=4", stages=8)
    launch("--resume", str(tmp_path / "cut"), "dp=1", "zero=0", "steps=6", stages=2)
    assert_close_runs(tmp_path / "full", tmp_path / "cut")
    saved = json.loads((tmp_path / "cut" / "config.json").read_text())
    assert (saved["dp"], saved["zero"]) == (1, 0)
