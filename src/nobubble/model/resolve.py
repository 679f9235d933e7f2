"""The model a configuration asks for: its preset, its overrides and the tokenizer's vocabulary.

Validation that needs the preset registry lives here, above it; the configuration schema knows no
presets.
"""

from __future__ import annotations

import dataclasses
import math

from nobubble.config import ConfigError, TrainConfig
from nobubble.model.presets import PRESETS, ModelConfig

# the settings of a model with experts (moe_experts decides whether it has any)
MOE_SETTINGS = ("moe_top_k", "moe_shared_experts", "moe_d_ff", "moe_layers")
MOE_SETTINGS += ("moe_capacity_factor", "moe_aux_coef", "moe_bias_rate")
_OVERRIDES = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len")
_OVERRIDES += ("tie_embeddings", "rope_theta", "norm_eps", "vocab_size", "moe_experts")
_OVERRIDES += MOE_SETTINGS


def model_config(cfg: TrainConfig, tokenizer_vocab: int) -> ModelConfig:
    """Resolve the preset, the config's overrides and the tokenizer's vocabulary; validate."""
    if cfg.preset not in PRESETS:
        raise ConfigError(f"unknown preset {cfg.preset!r}; choose one of: {', '.join(PRESETS)}")
    mc = PRESETS[cfg.preset]
    changes = {k: getattr(cfg, k) for k in _OVERRIDES if getattr(cfg, k) is not None}
    if "moe_layers" in changes:
        changes["moe_layers"] = tuple(changes["moe_layers"])
    mc = dataclasses.replace(mc, **changes)
    vocab = mc.vocab_size or 64 * math.ceil(tokenizer_vocab / 64)
    if vocab < tokenizer_vocab:
        whose = "vocab_size" if cfg.vocab_size else f"preset {cfg.preset!r}"
        raise ConfigError(
            f"{whose} gives a vocabulary of {vocab} but the tokenizer {cfg.tokenizer!r} has "
            f"{tokenizer_vocab} tokens; use a matching tokenizer or vocab_size={tokenizer_vocab} "
            "or more"
        )
    mc = dataclasses.replace(mc, vocab_size=vocab)
    if mc.d_model % mc.n_heads or mc.n_heads % mc.n_kv_heads:
        raise ConfigError(
            f"d_model ({mc.d_model}) must be divisible by n_heads ({mc.n_heads}) and n_heads by "
            f"n_kv_heads ({mc.n_kv_heads})"
        )
    if mc.head_dim % 2:
        raise ConfigError(f"head dimension {mc.head_dim} must be even for RoPE")
    check_moe(mc)
    if mc.moe_experts and cfg.init_from:
        raise ConfigError(
            "init_from loads a Hugging Face Llama (dense) checkpoint, and this model has "
            "mixture-of-experts blocks (moe_experts > 0); remove init_from or set moe_experts=0"
        )
    if cfg.seq_len > mc.max_seq_len:
        raise ConfigError(
            f"seq_len {cfg.seq_len} exceeds the model's max_seq_len {mc.max_seq_len}; "
            f"lower seq_len or set max_seq_len={cfg.seq_len}"
        )
    return mc


def check_moe(mc: ModelConfig) -> None:
    """The mixture-of-experts keys make sense together (or are unused)."""
    if mc.moe_experts == 0:
        return
    if mc.moe_top_k > mc.moe_experts:
        raise ConfigError(
            f"moe_top_k={mc.moe_top_k} routes each token to more experts than the "
            f"{mc.moe_experts} there are (moe_experts); lower moe_top_k or add experts"
        )
    outside = [i for i in mc.moe_layers or () if not 0 <= i < mc.n_layers]
    if outside:
        raise ConfigError(
            f"moe_layers lists blocks {outside} but the model has blocks 0..{mc.n_layers - 1}"
        )
    if mc.moe_layers is not None and not mc.moe_layers:
        raise ConfigError("moe_layers is empty; list the MoE blocks or set moe_experts=0")
