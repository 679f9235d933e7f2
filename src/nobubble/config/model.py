"""The model: a preset and the keys that override its shape, where its weights start, and how
each stage runs (activation checkpointing, compile).
"""

from __future__ import annotations

from dataclasses import dataclass

from nobubble.config.fields import FREE, NON_NEGATIVE, POSITIVE, setting


@dataclass
class ModelSettings:
    preset: str = setting("tiny", "model preset", registry="preset")
    n_layers: int | None = setting(None, "override the preset's number of blocks", POSITIVE)
    d_model: int | None = setting(None, "override the preset's hidden size", POSITIVE)
    n_heads: int | None = setting(None, "override the preset's attention heads", POSITIVE)
    n_kv_heads: int | None = setting(None, "override the preset's key/value heads (GQA)", POSITIVE)
    d_ff: int | None = setting(None, "override the preset's MLP hidden size", POSITIVE)
    max_seq_len: int | None = setting(
        None, "override the preset's maximum sequence length", POSITIVE
    )
    tie_embeddings: bool | None = setting(None, "override whether the head shares the embedding")
    rope_theta: float | None = setting(None, "override the preset's RoPE base", POSITIVE)
    norm_eps: float | None = setting(None, "override the RMSNorm epsilon (default 1e-5)", POSITIVE)
    moe_experts: int | None = setting(
        None, "routed experts of each MoE block (0: dense model; docs/moe.md)", NON_NEGATIVE
    )
    moe_top_k: int | None = setting(None, "experts each token is routed to", POSITIVE)
    moe_shared_experts: int | None = setting(
        None, "shared experts every token passes through, besides its routed ones", NON_NEGATIVE
    )
    moe_d_ff: int | None = setting(None, "each expert's hidden size (default d_ff)", POSITIVE)
    moe_layers: list[int] | None = setting(
        None, "the blocks that are MoE, e.g. [1, 2, 3] (default: every block)", NON_NEGATIVE
    )
    moe_capacity_factor: float | None = setting(
        None,
        "an expert takes at most this factor times its even share of a microbatch's "
        "assignments, dropping the rest (0: dropless, the default)",
        NON_NEGATIVE,
    )
    moe_aux_coef: float | None = setting(
        None, "coefficient of the load-balancing auxiliary loss (default 0.01)", NON_NEGATIVE
    )
    moe_bias_rate: float | None = setting(
        None,
        "auxiliary-loss-free balancing: the per-step update of the routing bias (DeepSeek-V3 "
        "used 0.001; default 0, off)",
        NON_NEGATIVE,
    )
    vocab_size: int | None = setting(
        None,
        "override the vocabulary size (default: the preset's, else the tokenizer's rounded up to "
        "64); at least the tokenizer's",
        POSITIVE,
    )
    init_from: str | None = setting(
        None,
        "start from the weights of a local Hugging Face Llama checkpoint folder (config.json + "
        "safetensors); the shape must match the model's (see docs/export.md)",
        resume=FREE,
    )
    activation_checkpointing: bool = setting(
        False,
        "recompute each block's activations in the backward instead of keeping them",
        resume=FREE,
    )
    compile: bool = setting(
        False, "torch.compile each stage (see docs/training.md for parity)", resume=FREE
    )
