"""Tensor parallelism inside a stage (``tp``): the layout's third dimension, the settings it
refuses, and the real pipeline of P=2 stages x tp=2 ranks against the one-process engine.

Tolerance: the tp ranks sum their partial products by all-reduce (row-parallel layers) and the
gradient norm over shards, in another order than one process does, so the runs agree to float32
rounding, not bitwise: losses, norms and drifts within a relative 1e-5, final weights within
1e-4 of each tensor's largest entry (a wrong weight version or a missed update moves the losses
in the second decimal and a weight by about the learning rate, 3e-3).
"""

from __future__ import annotations

import pytest

from nobubble.config import ConfigError
from nobubble.configure import TP_SCHEDULES, build_config
from nobubble.layout import ParallelLayout, global_rank
from tests.helpers.pipeline import (
    EXTENDED,
    drifts,
    final_weights,
    losses,
    metrics,
    nobubble,
    run_train,
)
from tests.helpers.runs import CONSTANT

SHAPE = {"d_model": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64, "seq_len": 32}
TP2 = {**SHAPE, "stages": 2, "tp": 2, "schedule": "2bw", "microbatches": 2, "optim": "adamw"}


def test_tp_is_the_innermost_dimension_and_each_tp_index_talks_to_its_own():
    layout = ParallelLayout(pp=2, dp=1, rank=3, tp=2)  # stage 1, tp index 1
    assert layout.world == 4
    assert [ParallelLayout(2, 1, r, tp=2).coordinates(r) for r in range(4)] == [
        (0, 0),
        (0, 0),
        (1, 0),
        (1, 0),
    ]
    assert (layout.pp_rank, layout.replica, layout.tp_rank) == (1, 0, 1)
    assert layout.rank_of(0) == 1  # its neighbour stage at the same tp index
    assert layout.rank_of(0, tp_rank=0) == 0
    assert layout.peers() == [1, 3]
    assert layout.controller == 1 and layout.leader == 0 and not layout.is_leader
    assert layout.name(0) == "stage 0 at tp index 1"  # in a message: the peer it talks to
    # the order is the planner's (one home: layout.global_rank)
    wide = ParallelLayout(pp=2, dp=2, rank=0, tp=2)
    assert [wide.rank_of(s, d, t) for s in range(2) for d in range(2) for t in range(2)] == [
        global_rank(s, d, t, 2, 2) for s in range(2) for d in range(2) for t in range(2)
    ]
    assert list(range(8)) == [
        global_rank(s, d, t, 2, 2) for s in (0, 1) for d in (0, 1) for t in (0, 1)
    ]


def test_a_launch_that_forgets_tp_is_told_the_process_count():
    with pytest.raises(
        ConfigError,
        match=r"stages=2 x tp=2 = 4 processes; run `torchrun "
        r"--nproc-per-node 4 \.\.\.` or pass --stages 1",
    ):
        ParallelLayout.from_world(2, 1, 0, 2, tp=2)
    assert ParallelLayout.from_world(2, 1, 3, 4, tp=2) == ParallelLayout(2, 1, 3, tp=2)


def test_tp_reads_into_the_layout_and_defaults_to_one():
    assert build_config(SHAPE).tp == 1
    assert ParallelLayout.of(build_config(TP2), rank=2).tp_rank == 0
    assert ParallelLayout.of(build_config(TP2)).world == 4


@pytest.mark.parametrize(
    ("change", "named", "fix"),
    [
        ({"tp": 3}, "4 query heads, 2 key/value heads and d_ff=64", "divides 2"),
        ({"d_ff": 65}, "d_ff=65", "tp that divides 1"),
        ({"moe_experts": 4, "moe_top_k": 2}, "moe_experts=4", "moe_experts=0"),
        ({"dp": 2, "batch_size": 8}, "dp > 1", "dp=1"),
        ({"optim": "muon"}, "optim=muon (only adamw", "optim adamw"),
        ({"schedule": "zb-h1"}, "schedule=zb-h1 (only 1f1b, 2bw)", "schedule 1f1b or 2bw"),
        ({"schedule": "interleaved-1f1b", "microbatches": 4}, "schedule=interleaved-1f1b", "2bw"),
        ({"correction": "predict"}, "correction=predict (only none or ef)", "or ef"),
        ({"tie_embeddings": True}, "tie_embeddings over several stages", "tie_embeddings=false"),
        ({"emulate_nccl": True}, "emulate_nccl", "set tp=1"),
        ({"activation_checkpointing": True}, "activation_checkpointing", "set tp=1"),
    ],
)
def test_what_tp_does_not_do_yet_is_refused_naming_it_and_the_fix(change, named, fix):
    with pytest.raises(ConfigError) as error:
        build_config({**TP2, **change})
    assert named in str(error.value) and fix in str(error.value)


def test_every_schedule_tp_allows_is_tested_here():
    assert set(TP_SCHEDULES) == {schedule for schedule, *_ in PARITY_SCHEDULES}


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and a == pytest.approx(b, rel=1e-5)


PARITY_SCHEDULES = [
    ("1f1b", ["p2p_routes=per-edge"]),  # NCCL's routes: an edge group per tp index
    ("2bw", ["correction=ef"]),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "extra"),
    [*PARITY_SCHEDULES, pytest.param("2bw", [], marks=EXTENDED)],
)
def test_two_stages_of_two_tp_ranks_equal_the_one_process_run(tmp_path, schedule, extra):
    settings = [f"schedule={schedule}", "stages=2", "microbatches=2", "steps=6", "eval_every=3"]
    settings += ["optim=adamw", *extra]
    nobubble(tmp_path / "tp", *settings, "tp=2", stages=4)
    nobubble(tmp_path / "one", *settings)
    (train, val), (train_1, val_1) = losses(tmp_path / "tp"), losses(tmp_path / "one")
    assert close(train, train_1) and close(val, val_1)
    norms = [
        [r["grad_norm"] for r in metrics(tmp_path / run) if "grad_norm" in r]
        for run in ("tp", "one")
    ]
    assert close(*norms)
    for (step, mine), (_, theirs) in zip(
        drifts(tmp_path / "tp"), drifts(tmp_path / "one"), strict=True
    ):
        assert close(mine, theirs), f"the weight drift of step {step}"
    # the checkpoint holds the split weights gathered whole, under the one-process names
    mine, theirs = final_weights(tmp_path / "tp"), final_weights(tmp_path / "one")
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():  # AdamW's m/sqrt(v) magnifies rounding where g ~ 0:
        gap = (tensor - theirs[name]).abs().max()  # measured 2.4e-5 of the largest entry
        assert gap <= 1e-4 * theirs[name].abs().max(), f"{name} differs by {gap}"


@pytest.mark.slow
def test_a_tp_checkpoint_continues_on_whole_stages_and_not_yet_on_split_ones(tmp_path):
    """tp=2 -> tp=1: the checkpoint holds whole tensors under the one-process names, so a
    pipeline without tp continues it; continuing into tp=2 is refused, naming tp=1."""
    common = ["schedule=2bw", "stages=2", "microbatches=2", "optim=adamw", "correction=ef"]
    common += CONSTANT  # the learning rate of a run cut at 3 steps is that of the 6-step run
    nobubble(tmp_path / "full", *common, "steps=6")
    nobubble(tmp_path / "cut", *common, "tp=2", "steps=3", stages=4)
    split = run_train("--resume", str(tmp_path / "cut"), "steps=6", stages=4)
    assert split.returncode != 0 and "continue with tp=1" in split.stdout + split.stderr
    nobubble(tmp_path / "cut", "--resume", str(tmp_path / "cut"), "tp=1", "steps=6", stages=2)
    (train, val), (train_1, val_1) = losses(tmp_path / "cut"), losses(tmp_path / "full")
    assert close(train, train_1) and close(val, val_1)
