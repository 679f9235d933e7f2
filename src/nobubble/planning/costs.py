"""What one stage costs: compute time per microbatch, message size, weights and activations.

Compute follows nobubble.flops (matmul FLOPs, backward twice the forward, attention over all T
keys) at a stated MFU; a split backward's weight-gradient half (W) is half of it, the share of
the matmuls' weight gradients. Memory is counted in bytes per parameter and per activation:

* weights, gradients and optimizer state: mixed-precision AdamW as Megatron-LM keeps it, 2 bytes
  per BF16 weight copy (one per weight version the schedule holds), 4 for the FP32 gradient and
  12 for the FP32 master weight and Adam's two moments;
* activations per block and microbatch: 34·s·b·h bytes in 16 bits (Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models", 2022, without recomputation, with an
  attention kernel that stores no s×s scores); the last stage also holds its logits in FP32
  (4·s·b·V bytes);
* a message between stages is one activation (or its gradient), s·b·h 16-bit numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from nobubble.model import ModelConfig, partition

BYTES_PER_WEIGHT_VERSION = 2
BYTES_STATE_PER_PARAMETER = 4 + 12  # FP32 gradient; FP32 master weight + Adam's m and v
ACTIVATION_BYTES_PER_BLOCK_TOKEN_WIDTH = 34
LOGIT_BYTES = 4
MESSAGE_BYTES = 2


@dataclass(frozen=True)
class StageCost:
    blocks: int
    embedding: bool
    head: bool
    forward_flops: float  # per microbatch
    parameters: int
    activation_bytes: float  # per microbatch in flight
    message_bytes: float


def stage_costs(
    mc: ModelConfig, stages: int, seq_len: int, microbatch_size: int
) -> list[StageCost]:
    """The model cut into ``stages`` stages as nobubble.model.partition cuts it."""
    d, dh, f, vocab = mc.d_model, mc.head_dim, mc.d_ff, mc.vocab_size or 0
    tokens = seq_len * microbatch_size
    block_weights = 2 * d * dh * (mc.n_heads + mc.n_kv_heads) + 3 * d * f
    block_flops = 2 * block_weights + 4 * mc.n_heads * dh * seq_len  # per token, forward
    costs = []
    for spec in partition(mc.n_layers, stages):
        blocks = len(spec.blocks)
        flops = blocks * block_flops + (2 * d * vocab if spec.has_head else 0)
        params = blocks * (block_weights + 2 * d) + (d * vocab if spec.has_embed else 0)
        if spec.has_head:  # a tied head on another stage than the embedding holds its own copy
            params += d + (0 if mc.tie_embeddings and spec.has_embed else d * vocab)
        activations = blocks * ACTIVATION_BYTES_PER_BLOCK_TOKEN_WIDTH * tokens * d
        activations += LOGIT_BYTES * tokens * vocab if spec.has_head else 0
        costs.append(
            StageCost(
                blocks=blocks,
                embedding=spec.has_embed,
                head=spec.has_head,
                forward_flops=flops * tokens,
                parameters=params,
                activation_bytes=activations,
                message_bytes=MESSAGE_BYTES * tokens * d,
            )
        )
    return costs
