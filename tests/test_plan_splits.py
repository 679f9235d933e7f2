"""nobubble plan --tp --ep: the mesh's order, each GPU's share of a stage by hand, the
tensor-parallel all-reduces and the expert-parallel all-to-alls by hand, the refusals, and the
405B plan."""

import argparse
import dataclasses
import json

import pytest

from nobubble.config import ConfigError
from nobubble.config.parallel import ParallelSettings
from nobubble.layout import global_rank
from nobubble.model.presets import ModelConfig
from nobubble.planning import cli as plan_cli
from nobubble.planning.costs import per_gpu, stage_costs
from nobubble.planning.estimate import (
    ClusterPlan,
    ep_all_to_all_s,
    estimate,
    tp_all_reduce_s,
)
from nobubble.planning.hardware import DEVICES, LINKS
from nobubble.planning.mesh import Splits

# 8 blocks of d = 64, 4 query and 2 key/value heads; a microbatch of 2 x 32 = 64 tokens, so an
# activation is 2 bytes x 64 tokens x 64 = 8,192 bytes
SHAPE = ModelConfig(d_model=64, n_layers=8, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64,
                    vocab_size=100)  # fmt: skip
MOE = dataclasses.replace(SHAPE, moe_experts=4, moe_top_k=2, moe_d_ff=64)
ACTIVATION = 8192
NODE = dataclasses.replace(LINKS["nvlink4"], gb_per_s=1e-3, latency_us=3.0)  # 1 MB/s: slow


WHOLE = Splits()


def plan(splits: Splits = WHOLE, model: ModelConfig = SHAPE, **parallel) -> ClusterPlan:
    """4 stages, 8 microbatches, messages between stages free, the node's link :data:`NODE`."""
    return ClusterPlan(
        model=model,
        parallel=ParallelSettings(**{"stages": 4, "microbatches": 8, **parallel}),
        microbatch_size=2, seq_len=32, device=DEVICES["h100"], mfu=0.5,
        p2p=dataclasses.replace(LINKS["ib-ndr"], latency_us=0.0, gb_per_s=1e12),
        allreduce=dataclasses.replace(LINKS["ib-ndr"], gb_per_s=2e-3, latency_us=7.0),
        splits=splits, node_link=NODE,
    )  # fmt: skip


def compute_s(p: ClusterPlan) -> list[float]:
    """Each stage's forward + backward compute of one microbatch, whole (tp = 1)."""
    rate = p.device.peak_tflops * 1e12 * p.mfu
    return [3 * c.forward_flops / rate for c in stage_costs(p.model, 4, 32, 2)]


def test_the_mesh_puts_tp_innermost_and_an_ep_group_in_a_node_exactly_when_ep_tp_divides_it():
    assert [global_rank(0, 0, t, 4, 2) for t in range(2)] == [0, 1]  # tp: neighbours
    assert global_rank(0, 1, 0, 4, 2) == 2 and global_rank(1, 0, 0, 4, 2) == 8  # then dp, pp
    for tp, ep, dp, node in ((1, 2, 4, 8), (2, 4, 4, 8), (4, 4, 4, 8), (2, 3, 6, 8), (1, 4, 8, 2)):
        splits = Splits(tp=tp, ep=ep, gpus_per_node=node)
        nodes = [
            {global_rank(pp, g * ep + e, t, dp, tp) // node for e in range(ep)}
            for pp in range(3)
            for g in range(dp // ep)
            for t in range(tp)
        ]
        assert splits.ep_in_node == all(len(group) == 1 for group in nodes), (tp, ep, dp, node)


def test_tp_divides_a_gpus_flops_weights_activations_and_messages_by_hand():
    whole = stage_costs(SHAPE, 2, seq_len=32, microbatch_size=2, activation_checkpointing=True)
    for cost in whole:
        half = per_gpu(cost, Splits(tp=2))
        assert half.forward_flops == cost.forward_flops / 2
        assert half.weight_flops == cost.weight_flops / 2
        assert half.recompute_flops == cost.recompute_flops / 2
        assert half.parameters == cost.parameters / 2
        assert half.activation_bytes == cost.activation_bytes / 2
        assert half.recompute_bytes == cost.recompute_bytes / 2
        assert half.message_bytes == ACTIVATION / 2 == cost.message_bytes / 2
    # 1f1b's first rank: 18 bytes per parameter, P = 4 microbatches in flight, each half
    p, first = plan(Splits(tp=2)), stage_costs(SHAPE, 4, 32, 2)[0]
    held = first.parameters / 2 * 18 + 4 * first.activation_bytes / 2
    assert estimate(p, "1f1b").memory_gb[0] == pytest.approx(held / 1e9)
    whole = estimate(plan(), "1f1b").memory_gb[0]
    assert estimate(p, "1f1b").memory_gb[0] == pytest.approx(whole / 2)


def test_tp_adds_exactly_its_all_reduces_on_the_nodes_link():
    cost = stage_costs(SHAPE, 4, 32, 2)[0]
    assert tp_all_reduce_s(plan(), cost) == 0.0
    # ring all-reduce: latency + 2(tp-1)/tp of 8,192 bytes at 1 MB/s
    assert tp_all_reduce_s(plan(Splits(tp=2)), cost) == pytest.approx(3e-6 + 8192 / 1e6)
    four = plan(Splits(tp=4), dataclasses.replace(SHAPE, n_kv_heads=4))
    assert tp_all_reduce_s(four, cost) == pytest.approx(3e-6 + 1.5 * 8192 / 1e6)
    ar = 3e-6 + 8192 / 1e6
    for checkpointing in (False, True):
        p = dataclasses.replace(plan(Splits(tp=2)), activation_checkpointing=checkpointing)
        costs = stage_costs(SHAPE, 4, 32, 2, activation_checkpointing=checkpointing)
        rate = p.device.peak_tflops * 1e12 * p.mfu
        per_microbatch = []
        for c in costs:
            # 2 per block forward and backward, the embedding's forward, the head's backward,
            # and with checkpointing the forward's again in the backward
            count = 4 * c.blocks + c.embedding + c.head + 2 * c.blocks * checkpointing
            per_microbatch.append((3 * c.forward_flops + c.recompute_flops) / 2 / rate + count * ar)
        # 2bw runs at its slowest stage
        assert estimate(p, "2bw").step_s == pytest.approx(8 * max(per_microbatch), rel=1e-9)


def test_experts_are_split_over_ep_and_reduced_over_the_replicas_that_hold_them():
    first = stage_costs(MOE, 4, 32, 2)[0]
    experts = first.blocks * 3 * 64 * 64 * 4  # the routed experts: 3 matrices of 64 x 64, 4
    assert first.moe_blocks == first.blocks and first.expert_parameters == experts
    dense = first.parameters - experts
    shared = per_gpu(first, Splits(ep=2))
    assert shared.parameters == dense + experts / 2
    assert shared.forward_flops == first.forward_flops  # each GPU computes its tokens' experts
    # 1f1b, dp = 4, ep = 2, zero = 1: the dense weights' 12 bytes of state over 4 replicas, the
    # experts' over the 2 that hold each
    p = plan(Splits(ep=2), MOE, dp=4, zero=1)
    held = dense * (2 + 4 + 3) + experts / 2 * (2 + 4 + 6) + 4 * first.activation_bytes
    assert estimate(p, "1f1b").memory_gb[0] == pytest.approx(held / 1e9)


def test_an_experts_gradient_is_reduced_over_the_dp_over_ep_replicas_that_hold_it():
    # 1f1b waits for it after the step: ring all-reduces of FP32 gradients at 2 MB/s, the dense
    # weights' over 4 replicas (2·3/4 of 4 bytes), the experts' half over 2 (2·1/2 of 4 bytes)
    p = plan(Splits(ep=2), MOE, dp=4)
    sent = [
        (c.parameters - c.expert_parameters) * 6 + c.expert_parameters / 2 * 4
        for c in stage_costs(MOE, 4, 32, 2)
    ]
    assert estimate(p, "1f1b").exposed_dp_s == pytest.approx(max(sent) / 2e6)


def test_ep_adds_its_all_to_alls_on_the_link_its_group_spans():
    cost = stage_costs(MOE, 4, 32, 2)[0]
    in_node = plan(Splits(ep=2, gpus_per_node=8), MOE, dp=4)
    in_node = dataclasses.replace(in_node, allreduce=dataclasses.replace(NODE, gb_per_s=1e12))
    assert in_node.ep_link == NODE
    # half of k = 2 copies of the 8,192 bytes leave a GPU, at 1 MB/s
    a2a = 3e-6 + 0.5 * 2 * 8192 / 1e6
    assert ep_all_to_all_s(in_node, cost) == pytest.approx(a2a)
    across = plan(Splits(ep=4, gpus_per_node=2), MOE, dp=4)  # 4 replicas on 2 nodes
    assert across.ep_link == across.allreduce
    assert ep_all_to_all_s(across, cost) == pytest.approx(7e-6 + 0.75 * 2 * 8192 / 2e6)
    # dispatch and combine, forward and backward, per MoE block; dp's reduction is hidden
    per_microbatch = [
        s + 4 * c.moe_blocks * a2a
        for s, c in zip(compute_s(in_node), stage_costs(MOE, 4, 32, 2), strict=True)
    ]
    two = estimate(in_node, "2bw")
    assert two.exposed_dp_s == 0.0
    assert two.step_s == pytest.approx(8 * max(per_microbatch), rel=1e-9)


@pytest.mark.parametrize(
    ("splits", "model", "dp", "named"),
    [
        (Splits(tp=16), SHAPE, 1, ("--tp 16", "--gpus-per-node 8", "divides 8")),
        (Splits(tp=4, gpus_per_node=6), SHAPE, 1, ("--tp 4", "--gpus-per-node 6", "divides 6")),
        (Splits(tp=4), SHAPE, 1, ("--tp 4", "4 query", "2 key/value", "divides 2")),
        (Splits(ep=2), SHAPE, 2, ("--ep 2", "none", "--ep 1")),
        (Splits(ep=2), MOE, 3, ("--ep 2", "--dp (3)", "4 experts")),
        (Splits(ep=8), MOE, 8, ("--ep 8", "--dp (8)", "4 experts")),
    ],
)
def test_splits_that_cannot_run_are_refused_naming_the_fix(splits, model, dp, named):
    with pytest.raises(ConfigError) as refused:
        plan(splits, model, dp=dp)
    for words in named:
        assert words in str(refused.value)


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    return plan_cli.run(parser.parse_args(list(argv)))


SMALL = ("--preset", "small", "--seq-len", "256", "--stages", "2", "--microbatches", "4")


def test_gpus_checks_the_plan_and_names_the_dp_that_fits(capsys):
    with pytest.raises(ConfigError) as refused:
        cli(*SMALL, "--tp", "2", "--gpus", "8")
    assert "--gpus 8" in str(refused.value) and "= 4 GPUs" in str(refused.value)
    assert "use --dp 2" in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        cli(*SMALL, "--tp", "2", "--gpus", "6")
    assert "multiple of --stages x --tp = 4" in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        cli(*SMALL, "--gpus", "8", "--grid", "2,4")
    assert "--gpus" in str(refused.value) and "--grid" in str(refused.value)
    assert cli(*SMALL, "--tp", "2", "--grid", "2", "--grid-ratios", "1") == 0
    assert "tp=2 on NVLink 4" in capsys.readouterr().out.splitlines()[0]
    assert cli(*SMALL, "--tp", "2", "--dp", "2", "--gpus", "8", "--node-gbps", "100", "--json") == 0
    data = json.loads(capsys.readouterr().out)["plan"]
    assert (data["tp"], data["ep"], data["gpus"], data["gpus_per_node"]) == (2, 1, 8, 8)
    assert data["node_link"]["gb_per_s"] == 100


def test_the_title_names_the_splits_and_their_links(capsys):
    assert cli("--preset", "cpu-moe", "--vocab-size", "256", "--seq-len", "128", "--stages", "2",
               "--microbatches", "4", "--dp", "4", "--tp", "2", "--ep", "4", "--gpus", "16",
               "--gpus-per-node", "4") == 0  # fmt: skip
    title = capsys.readouterr().out.splitlines()[0]
    assert "16 GPUs: tp=2 on NVLink 4 (450 GB/s)" in title
    assert "ep=4 on InfiniBand NDR 400 Gb/s (50 GB/s)" in title  # 4 x 2 GPUs: across nodes


LLAMA3_405B_ON_128 = (
    "--preset", "llama3-405b", "--seq-len", "8192", "--stages", "16", "--microbatches", "32",
    "--activation-checkpointing", "--json",
)  # fmt: skip


@pytest.mark.slow
def test_llama3_405b_fits_80_gb_under_2bw_with_tp_8_and_not_without(capsys):
    """docs/schedules.md's plan: 16 stages x tp 8 on 128 H100s."""
    assert cli(*LLAMA3_405B_ON_128, "--tp", "8", "--gpus", "128") == 0
    data = json.loads(capsys.readouterr().out)
    two = next(p for p in data["predictions"] if p["schedule"] == "2bw")
    assert max(two["memory_gb"]) <= 80 and two["largest_llama3_that_fits"] == "llama3-405b"
    assert data["best"] == "2bw"
    assert cli(*LLAMA3_405B_ON_128, "--gpus", "16") == 0
    data = json.loads(capsys.readouterr().out)
    two = next(p for p in data["predictions"] if p["schedule"] == "2bw")
    assert max(two["memory_gb"]) > 400 and data["best"] is None
