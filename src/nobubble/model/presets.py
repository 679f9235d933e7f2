"""The model shapes: :class:`ModelConfig` and the named presets (the registry of models).

A preset is a complete shape; the configuration's model keys override parts of it
(:func:`nobubble.model.resolve.model_config`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int
    vocab_size: int | None = None  # None: taken from the tokenizer (rounded up to 64)
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # mixture of experts (nobubble.moe); moe_experts = 0: every block is dense
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_shared_experts: int = 0
    moe_d_ff: int | None = None  # each expert's width (default d_ff)
    moe_layers: tuple[int, ...] | None = None  # the MoE blocks (default: every block)
    moe_capacity_factor: float = 0.0  # 0: dropless
    moe_aux_coef: float = 0.01
    moe_bias_rate: float = 0.0  # auxiliary-loss-free bias balancing; 0: off

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def expert_width(self) -> int:
        return self.moe_d_ff or self.d_ff

    def is_moe(self, block: int) -> bool:
        """Whether block ``block`` has routed experts in place of its dense SwiGLU."""
        return self.moe_experts > 0 and (self.moe_layers is None or block in self.moe_layers)

    def moe_blocks(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe(i)]


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=688, max_seq_len=512
    ),
    "small": ModelConfig(
        d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=1376, max_seq_len=1024
    ),
    # Published shapes of HuggingFaceTB/SmolLM2-135M and -360M.
    "smollm2-135m": ModelConfig(
        d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536, max_seq_len=2048,
        vocab_size=49152, tie_embeddings=True, rope_theta=1e5,
    ),
    "smollm2-360m": ModelConfig(
        d_model=960, n_layers=32, n_heads=15, n_kv_heads=5, d_ff=2560, max_seq_len=2048,
        vocab_size=49152, tie_embeddings=True, rope_theta=1e5,
    ),
    # The CPU study's dense model (docs/results.md) with 8 experts of half its MLP width, 2 per
    # token: the same active parameters a token sees, 4x the MLP parameters.
    "cpu-moe": ModelConfig(
        d_model=128, n_layers=6, n_heads=4, n_kv_heads=2, d_ff=352, max_seq_len=512,
        moe_experts=8, moe_top_k=2, moe_d_ff=176,
    ),
    # SmolLM2-360M's shape (the study's dense model) with 16 experts of half its MLP width, 2 per
    # token: the dense model's active size, about 2B parameters in all.
    "moe-2b": ModelConfig(
        d_model=960, n_layers=32, n_heads=15, n_kv_heads=5, d_ff=2560, max_seq_len=2048,
        vocab_size=49152, tie_embeddings=True, rope_theta=1e5,
        moe_experts=16, moe_top_k=2, moe_d_ff=1280,
    ),
}  # fmt: skip
