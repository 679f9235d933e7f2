"""Model shapes to plan for: nobubble's presets and published shapes of larger models.

Only the shape enters the cost model, so Llama 3's RoPE scaling and other details that nobubble's
model does not implement do not matter here; these are not training presets.
"""

from __future__ import annotations

from nobubble.model.presets import PRESETS, ModelConfig

# Published config.json shapes of meta-llama/Llama-3.2-1B, Meta-Llama-3-8B, Meta-Llama-3-70B and
# Llama-3.1-405B (the last two as in "The Llama 3 Herd of Models", 2024, Table 3).
PLANNING_SHAPES: dict[str, ModelConfig] = {
    **PRESETS,
    "llama3.2-1b": ModelConfig(
        d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192, max_seq_len=8192,
        vocab_size=128256, tie_embeddings=True,
    ),
    "llama3-8b": ModelConfig(
        d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336, max_seq_len=8192,
        vocab_size=128256,
    ),
    "llama3-70b": ModelConfig(
        d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672, max_seq_len=8192,
        vocab_size=128256,
    ),
    "llama3-405b": ModelConfig(
        d_model=16384, n_layers=126, n_heads=128, n_kv_heads=8, d_ff=53248, max_seq_len=8192,
        vocab_size=128256,
    ),
}  # fmt: skip

# A family of shapes, smallest first: the planner names the largest of them that fits a plan.
LLAMA3_FAMILY = ("llama3-8b", "llama3-70b", "llama3-405b")
