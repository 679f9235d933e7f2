"""Model FLOPs per token and MFU (model FLOPs utilization), from the model's shape.

For the decoder of :mod:`nobubble.model` (d = d_model, L = n_layers, H query heads and H_kv
key/value heads of size d_h = d/H, MLP width f, vocabulary V) and a training sequence of T
tokens, one token's forward pass multiplies:

- per block, attention projections: q and o are d x (H d_h), k and v are d x (H_kv d_h);
  SwiGLU: gate, up and down, three d x f matrices (an MoE block: its router, d x E, and the
  SwiGLUs of the k experts a token is routed to and of the shared experts: active weights);
- the scores and the weighted sum of attention: each query head (GQA shares key/value heads,
  it does not shrink this) takes a dot product of length d_h with T keys, and sums T values of
  size d_h: 2 T H d_h multiply-adds;
- the head, d x V, whether or not it shares its weight with the embedding.

A multiply-add is 2 FLOPs; the backward pass computes the gradient of each matmul's input and of
its weight, twice the forward. So, with N the number of weights in matmuls (embedding lookup
excluded)::

    N = L (2 d d_h (H + H_kv) + 3 d f) + d V
    FLOPs per token = 3 (2 N + 4 L H d_h T) = 6 N + 12 L H d_h T

The embedding lookup is a gather (no FLOPs); norms, RoPE, SiLU, softmax, residual adds and the
loss are elementwise (O(d) per token against the matmuls' O(d^2)) and not counted. Attention is
counted over all T keys, as in PaLM's MFU (Chowdhery et al. 2022, appendix B): a causal kernel
computes about half of the score matrix, so the count is what the non-causal product costs.
Activation recomputation is not counted (model FLOPs, not hardware FLOPs).

MFU = FLOPs per token x tokens per second / (peak FLOP/s of one device x devices in use).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from nobubble.model.presets import ModelConfig

# Dense (no 2:4 sparsity) BF16 tensor-core peaks, TFLOP/s: NVIDIA's datasheets give them "with
# sparsity", twice the dense figure: H100 SXM and H200 SXM 1,979; H100 PCIe 1,513; H100 NVL and
# H200 NVL 1,671; A100 (SXM and PCIe, 40 and 80 GB) 624; L4 242. Matched against
# torch.cuda.get_device_name() in this order (the first match wins).
PEAK_BF16_TFLOPS: tuple[tuple[str, str, float], ...] = (
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe", 756.5),
    (r"\bH[12]00\b.*\bNVL\b", "H100/H200 NVL", 835.5),
    (r"\bH100\b", "H100 SXM", 989.5),
    (r"\bH200\b", "H200 SXM", 989.5),
    (r"\bA100\b", "A100", 312.0),
    (r"\bL4\b", "L4", 121.0),
)


def block_matmul_weights(mc: ModelConfig, block: int) -> int:
    """The weights a token's activations meet in block ``block``: its attention projections and
    its SwiGLU, or in an MoE block its router and the experts it is routed to (k of them, and
    the shared ones), not every expert."""
    d = mc.d_model
    attention = 2 * d * mc.head_dim * (mc.n_heads + mc.n_kv_heads)
    if not mc.is_moe(block):
        return attention + 3 * d * mc.d_ff
    active = mc.moe_top_k + mc.moe_shared_experts
    return attention + 3 * d * mc.expert_width * active + d * mc.moe_experts


def matmul_weights(mc: ModelConfig) -> int:
    """N: the weights a token's activations are multiplied by (the embedding table excluded,
    the head included, tied or not)."""
    blocks = sum(block_matmul_weights(mc, i) for i in range(mc.n_layers))
    return blocks + mc.d_model * mc.vocab_size


def block_flops(mc: ModelConfig, block: int, seq_len: int) -> int:
    """Model FLOPs of training one token through block ``block`` (forward + backward)."""
    attention = 4 * mc.n_heads * mc.head_dim * seq_len  # forward, per token
    return 3 * (2 * block_matmul_weights(mc, block) + attention)


def head_flops(mc: ModelConfig) -> int:
    """Model FLOPs of training one token through the head (forward + backward)."""
    return 3 * 2 * mc.d_model * mc.vocab_size


def flops_per_token(mc: ModelConfig, seq_len: int) -> int:
    """Model FLOPs of training on one token (forward + backward) in sequences of ``seq_len``;
    the embedding's lookup counts none."""
    blocks = sum(block_flops(mc, i, seq_len) for i in range(mc.n_layers))
    return blocks + head_flops(mc)


def table_peak(device_name: str) -> tuple[str, float] | None:
    """(the table's name, dense BF16 TFLOP/s) of a GPU named ``device_name``, if known."""
    for pattern, name, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return name, tflops
    return None


@dataclass(frozen=True)
class Utilization:
    """How a throughput in tokens per second turns into model TFLOP/s and MFU."""

    flops_per_token: int
    devices: int
    peak_tflops: float | None  # of one device; None: unknown (no MFU)
    peak_source: str  # where the peak came from, or why there is none

    def model_tflops(self, tokens_per_s: float) -> float:
        """Model TFLOP/s achieved, all devices together."""
        return self.flops_per_token * tokens_per_s / 1e12

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilization in [0, 1], or None when no peak is known."""
        if self.peak_tflops is None:
            return None
        return self.model_tflops(tokens_per_s) / (self.peak_tflops * self.devices)


def utilization(
    mc: ModelConfig, seq_len: int, device: torch.device, devices: int, peak_tflops: float | None
) -> Utilization:
    """The run's :class:`Utilization`: ``peak_tflops`` (one device) if given, else the table's
    figure for this CUDA device; on a CPU or an unknown GPU no peak (and no MFU)."""
    fpt = flops_per_token(mc, seq_len)
    if peak_tflops is not None:
        return Utilization(fpt, devices, peak_tflops, "peak_tflops")
    if device.type != "cuda":
        return Utilization(fpt, devices, None, f"no peak known on {device.type}: set peak_tflops")
    name = torch.cuda.get_device_name(device)
    known = table_peak(name)
    if known is None:
        return Utilization(fpt, devices, None, f"{name} not in the table: set peak_tflops")
    return Utilization(fpt, devices, known[1], f"{name}: {known[0]} dense BF16")
