"""LLaMA-style decoder built from pipeline stages.

The whole model is a single :class:`Stage` that owns the embedding, every block and the head; a
pipeline stage owns a contiguous slice of ``[embedding, block 0..L-1, norm+head]``. Parameter names
are the same in both cases (``embed.weight``, ``blocks.7.attn.wq.weight``, ``head.weight``), and
initialization depends only on the seed and the parameter name, so a stage built alone holds
exactly the tensors of its slice of the full model.

Tied embeddings (``tie_embeddings``): in the full model the head uses the embedding's weight, one
parameter named ``embed.weight``. Split over several stages, the first stage holds that weight
for the embedding and the last stage holds a copy of it for its head, under the same name
``embed.weight`` (see :data:`TIED_WEIGHT`), initialized to the same bytes; the backends keep the
two copies bitwise equal (docs/pipeline.md, "Tied embeddings").
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from nobubble.config import ConfigError, TrainConfig
from nobubble.moe import BALANCE_BIAS, MoE, Routing


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

_OVERRIDES = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len")
_OVERRIDES += ("tie_embeddings", "rope_theta", "norm_eps", "vocab_size")
_OVERRIDES += ("moe_experts", "moe_top_k", "moe_shared_experts", "moe_d_ff", "moe_layers")
_OVERRIDES += ("moe_capacity_factor", "moe_aux_coef", "moe_bias_rate")


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dimension; x is (B, H, T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, mc: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = mc.n_heads, mc.n_kv_heads, mc.head_dim
        self.wq = nn.Linear(mc.d_model, mc.n_heads * mc.head_dim, bias=False)
        self.wk = nn.Linear(mc.d_model, mc.n_kv_heads * mc.head_dim, bias=False)
        self.wv = nn.Linear(mc.d_model, mc.n_kv_heads * mc.head_dim, bias=False)
        self.wo = nn.Linear(mc.n_heads * mc.head_dim, mc.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.n_kv_heads != self.n_heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """Attention and a feed-forward layer: a dense SwiGLU, or routed experts (:mod:`nobubble.moe`)
    if ``moe`` (their shared experts, if any, one SwiGLU as wide as all of them)."""

    def __init__(self, mc: ModelConfig, moe: bool = False) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(mc.d_model, mc.norm_eps)
        self.attn = Attention(mc)
        self.mlp_norm = RMSNorm(mc.d_model, mc.norm_eps)
        if moe:
            width = mc.moe_shared_experts * mc.expert_width
            self.mlp = MoE(mc, SwiGLU(mc.d_model, width) if width else None)
        else:
            self.mlp = SwiGLU(mc.d_model, mc.d_ff)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


TIED_WEIGHT = "embed.weight"  # the tied embedding/head weight, under this name in every layout
TIED_HEAD_USE = "head.weight"  # where the full model's head reads it (a key of functional_call)


@dataclass(frozen=True)
class StageSpec:
    """What one pipeline stage owns: the embedding?, a range of blocks, the norm+head?"""

    index: int
    blocks: range
    has_embed: bool
    has_head: bool


def holds_tied_copy(mc: ModelConfig, spec: StageSpec) -> bool:
    """Whether this stage holds one of the two copies of a tied weight split over stages: the
    first or the last stage of a pipeline of several stages (one stage holds it once)."""
    return mc.tie_embeddings and spec.has_embed != spec.has_head


class Stage(nn.Module):
    """A contiguous slice of the decoder; the full model is the stage that owns everything.

    Input: token ids (B, T) if the stage has the embedding, else hidden states (B, T, D).
    Output: logits (B, T, V) if the stage has the head, else hidden states.

    With tied embeddings the head's weight is ``embed.weight``; on a last stage without the
    embedding, ``embed`` holds only that copy (the stage never looks tokens up).

    ``activation_checkpointing``: when gradients are recorded, every block keeps only its input
    and recomputes its activations in the backward (:func:`checkpointed_block`).
    """

    activation_checkpointing: bool = False

    def __init__(self, mc: ModelConfig, spec: StageSpec, seed: int = 0) -> None:
        super().__init__()
        assert mc.vocab_size is not None, "resolve the vocabulary with model_config() first"
        self.mc, self.spec = mc, spec
        holds_embedding = spec.has_embed or (mc.tie_embeddings and spec.has_head)
        self.embed = nn.Embedding(mc.vocab_size, mc.d_model) if holds_embedding else None
        self.blocks = nn.ModuleDict({str(i): Block(mc, mc.is_moe(i)) for i in spec.blocks})
        self.norm = RMSNorm(mc.d_model, mc.norm_eps) if spec.has_head else None
        self.head = nn.Linear(mc.d_model, mc.vocab_size, bias=False) if spec.has_head else None
        if mc.tie_embeddings and self.head is not None:
            self.head.weight = self.embed.weight
        empty = torch.empty(0, mc.head_dim // 2)
        self.register_buffer("rope_cos", empty, persistent=False)
        self.register_buffer("rope_sin", empty.clone(), persistent=False)
        init_parameters(self, seed)

    def rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables of the first ``length`` positions, made for the longest sequence
        seen so far, not for ``max_seq_len`` (which may be far longer than any sequence run).
        Row i is the same whatever the tables' length."""
        if self.rope_cos.shape[0] < length:
            cos, sin = rope_tables(self.mc.head_dim, length, self.mc.rope_theta)
            self.rope_cos, self.rope_sin = cos.to(self.rope_cos), sin.to(self.rope_sin)
        return self.rope_cos[:length], self.rope_sin[:length]

    def moe_layers(self) -> list[MoE]:
        """The routed-experts layers of this stage, in block order."""
        return [b.mlp for b in self.blocks.values() if isinstance(b.mlp, MoE)]

    def take_routing(self) -> Routing:
        """The routing statistics summed since the last call, by MoE block (:mod:`nobubble.moe`;
        empty if the stage has none)."""
        return {
            int(i): b.mlp.take_routing() for i, b in self.blocks.items() if isinstance(b.mlp, MoE)
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.has_embed:
            x = self.embed(x)
        t = x.shape[1]
        cos, sin = self.rope(t)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for block in self.blocks.values():
            x = checkpointed_block(block, x, cos, sin) if recompute else block(x, cos, sin)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def checkpointed_block(
    block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """``block(x, cos, sin)``, its activations recomputed in the backward from ``x``
    (non-reentrant :func:`torch.utils.checkpoint.checkpoint`).

    The recomputation runs with the weights this forward ran with, which it is handed
    explicitly: under ``functional_call`` (the weight version of an action) the block's
    attributes hold that version only for the duration of the call, and the backward, long after
    it, would otherwise recompute with whatever the block holds then (under 2bw, another
    version). The RNG state is saved and restored for the recomputation (torch's default; the
    blocks draw no random numbers) and so is the autocast state, so the recomputed activations
    are bitwise those of the forward.
    """
    weights = dict(block.named_parameters())
    return checkpoint(functional_call, block, weights, (x, cos, sin), use_reentrant=False)


def init_parameters(module: nn.Module, seed: int) -> None:
    """Initialize every parameter from (seed, its name) alone: partition-independent."""
    n_layers = module.mc.n_layers
    with torch.no_grad():
        for name, p in module.named_parameters():
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith(BALANCE_BIAS):
                p.zero_()
            elif p.ndim == 1:
                p.fill_(1.0)
            elif name.endswith(("wo.weight", "w_down.weight", "mlp.w_down")):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.02 / math.sqrt(2 * n_layers)))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def full_spec(mc: ModelConfig) -> StageSpec:
    return StageSpec(index=0, blocks=range(mc.n_layers), has_embed=True, has_head=True)


def build_model(mc: ModelConfig, seed: int = 0) -> Stage:
    return Stage(mc, full_spec(mc), seed)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all positions, computed in float32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def partition(
    n_layers: int,
    stages: int,
    embed_cost: float = 1.0,
    head_cost: float = 1.0,
    stage_layers: list[int] | None = None,
) -> list[StageSpec]:
    """Split the blocks into ``stages`` contiguous runs.

    With ``stage_layers`` the runs have exactly those lengths. Otherwise the split minimizes the
    most expensive stage, where a block costs 1, the embedding ``embed_cost`` (stage 0) and the
    norm+head ``head_cost`` (last stage). Only the first and last stage may hold no block.
    """
    if stages < 1:
        raise ConfigError(f"stages must be >= 1, got {stages}")
    if stage_layers is not None:
        if len(stage_layers) != stages or sum(stage_layers) != n_layers:
            raise ConfigError(
                f"stage_layers {stage_layers} must list {stages} block counts summing to the "
                f"model's {n_layers} blocks"
            )
        if any(n < 0 for n in stage_layers):
            raise ConfigError(f"stage_layers {stage_layers} has a negative block count")
        counts = list(stage_layers)
    else:
        counts = _balanced_counts(n_layers, stages, embed_cost, head_cost)
    for i, n in enumerate(counts):
        if n == 0 and 0 < i < stages - 1:
            raise ConfigError(
                f"stage {i} of {stages} would hold no block; use fewer stages (the model has "
                f"{n_layers} blocks) or give stage_layers explicitly"
            )
    specs, start = [], 0
    for i, n in enumerate(counts):
        specs.append(StageSpec(i, range(start, start + n), i == 0, i == stages - 1))
        start += n
    return specs


def _balanced_counts(n_layers: int, stages: int, embed: float, head: float) -> list[int]:
    if stages > n_layers + 2 or (stages > 2 and n_layers < stages - 2):
        raise ConfigError(
            f"cannot split {n_layers} blocks over {stages} stages: every stage but the first and "
            f"the last needs a block, so at most {n_layers + 2} stages; use fewer stages or more "
            "blocks (n_layers)"
        )

    def cost(stage: int, n: int) -> float:
        return n + (embed if stage == 0 else 0.0) + (head if stage == stages - 1 else 0.0)

    # best[s][k]: minimal max cost placing the first k blocks on stages 0..s
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(stages)]
    choice = [[0] * (n_layers + 1) for _ in range(stages)]
    for k in range(n_layers + 1):
        best[0][k] = cost(0, k)
    for s in range(1, stages):
        middle = s < stages - 1
        for k in range(n_layers + 1):
            for n in range(1 if middle else 0, k + 1):
                value = max(best[s - 1][k - n], cost(s, n))
                if value < best[s][k] - 1e-12:
                    best[s][k], choice[s][k] = value, n
    counts, k = [], n_layers
    for s in range(stages - 1, 0, -1):
        counts.append(choice[s][k])
        k -= choice[s][k]
    counts.append(k)
    return counts[::-1]
