"""The decoder's layers: LLaMA-style blocks and :class:`Stage`, a contiguous slice of the model.

The whole model is a single :class:`Stage` that owns the embedding, every block and the head; a
pipeline stage owns a contiguous slice of ``[embedding, block 0..L-1, norm+head]``
(:mod:`nobubble.model.partition`). Parameter names are the same in both cases (``embed.weight``,
``blocks.7.attn.wq.weight``, ``head.weight``), and initialization depends only on the seed and the
parameter name, so a stage built alone holds exactly the tensors of its slice of the full model.

Tied embeddings (``tie_embeddings``): in the full model the head uses the embedding's weight, one
parameter named ``embed.weight``. Split over several stages, the first stage holds that weight
for the embedding and the last stage holds a copy of it for its head, under the same name
``embed.weight`` (:data:`nobubble.model.partition.TIED_WEIGHT`), initialized to the same bytes;
the backends keep the two copies bitwise equal (docs/pipeline.md, "Tied embeddings").
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from nobubble.model.moe import BALANCE_BIAS, MoE, Routing
from nobubble.model.partition import StageSpec
from nobubble.model.presets import ModelConfig


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
        # -1 heads: under tensor parallelism a rank holds n_heads / tp of them (tensor_split)
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
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
