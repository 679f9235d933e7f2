"""The mapping between nobubble's model and Hugging Face's ``LlamaForCausalLM``.

The two compute the same function: pre-norm blocks (RMSNorm, attention with grouped key/value
heads, RMSNorm, SwiGLU), a final RMSNorm and a bias-free head, RoPE that rotates the pair (i,
i + head_dim/2) of every head (HF's ``rotate_half``: nobubble's :func:`nobubble.model.apply_rope`
splits the head dimension in halves the same way, so q and k need no permutation). Only the
parameter names differ (:func:`hf_name`); the shapes are the same (``nn.Linear`` weights are
``(out, in)`` on both sides).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nobubble.model.presets import PRESETS, ModelConfig

ARCHITECTURE = "LlamaForCausalLM"
CONFIG = "config.json"  # a model folder's (hf_config), not a run folder's
MODEL_TYPE = "llama"

_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}


def hf_name(name: str) -> str:
    """The ``LlamaForCausalLM`` name of the nobubble parameter ``name``."""
    if name in _TOP:
        return _TOP[name]
    prefix, index, rest = [*name.split(".", 2), "", ""][:3]
    if prefix != "blocks" or rest not in _BLOCK:
        raise ValueError(f"nobubble parameter {name!r} has no Llama counterpart")
    return f"model.layers.{index}.{_BLOCK[rest]}"


def parameter_shapes(mc: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the full model (nobubble names) and its shape; a tied head is the
    embedding, so it has no entry of its own."""
    d, ff, vocab = mc.d_model, mc.d_ff, mc.vocab_size
    q, kv = mc.n_heads * mc.head_dim, mc.n_kv_heads * mc.head_dim
    block = {
        "attn_norm.weight": (d,),
        "attn.wq.weight": (q, d),
        "attn.wk.weight": (kv, d),
        "attn.wv.weight": (kv, d),
        "attn.wo.weight": (d, q),
        "mlp_norm.weight": (d,),
        "mlp.w_gate.weight": (ff, d),
        "mlp.w_up.weight": (ff, d),
        "mlp.w_down.weight": (d, ff),
    }
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    for i in range(mc.n_layers):
        shapes.update({f"blocks.{i}.{key}": shape for key, shape in block.items()})
    shapes["norm.weight"] = (d,)
    if not mc.tie_embeddings:
        shapes["head.weight"] = (vocab, d)
    return shapes


def hf_config(mc: ModelConfig, eos_id: int) -> dict[str, Any]:
    """``config.json`` of the ``LlamaForCausalLM`` that computes what ``mc`` computes.

    The end-of-text id is also the beginning-of-text id: nobubble separates documents by it, so
    it is the token every document was trained to follow.
    """
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": mc.vocab_size,
        "hidden_size": mc.d_model,
        "intermediate_size": mc.d_ff,
        "num_hidden_layers": mc.n_layers,
        "num_attention_heads": mc.n_heads,
        "num_key_value_heads": mc.n_kv_heads,
        "head_dim": mc.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": mc.max_seq_len,
        "rms_norm_eps": mc.norm_eps,
        "rope_theta": mc.rope_theta,  # where transformers < 5 reads it
        "rope_parameters": {"rope_type": "default", "rope_theta": mc.rope_theta},  # >= 5
        "tie_word_embeddings": mc.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "dtype": "float32",
    }


@dataclass(frozen=True)
class Mismatch:
    """One way a Hugging Face config differs from the model: ``key`` names it in nobubble's
    terms; ``fix`` is the setting that removes it (None: no setting can), ``why`` says more."""

    key: str
    theirs: Any
    ours: Any
    fix: str | None = None
    why: str = ""

    def __str__(self) -> str:
        why = f" ({self.why})" if self.why else ""
        return f"{self.key} {self.theirs} there, {self.ours} here{why}"


# nobubble config key: (HF config key, the model's value, HF's default when the key is absent)
_SHAPE = {
    "d_model": ("hidden_size", lambda mc: mc.d_model, None),
    "n_layers": ("num_hidden_layers", lambda mc: mc.n_layers, None),
    "n_heads": ("num_attention_heads", lambda mc: mc.n_heads, None),
    "n_kv_heads": ("num_key_value_heads", lambda mc: mc.n_kv_heads, "num_attention_heads"),
    "d_ff": ("intermediate_size", lambda mc: mc.d_ff, None),
    "tie_embeddings": ("tie_word_embeddings", lambda mc: mc.tie_embeddings, False),
}


def rope_settings(config: dict[str, Any]) -> tuple[str, float]:
    """(RoPE type, theta) of an HF config, old (``rope_theta``, ``rope_scaling``) or new
    (``rope_parameters``) style; no scaling reads as ``"default"``."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    return str(kind), float(theta)


def shape_of(config: dict[str, Any]) -> dict[str, Any]:
    """The nobubble shape keys (d_model, ..., tie_embeddings, rope_theta) of an HF config."""
    shape = {}
    for key, (hf_key, _, default) in _SHAPE.items():
        value = config.get(hf_key)
        if value is None:
            value = config.get(default) if isinstance(default, str) else default
        shape[key] = value
    shape["rope_theta"] = rope_settings(config)[1]
    return shape


SHAPE_KEYS = frozenset({*_SHAPE, "rope_theta"})  # the keys a preset (or an override) sets


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and math.isclose(a, b, rel_tol=1e-9)
    return a == b


def _setting(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    return f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"


def differences(config: dict[str, Any], mc: ModelConfig) -> list[Mismatch]:
    """Every way the HF ``config`` (a ``config.json``) is not the architecture of ``mc``, the
    vocabulary aside (it depends on the tokenizer: :mod:`nobubble.hf.init`)."""
    out = []
    model_type = config.get("model_type")
    if model_type != MODEL_TYPE:
        out.append(Mismatch("model_type", model_type, MODEL_TYPE, why="nobubble is a Llama"))
    architectures = config.get("architectures") or [ARCHITECTURE]
    if ARCHITECTURE not in architectures:
        out.append(Mismatch("architectures", architectures, [ARCHITECTURE]))
    theirs = shape_of(config)
    for key, value in theirs.items():
        ours = getattr(mc, key)
        if not _same(value, ours):
            out.append(Mismatch(key, value, ours, fix=_setting(key, value)))
    hidden, heads = theirs["d_model"], theirs["n_heads"]
    head_dim = config.get("head_dim")
    if head_dim is not None and isinstance(hidden, int) and heads and head_dim != hidden // heads:
        out.append(
            Mismatch("head_dim", head_dim, hidden // heads, why="nobubble's is d_model / n_heads")
        )
    if config.get("hidden_act", "silu") != "silu":
        out.append(Mismatch("hidden_act", config["hidden_act"], "silu", why="SwiGLU uses silu"))
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            out.append(Mismatch(key, True, False, why="nobubble's layers have no bias"))
    kind, _ = rope_settings(config)
    if kind != "default":
        out.append(Mismatch("rope scaling", kind, "none", why="nobubble's RoPE is unscaled"))
    partial = config.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        out.append(Mismatch("partial_rotary_factor", partial, 1.0, why="RoPE covers every dim"))
    eps = config.get("rms_norm_eps", 1e-6)  # LlamaConfig's default
    if not _same(float(eps), mc.norm_eps):
        out.append(Mismatch("rms_norm_eps", eps, mc.norm_eps, fix=f"norm_eps={float(eps):g}"))
    return out


def matching_presets(config: dict[str, Any]) -> list[str]:
    """The presets whose shape is that of the HF ``config``."""
    theirs = shape_of(config)
    return [
        name
        for name, preset in PRESETS.items()
        if all(_same(value, getattr(preset, key)) for key, value in theirs.items())
    ]


def describe(mismatches: list[Mismatch], config: dict[str, Any]) -> str:
    """One line: the differences, then the settings that remove them (or that none can)."""
    listed = "; ".join(str(m) for m in mismatches)
    fixes = " ".join(dict.fromkeys(m.fix for m in mismatches if m.fix))
    if any(m.fix is None for m in mismatches):
        rest = f" (the other differences would need {fixes})" if fixes else ""
        return f"{listed}. nobubble cannot start from this checkpoint{rest}"
    presets = matching_presets(config)
    if presets and any(m.key in SHAPE_KEYS for m in mismatches):
        alternative = f" (preset={presets[0]} has this shape: it can replace the shape settings)"
        return f"{listed}. Set {fixes}{alternative}"
    return f"{listed}. Set {fixes}"
