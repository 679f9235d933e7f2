"""What one stage costs: compute time per microbatch, message size, weights and activations.

Compute follows nobubble.model.flops (matmul FLOPs, backward twice the forward, attention over all T
keys) at a stated MFU; a split backward's weight-gradient part (W) is the matmuls' weight
gradients, as many FLOPs as their forward, so the attention's backward (scores and weighted
sum, which have no weights) is all in I. On the CPU benchmark W measured a third of the backward
(docs/benchmarks.md), below this FLOP share (0.42 there): the rest of I is not matmuls.
Memory is counted in bytes per parameter and per activation:

* weights, gradients and optimizer state: mixed-precision AdamW as Megatron-LM keeps it, 2 bytes
  per BF16 weight copy (one per weight version the schedule holds), 4 for the FP32 gradient and
  12 for the FP32 master weight and Adam's two moments (the state that ``zero`` > 0 shares out
  over the data-parallel replicas: nobubble.planning.estimate);
* activations per block and microbatch: 34·s·b·h bytes in 16 bits (Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models", 2022, without recomputation, with an
  attention kernel that stores no s×s scores); the last stage also holds its logits in FP32
  (4·s·b·V bytes). With activation checkpointing a block keeps only its input, 2·s·b·h bytes,
  and recomputes the rest in the backward (one more forward of the blocks; while one block is
  recomputed its 34·s·b·h bytes live, once per stage: ``recompute_bytes``);
* a message between stages is one activation (or its gradient), s·b·h 16-bit numbers.

Split over ``tp`` GPUs (:func:`per_gpu`, Megatron-style tensor parallelism with sequence
parallelism: nobubble.planning.mesh) a stage's FLOPs, weights, activations and messages are each
GPU's 1/tp; its routed experts, split over ``ep`` replicas as well, 1/(tp·ep).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nobubble.model.flops import block_matmul_weights
from nobubble.model.partition import flop_costs, partition
from nobubble.model.presets import ModelConfig
from nobubble.planning.mesh import Splits

BYTES_PER_WEIGHT_VERSION = 2
BYTES_GRADIENT = 4  # FP32
BYTES_OPTIMIZER_STATE = 12  # FP32 master weight + Adam's m and v
ACTIVATION_BYTES_PER_BLOCK_TOKEN_WIDTH = 34
CHECKPOINTED_BYTES_PER_BLOCK_TOKEN_WIDTH = 2  # the block's input, 16 bits
LOGIT_BYTES = 4
MESSAGE_BYTES = 2


@dataclass(frozen=True)
class StageCost:
    blocks: int
    embedding: bool
    head: bool
    forward_flops: float  # per microbatch
    weight_flops: float  # the weight-gradient matmuls of one microbatch (W)
    parameters: float  # every one held, the routed experts' included
    activation_bytes: float  # per microbatch in flight
    message_bytes: float
    recompute_flops: float = 0.0  # activation checkpointing: the blocks' forward, again
    recompute_bytes: float = 0.0  # the activations of the one block being recomputed
    moe_blocks: int = 0
    expert_parameters: float = 0.0  # the routed experts' (expert parallelism splits them)


def stage_costs(
    mc: ModelConfig,
    stages: int,
    seq_len: int,
    microbatch_size: int,
    activation_checkpointing: bool = False,
) -> list[StageCost]:
    """The model cut into ``stages`` stages as ``partition=flops`` cuts it (the embedding and
    the head by their FLOPs, the most even of the fastest splits: nobubble.model.partition). An
    MoE block computes with its active weights (nobubble.model.flops) and holds all of its experts;
    its activations are counted as those of a dense block (the routed experts' inputs and
    hidden states, k copies of the token's, are not added)."""
    d, dh, vocab = mc.d_model, mc.head_dim, mc.vocab_size or 0
    tokens = seq_len * microbatch_size
    attention_flops = 4 * mc.n_heads * dh * seq_len  # per token, forward
    costs = []
    for spec in partition(mc.n_layers, stages, *flop_costs(mc, seq_len), even=True):
        blocks = len(spec.blocks)
        matmuls = sum(2 * block_matmul_weights(mc, i) for i in spec.blocks)
        matmuls += 2 * d * vocab if spec.has_head else 0
        flops = matmuls + attention_flops * blocks
        params = sum(block_parameters(mc, i) for i in spec.blocks)
        moe_blocks = sum(mc.is_moe(i) for i in spec.blocks)
        params += d * vocab if spec.has_embed else 0
        if spec.has_head:  # a tied head on another stage than the embedding holds its own copy
            params += d + (0 if mc.tie_embeddings and spec.has_embed else d * vocab)
        full = ACTIVATION_BYTES_PER_BLOCK_TOKEN_WIDTH * tokens * d  # one block's
        kept = CHECKPOINTED_BYTES_PER_BLOCK_TOKEN_WIDTH * tokens * d
        activations = blocks * (kept if activation_checkpointing else full)
        activations += LOGIT_BYTES * tokens * vocab if spec.has_head else 0
        block_flops = (flops - (2 * d * vocab if spec.has_head else 0)) * tokens
        costs.append(
            StageCost(
                blocks=blocks,
                embedding=spec.has_embed,
                head=spec.has_head,
                forward_flops=flops * tokens,
                weight_flops=matmuls * tokens,
                parameters=params,
                activation_bytes=activations,
                message_bytes=MESSAGE_BYTES * tokens * d,
                recompute_flops=block_flops if activation_checkpointing else 0.0,
                recompute_bytes=full if activation_checkpointing and blocks else 0.0,
                moe_blocks=moe_blocks,
                expert_parameters=moe_blocks * routed_expert_parameters(mc),
            )
        )
    return costs


def block_parameters(mc: ModelConfig, block: int) -> int:
    """The parameters block ``block`` holds: its matmul weights with every expert of an MoE
    block (and its balance bias), and its two norm gains."""
    d = mc.d_model
    held = block_matmul_weights(mc, block) + 2 * d
    if mc.is_moe(block):
        unused = mc.moe_experts - mc.moe_top_k  # experts a token does not meet, held anyway
        held += 3 * d * mc.expert_width * unused + (mc.moe_experts if mc.moe_bias_rate else 0)
    return held


def routed_expert_parameters(mc: ModelConfig) -> int:
    """The routed experts' weights of one MoE block (each a SwiGLU of ``expert_width``)."""
    return 3 * mc.d_model * mc.expert_width * mc.moe_experts


def per_gpu(cost: StageCost, splits: Splits) -> StageCost:
    """What one GPU of a stage split over ``splits.tp`` GPUs computes and holds: 1/tp of its
    FLOPs, weights, activations and messages (the attention's q/k/v and the MLP's gate/up split
    by columns, their outputs and down by rows, the embedding and the head by vocabulary, the
    norms and residuals by sequence; the norm gains and the router, under 0.01% of a block,
    counted as split too), and 1/(tp·ep) of its routed experts."""
    tp = splits.tp
    experts = cost.expert_parameters / (tp * splits.ep)
    return dataclasses.replace(
        cost,
        forward_flops=cost.forward_flops / tp,
        weight_flops=cost.weight_flops / tp,
        parameters=(cost.parameters - cost.expert_parameters) / tp + experts,
        expert_parameters=experts,
        activation_bytes=cost.activation_bytes / tp,
        message_bytes=cost.message_bytes / tp,
        recompute_flops=cost.recompute_flops / tp,
        recompute_bytes=cost.recompute_bytes / tp,
    )


def non_embedding_parameters(mc: ModelConfig) -> int:
    """The blocks' parameters (every expert of an MoE block): no embedding, head or final norm;
    the size the delay's scaling laws are fitted and read at (nobubble.delay_law)."""
    return sum(block_parameters(mc, i) for i in range(mc.n_layers))
