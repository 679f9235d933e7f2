"""The mixture-of-experts layer against hand computation, and its statistics, config and optimizer
routing (docs/moe.md). Pipeline parity and resume: test_pipeline_parity.py, test_moe_pipeline.py."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from nobubble.config import ConfigError, TrainConfig
from nobubble.model.flops import matmul_weights
from nobubble.model.layers import Stage, build_model, lm_loss
from nobubble.model.moe import MoE, balance_routers, grouped_dispatch, routing_metrics
from nobubble.model.partition import StageSpec
from nobubble.model.presets import PRESETS
from nobubble.model.resolve import model_config
from nobubble.optim.expert_muon import ExpertMuon
from nobubble.optim.muon import Muon
from nobubble.optim.param_groups import Kind, classify
from nobubble.planning.costs import stage_costs


def layer(experts=3, top_k=1, capacity=0.0, aux=0.0, d=4, f=3, seed=0) -> MoE:
    mc = dataclasses.replace(
        PRESETS["tiny"],
        d_model=d,
        moe_experts=experts,
        moe_top_k=top_k,
        moe_d_ff=f,
        moe_capacity_factor=capacity,
        moe_aux_coef=aux,
    )
    moe = MoE(mc, shared=None)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return moe


def by_hand(moe: MoE, x: torch.Tensor, keep: set[tuple[int, int]] | None = None) -> torch.Tensor:
    """Token by token: softmax, top-k, gates renormalized when k > 1, each chosen expert's
    SwiGLU; an assignment (token, expert) outside ``keep`` adds nothing."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = (moe.router.weight @ x[t]).softmax(-1)
        chosen = sorted(range(moe.experts), key=lambda e: -probs[e].item())[: moe.top_k]
        total = sum(probs[e] for e in chosen) if moe.top_k > 1 else 1.0
        for e in chosen:
            if keep is not None and (t, e) not in keep:
                continue
            hidden = F.silu(moe.w_gate[e] @ x[t]) * (moe.w_up[e] @ x[t])
            out[t] += probs[e] / total * (moe.w_down[e] @ hidden)
    return out


@pytest.mark.parametrize("top_k", [1, 2])
def test_routing_equals_the_token_by_token_computation_and_its_gradients(top_k):
    moe = layer(experts=3, top_k=top_k)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = moe(x)
    expected = by_hand(moe, x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    weights = [x, moe.router.weight, moe.w_gate, moe.w_up, moe.w_down]
    grads = torch.autograd.grad(out.square().sum(), weights)
    hand = torch.autograd.grad(expected.square().sum(), weights)
    for g, h in zip(grads, hand, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-6)


def test_capacity_drops_the_least_likely_assignments_of_a_full_expert():
    moe = layer(experts=2, top_k=1, capacity=0.5)  # at most ceil(0.5 * 6 / 2) = 2 per expert
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        probs = (x @ moe.router.weight.T).softmax(-1)
    choice = probs.argmax(-1)
    keep = set()
    for e in range(2):
        mine = [t for t in range(6) if choice[t] == e]
        mine.sort(key=lambda t: -probs[t, e].item())
        keep |= {(t, e) for t in mine[:2]}
    out = moe(x)
    torch.testing.assert_close(out, by_hand(moe, x, keep), rtol=1e-5, atol=1e-6)
    assert moe.take_routing().abs().sum() == 0  # only a backward records
    out.sum().backward()
    sums = moe.take_routing()
    assert sums[:2].tolist() == [sum(choice == 0).item(), sum(choice == 1).item()]
    assert sums[2].item() == 6 - len(keep)  # dropped


def test_the_balance_loss_gradient_is_the_hand_derived_one():
    """aux = E Σₑ fₑ Pₑ with fₑ fixed by the choice: d aux / d logitsₜ = (E/n) Jₜᵀ f, where Jₜ is
    the softmax Jacobian of token t; the router's weight gradient is Σₜ (that) xₜᵀ, times the
    coefficient and the microbatch's share of the loss."""
    moe = layer(experts=3, top_k=2, aux=0.3)
    moe.loss_scale = 0.25
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    out = moe(x)
    out.backward(torch.zeros_like(out))  # only the auxiliary loss sends a gradient
    with torch.no_grad():
        probs = (x @ moe.router.weight.T).softmax(-1)
        chosen = probs.topk(2, dim=-1).indices
        f = torch.bincount(chosen.reshape(-1), minlength=3).float() / (5 * 2)
        expected = torch.zeros_like(moe.router.weight)
        for t in range(5):
            jacobian = torch.diag(probs[t]) - torch.outer(probs[t], probs[t])
            expected += torch.outer(3 / 5 * jacobian.T @ f, x[t])
    torch.testing.assert_close(moe.router.weight.grad, 0.3 * 0.25 * expected)
    assert moe.w_gate.grad is None or moe.w_gate.grad.abs().max() == 0


def test_bias_balancing_moves_the_bias_against_the_load():
    params = {"blocks.2.mlp.balance_bias": torch.zeros(4), "blocks.2.mlp.w_up": torch.ones(2)}
    loads = torch.tensor([10.0, 2.0, 4.0, 0.0, 1, 2, 3, 4, 5], dtype=torch.float64)  # mean 4
    balance_routers(params, {2: loads}, rate=0.5)
    assert params["blocks.2.mlp.balance_bias"].tolist() == [-0.5, 0.5, 0.0, 0.5]
    assert params["blocks.2.mlp.w_up"].tolist() == [1.0, 1.0]


def test_the_bias_steers_the_choice_but_not_the_gate():
    moe = layer(experts=2, top_k=1)
    moe.balance_bias = torch.nn.Parameter(torch.tensor([0.0, 5.0]), requires_grad=False)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(4))
    out = moe(x)
    probs = (x @ moe.router.weight.T).softmax(-1)
    hidden = F.silu(x @ moe.w_gate[1].T) * (x @ moe.w_up[1].T)
    torch.testing.assert_close(out, probs[:, 1:] * (hidden @ moe.w_down[1].T))


def test_statistics_count_each_trained_microbatch_once(tiny_mc):
    """Recorded by the backward: evaluation adds nothing, activation recomputation adds nothing
    twice."""
    mc = dataclasses.replace(tiny_mc, moe_experts=4, moe_top_k=2, moe_layers=(1, 3))
    model = build_model(mc, seed=0)
    tokens = torch.randint(0, mc.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(tokens)
    assert all(row.abs().sum() == 0 for row in model.take_routing().values())
    model.activation_checkpointing = True
    model(tokens).sum().backward()
    routing = model.take_routing()
    assert sorted(routing) == [1, 3]
    for row in routing.values():
        assert row[:4].sum().item() == 2 * 8 * 2  # tokens x top_k
        assert row[-2:].tolist() == [1.0, 16.0]  # one microbatch, 16 tokens
    metrics = routing_metrics(routing)
    assert metrics["moe_dropped"] == 0
    assert 0 < metrics["moe_entropy"] <= math.log(4) + 1e-6
    assert sorted(metrics["moe_load"]) == ["1", "3"]
    assert sum(metrics["moe_load"]["1"]) == pytest.approx(1)


def test_routing_metrics_on_a_known_table():
    # 2 experts; loads 6 and 2; 1 dropped; entropy 4 over 4 tokens; aux 3 over 2 microbatches
    table = torch.tensor([6.0, 2.0, 1.0, 4.0, 3.0, 2.0, 4.0], dtype=torch.float64)
    metrics = routing_metrics({5: table})
    assert metrics == {
        "moe_aux": 1.5,
        "moe_dropped": 1 / 8,
        "moe_entropy": 1.0,
        "moe_max_violation": 0.5,
        "moe_load": {"5": [0.75, 0.25]},
    }


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_expert_muon_is_muon_on_each_expert_matrix(ns_dtype):
    """Against nobubble's Muon in the same dtype (in bfloat16 that is torch's Muon bitwise:
    tests/test_muon.py)."""
    gen = torch.Generator().manual_seed(5)
    stacked = torch.nn.Parameter(torch.randn(3, 6, 4, generator=gen))
    alone = [torch.nn.Parameter(stacked[e].detach().clone()) for e in range(3)]
    settings = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    ours = ExpertMuon([stacked], ns_dtype=ns_dtype, **settings)
    reference = Muon(alone, ns_dtype=ns_dtype, **settings)
    for _ in range(3):
        grad = torch.randn(3, 6, 4, generator=gen)
        stacked.grad = grad.clone()
        for e, p in enumerate(alone):
            p.grad = grad[e].clone()
        ours.step()
        reference.step()
    for e in range(3):
        assert torch.equal(stacked[e], alone[e])


def test_experts_and_routers_are_routed_explicitly():
    assert classify("blocks.0.mlp.w_up", torch.zeros(4, 3, 2)) is Kind.EXPERT
    assert classify("blocks.0.mlp.router.weight", torch.zeros(4, 2)) is Kind.ROUTER
    assert classify("blocks.0.mlp.shared.w_up.weight", torch.zeros(4, 2)) is Kind.HIDDEN


def test_the_cpu_preset_matches_the_dense_study_model_in_active_parameters():
    moe = PRESETS["cpu-moe"]
    dense = dataclasses.replace(moe, moe_experts=0)
    moe, dense = (dataclasses.replace(m, vocab_size=320) for m in (moe, dense))
    router = moe.n_layers * moe.moe_experts * moe.d_model
    assert matmul_weights(moe) == matmul_weights(dense) + router


def test_the_2b_preset_has_about_2b_parameters():
    mc = PRESETS["moe-2b"]
    with torch.device("meta"):
        model = Stage(mc, StageSpec(0, range(mc.n_layers), True, True))
    assert 1.9e9 < sum(p.numel() for p in model.parameters()) < 2.1e9


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"moe_experts": 4, "moe_top_k": 5}, "moe_top_k=5"),
        ({"moe_experts": 4, "moe_layers": [0, 9]}, r"moe_layers lists blocks \[9\]"),
        ({"moe_experts": 4, "moe_layers": []}, "moe_layers is empty"),
    ],
)
def test_inconsistent_moe_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        model_config(TrainConfig(**overrides), tokenizer_vocab=257)


def test_the_auxiliary_losses_of_every_block_join_the_models_gradient(tiny_mc):
    """With α > 0 the plain backward of the language-model loss gives the gradient of
    lm + α Σ_blocks aux, the auxiliary losses written out explicitly (from the routers' outputs)
    on a copy of the model without them: the gradient reaches every block and the embedding."""
    mc = dataclasses.replace(tiny_mc, moe_experts=4, moe_top_k=2, moe_aux_coef=0.5)
    tapped = build_model(mc, seed=1)
    explicit = build_model(dataclasses.replace(mc, moe_aux_coef=0.0), seed=1)
    logits: list[torch.Tensor] = []
    for layer in explicit.moe_layers():
        layer.router.register_forward_hook(lambda m, args, out: logits.append(out))
    tokens = torch.randint(0, mc.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    lm_loss(tapped(tokens[:, :-1]), tokens[:, 1:]).backward()
    loss = lm_loss(explicit(tokens[:, :-1]), tokens[:, 1:])
    for out in logits:
        probs = out.float().softmax(-1)
        counts = torch.bincount(probs.topk(2, dim=-1).indices.reshape(-1), minlength=4)
        f = counts / (probs.shape[0] * 2)  # shares of the n·k assignments
        loss = loss + 0.5 * 4 * (f * probs.mean(0)).sum()
    loss.backward()
    for (name, a), (_, b) in zip(
        tapped.named_parameters(), explicit.named_parameters(), strict=True
    ):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_the_cost_model_computes_with_active_weights_and_holds_every_expert():
    mc = dataclasses.replace(PRESETS["moe-2b"], moe_bias_rate=0.001)
    with torch.device("meta"):
        model = Stage(mc, StageSpec(0, range(mc.n_layers), True, True))
    (whole,) = stage_costs(mc, 1, seq_len=2048, microbatch_size=1)
    assert whole.parameters == sum(p.numel() for p in model.parameters())
    dense = dataclasses.replace(mc, moe_experts=0, moe_bias_rate=0.0)
    (dense_whole,) = stage_costs(dense, 1, seq_len=2048, microbatch_size=1)
    router_flops = 2 * mc.n_layers * mc.moe_experts * mc.d_model * 2048
    assert whole.forward_flops == dense_whole.forward_flops + router_flops


def dispatched(moe: MoE, dtype: torch.dtype, grouped: bool) -> list[torch.Tensor]:
    """The expert outputs, loads and drops of 10 tokens routed 2 each, expert 1 chosen by none,
    then the gradients of a weighted sum of the outputs for the tokens and the expert weights."""
    gen = torch.Generator().manual_seed(6)
    flat = torch.randn(10, moe.w_gate.shape[2], generator=gen, requires_grad=True)
    expert_of = torch.tensor([0, 2] * 7 + [2, 3] * 3)
    priority = torch.rand(20, generator=gen)
    moe.zero_grad(set_to_none=True)
    out, loads, dropped = moe._experts(flat, expert_of, priority, dtype, grouped)
    (out.float() * torch.randn(out.shape, generator=gen)).sum().backward()
    return [out, loads, dropped, flat.grad, moe.w_gate.grad, moe.w_up.grad, moe.w_down.grad]


@pytest.mark.parametrize("capacity", [0.0, 0.75], ids=["dropless", "capacity"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_gemm_dispatch_equals_the_loop_bitwise(capacity, dtype):
    """Outputs, loads, drops and gradients: loads 7, 0, 10, 3 and with a capacity of
    ⌈0.75·20/4⌉ = 4 nine drops. Uninitialized memory is NaN here (deterministic mode), so rows
    the grouped GEMM leaves unwritten (past the last group, the dropped ones) would show."""
    moe = layer(experts=4, top_k=2, capacity=capacity, d=8, f=16)
    torch.use_deterministic_algorithms(True)
    try:
        grouped, looped = dispatched(moe, dtype, True), dispatched(moe, dtype, False)
    finally:
        torch.use_deterministic_algorithms(False)
    assert grouped[1].tolist() == [7, 0, 10, 3]
    assert grouped[2].item() == (9 if capacity else 0)
    assert grouped[0].dtype == dtype and not grouped[0].isnan().any()
    names = ["out", "loads", "dropped", "x", "gate", "up", "down"]
    for a, b, name in zip(grouped, looped, names, strict=True):
        assert torch.equal(a, b), name


class Looped(Exception):
    """Raised in place of the loop's dispatch."""


def test_a_layer_takes_the_grouped_gemm_in_bfloat16_with_aligned_widths(monkeypatch):
    def loop(*args):
        raise Looped

    monkeypatch.setattr(MoE, "_looped", loop)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(d=8, f=16)(x).sum().backward()  # grouped: never reaches the loop
        with pytest.raises(Looped):
            layer(d=8, f=12)(x)  # 12 bfloat16 values are 24 bytes: a stride off 16 bytes
    with pytest.raises(Looped):
        layer(d=8, f=16)(x)  # float32


@pytest.mark.parametrize(
    ("device", "major", "dtype", "widths", "grouped"),
    [
        ("cpu", None, torch.bfloat16, (8, 16), True),
        ("cpu", None, torch.float32, (8, 16), False),
        ("cpu", None, torch.bfloat16, (8, 20), False),
        ("cpu", None, torch.bfloat16, (12, 16), False),
        ("cuda", 9, torch.bfloat16, (960, 1280), True),  # H100: torch's grouped kernel
        ("cuda", 10, torch.bfloat16, (960, 1280), True),
        ("cuda", 8, torch.bfloat16, (960, 1280), False),  # A100: torch would copy the offsets
        ("cuda", 9, torch.float32, (960, 1280), False),
    ],
)
def test_the_dispatch_rule(monkeypatch, device, major, dtype, widths, grouped):
    """Which dispatch a layer takes (docs/moe.md): a stand-in for a GPU's properties."""
    properties = type("Properties", (), {"major": major})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: properties)
    monkeypatch.setattr(torch.version, "hip", None)
    assert grouped_dispatch(*widths, torch.device(device), dtype) is grouped
