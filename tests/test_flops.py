"""Model FLOPs per token and MFU: counted by hand, and against torch's FLOP counter."""

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from nobubble.model.flops import (
    Utilization,
    flops_per_token,
    matmul_weights,
    table_peak,
    utilization,
)
from nobubble.model.layers import build_model, lm_loss
from nobubble.model.presets import PRESETS

# d=64, L=2, H=4 query heads and 2 key/value heads of 16, f=128, V=96
SHAPE = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64)


def tiny(tie: bool = False):
    return dataclasses.replace(PRESETS["tiny"], **SHAPE, vocab_size=96, tie_embeddings=tie)


def test_flops_per_token_counted_by_hand():
    # every matmul of one token's forward, as (inputs, outputs) of the weight it multiplies by
    q, k, v, o = (64, 64), (64, 32), (64, 32), (64, 64)  # 2 kv heads x 16
    gate, up, down = (64, 128), (64, 128), (128, 64)
    head = (64, 96)
    block = [q, k, v, o, gate, up, down]
    weights = 2 * sum(a * b for a, b in block) + 64 * 96
    assert matmul_weights(tiny()) == weights == 2 * 36864 + 6144
    # attention at T=32: q.k over 32 keys and the sum of 32 values, 16 wide, 4 query heads
    attention = 2 * (2 * 32 * 16 * 4 + 2 * 32 * 16 * 4)
    forward = 2 * weights + attention  # a multiply-add is 2 FLOPs
    assert flops_per_token(tiny(), seq_len=32) == 3 * forward == 3 * (2 * 79872 + 16384)
    # tying the head to the embedding changes no matmul: the lookup is a gather
    assert flops_per_token(tiny(tie=True), seq_len=32) == 3 * forward
    assert head == (64, 96)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_flop_counter_of_a_real_forward_and_backward_agrees_exactly(tie):
    """torch's FlopCounterMode counts matmuls (mm, bmm); with the math attention backend the
    attention is two bmms forward and four backward, all counted: the totals are equal."""
    mc = tiny(tie)
    model = build_model(mc)
    tokens = torch.randint(0, 96, (3, 33))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    assert counter.get_total_flops() == flops_per_token(mc, seq_len=32) * 3 * 32


def test_known_gpus_have_their_dense_bf16_peak():
    assert table_peak("NVIDIA H100 80GB HBM3") == ("H100 SXM", 989.5)
    assert table_peak("NVIDIA H100 PCIe") == ("H100 PCIe", 756.5)
    assert table_peak("NVIDIA H200") == ("H200 SXM", 989.5)
    assert table_peak("NVIDIA H200 NVL") == ("H100/H200 NVL", 835.5)
    assert table_peak("NVIDIA A100-SXM4-80GB") == ("A100", 312.0)
    assert table_peak("NVIDIA L4") == ("L4", 121.0)
    assert table_peak("NVIDIA L40S") is None  # not an L4
    assert table_peak("NVIDIA GeForce RTX 3090") is None


def test_mfu_is_model_flops_over_the_peak_of_every_device():
    usage = utilization(tiny(), 32, torch.device("cpu"), devices=4, peak_tflops=2.0)
    assert usage.peak_source == "peak_tflops"
    tokens_per_s = 1e6
    assert usage.model_tflops(tokens_per_s) == pytest.approx(flops_per_token(tiny(), 32) / 1e6)
    assert usage.mfu(tokens_per_s) == pytest.approx(usage.model_tflops(tokens_per_s) / 8.0)


def test_on_cpu_without_a_peak_there_is_no_mfu():
    usage = utilization(tiny(), 32, torch.device("cpu"), devices=1, peak_tflops=None)
    assert usage == Utilization(flops_per_token(tiny(), 32), 1, None, usage.peak_source)
    assert "set peak_tflops" in usage.peak_source and usage.mfu(1e6) is None
