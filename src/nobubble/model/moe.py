"""Mixture-of-experts feed-forward layer: top-k routing, shared experts, capacity, load balancing.

A token's router probabilities are p = softmax(x·Wᵣᵀ) over E routed experts. It goes to the k
experts with the highest p + b, where b is the balance bias (zero unless bias balancing is on;
it steers the choice only and never scales an output); its gates are those experts' p,
renormalized to sum to 1 when k > 1 (with k = 1 the gate is p itself, so the router still learns
from the language-model loss). The output is Σ gate·expertₑ(x) over the chosen experts, plus the
shared experts' SwiGLU on every token.

Capacity (``moe_capacity_factor`` c > 0): an expert takes at most ⌈c·N·k/E⌉ of a microbatch's N·k
assignments, those with the highest p first; the others are dropped (that expert adds nothing
for that token, whose residual passes on). c = 0 is dropless.

Load balancing, either or both:

- the auxiliary loss (``moe_aux_coef`` α): per MoE layer and microbatch, α·E·Σₑ fₑ·Pₑ, with fₑ the
  share of assignments chosen for expert e (before dropping) and Pₑ its mean probability; it is
  1 at perfect balance. Its gradient joins the backward inside the layer (:class:`RoutingTap`), so
  a stage's forward returns only its hidden states and every backend, every schedule and the
  split backward of zero-bubble schedules carry it without knowing it is there.
- auxiliary-loss-free bias balancing (``moe_bias_rate`` u, DeepSeek-V3): after each step
  bₑ ← bₑ + u·sign(mean load − loadₑ), from the loads of the step's microbatches. The bias is a
  parameter that no optimizer steps (``requires_grad=False``): it is versioned, stashed,
  checkpointed and predicted with the weights, so under a delayed schedule a step routes with
  the bias of the weights it runs at, and the bias follows the same delay as the gradient.

Routing statistics (``ROUTING_FIELDS`` per MoE layer) are summed over the step's trained
microbatches when their backward passes the layer (so evaluation and activation recomputation
count nothing), taken at the step's update, averaged over data-parallel replicas with the loss,
and written to metrics.jsonl (:func:`routing_metrics`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nobubble.model.presets import ModelConfig

BALANCE_BIAS = "balance_bias"  # the parameter name of a layer's balance bias
# per MoE layer, after the E loads: assignments dropped, Σ router entropy (nats) over tokens,
# Σ aux loss (unscaled) over microbatches, microbatches, tokens
ROUTING_FIELDS = ("dropped", "entropy", "aux", "microbatches", "tokens")
Routing = dict[int, torch.Tensor]  # block index -> its routing sums (loads, then ROUTING_FIELDS)


class RoutingTap(torch.autograd.Function):
    """Identity on a layer's output whose backward also (1) gives the layer's auxiliary loss its
    gradient, α times the share of the microbatch in the step's loss, and (2) adds the
    microbatch's routing statistics to the layer's sums: both happen once per trained
    microbatch, whatever recomputes the forward."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, layer: MoE, stats: torch.Tensor):
        ctx.layer, ctx.stats = layer, stats
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        layer = ctx.layer
        layer.routing_sums += ctx.stats
        aux_grad = None
        if ctx.needs_input_grad[1]:
            scale = layer.aux_coef * layer.loss_scale
            aux_grad = torch.full((), scale, dtype=torch.float32, device=grad.device)
        return grad, aux_grad, None, None


class MoE(nn.Module):
    """The routed experts (3-D weights ``w_gate``, ``w_up`` (E, f, d) and ``w_down`` (E, d, f)),
    the router, the balance bias if bias balancing is on, and the shared experts (``shared``,
    a SwiGLU of width s·f, or None)."""

    loss_scale: float = 1.0  # the share of one microbatch in the step's loss (set by the backend)

    def __init__(self, mc: ModelConfig, shared: nn.Module | None) -> None:
        super().__init__()
        e, f, d = mc.moe_experts, mc.expert_width, mc.d_model
        self.experts, self.top_k = e, mc.moe_top_k
        self.capacity_factor, self.aux_coef = mc.moe_capacity_factor, mc.moe_aux_coef
        self.router = nn.Linear(d, e, bias=False)
        self.w_gate = nn.Parameter(torch.empty(e, f, d))
        self.w_up = nn.Parameter(torch.empty(e, f, d))
        self.w_down = nn.Parameter(torch.empty(e, d, f))
        if mc.moe_bias_rate > 0:
            self.balance_bias = nn.Parameter(torch.zeros(e), requires_grad=False)
        else:
            self.balance_bias = None
        self.shared = shared
        sums = torch.zeros(e + len(ROUTING_FIELDS), dtype=torch.float64)
        self.register_buffer("routing_sums", sums, persistent=False)

    def take_routing(self) -> torch.Tensor:
        """The statistics summed since the last call (loads, then ``ROUTING_FIELDS``)."""
        sums, self.routing_sums = self.routing_sums, torch.zeros_like(self.routing_sums)
        return sums

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        n, k, e = flat.shape[0], self.top_k, self.experts
        probs = self.router(flat).float().softmax(dim=-1)
        with torch.no_grad():
            scores = probs if self.balance_bias is None else probs + self.balance_bias
            chosen = scores.topk(k, dim=-1).indices  # (n, k)
        picked = probs.gather(1, chosen)
        gates = picked / picked.sum(dim=-1, keepdim=True) if k > 1 else picked
        routed, loads, dropped = self._experts(flat, chosen.reshape(-1), picked.detach())
        out = (routed.view(n, k, -1) * gates.unsqueeze(-1).to(routed.dtype)).sum(dim=1)
        if self.shared is not None:
            out = out + self.shared(flat)
        if not torch.is_grad_enabled():  # an evaluation: no backward to tap, nothing recorded
            return out.view(shape)
        aux = e * (loads.float() / (n * k) * probs.mean(dim=0)).sum()
        with torch.no_grad():
            entropy = -(probs * probs.clamp_min(1e-30).log()).sum()
            extra = [dropped.double(), entropy.double(), aux.double()]
            counts = flat.new_full((2,), n, dtype=torch.float64)
            counts[0] = 1.0  # fills on the device: no copy from the host
            stats = torch.cat([loads.double(), torch.stack(extra), counts])
        if self.aux_coef == 0:
            aux = aux.detach()
        return RoutingTap.apply(out.view(shape), aux, self, stats)

    def _experts(
        self, flat: torch.Tensor, expert_of: torch.Tensor, priority: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every assignment's expert output, in assignment order (token-major, then rank):
        zero where it was dropped. Also the load of every expert (before dropping) and how many
        assignments were dropped.

        Assignments are sorted by expert (within one, highest probability first), each expert
        multiplies its contiguous rows, and the rows go back by the inverse permutation: every
        gather and scatter is a permutation, so the backward accumulates nothing by atomics.
        """
        n, d = flat.shape
        k = expert_of.numel() // n
        by_score = torch.argsort(priority.reshape(-1), descending=True, stable=True)
        order = by_score[torch.argsort(expert_of[by_score], stable=True)]
        loads = torch.bincount(expert_of, minlength=self.experts)
        kept = loads
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * n * k / self.experts)
            kept = loads.clamp(max=capacity)
        rows = flat.unsqueeze(1).expand(n, k, d).reshape(n * k, d)[order]
        pieces, start = [], 0
        # the loads set the shapes: one device-to-host copy per layer and microbatch, as in any
        # dropless MoE without grouped-GEMM kernels
        for expert, (load, keep) in enumerate(torch.stack([loads, kept], dim=1).tolist()):
            if keep:
                part = rows[start : start + keep]
                hidden = F.silu(part @ self.w_gate[expert].T) * (part @ self.w_up[expert].T)
                pieces.append(hidden @ self.w_down[expert].T)
            if load > keep:
                pieces.append(rows.new_zeros(load - keep, d))
            start += load
        out = torch.cat(pieces) if pieces else rows.new_zeros(0, d)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return out[inverse], loads, (loads - kept).sum()


def routing_size(mc: ModelConfig) -> int:
    """The length of one MoE layer's routing sums."""
    return mc.moe_experts + len(ROUTING_FIELDS)


def pack_routing(routing: Routing) -> torch.Tensor | None:
    """One float64 vector of the layers' sums in block order (None without MoE layers)."""
    return torch.cat([routing[b] for b in sorted(routing)]) if routing else None


def unpack_routing(vector: torch.Tensor, blocks: list[int], mc: ModelConfig) -> Routing:
    """The inverse of :func:`pack_routing` for the MoE ``blocks`` (in order) of one stage."""
    rows = vector[: len(blocks) * routing_size(mc)].reshape(len(blocks), routing_size(mc))
    return dict(zip(blocks, rows, strict=True))


@torch.no_grad()
def balance_routers(params: dict[str, torch.Tensor], routing: Routing, rate: float) -> None:
    """DeepSeek-V3's bias update for every balance bias among ``params`` (a stage's, pointing at
    the version the step updates): raise the bias of the experts a step loaded below the mean
    and lower it above, by ``rate``."""
    for block, sums in routing.items():
        bias = params.get(f"blocks.{block}.mlp.{BALANCE_BIAS}")
        if bias is not None:
            loads = sums[: bias.numel()].to(bias.device)
            bias.add_(torch.sign(loads.mean() - loads).to(bias.dtype), alpha=rate)


def routing_metrics(routing: Routing) -> dict[str, Any]:
    """metrics.jsonl entries from a step's routing sums: the mean auxiliary loss, the dropped
    share of assignments, the router entropy per token (nats; log E is uniform), the largest
    overload max(load)/mean(load) − 1 over the layers ("MaxVio", 0 at perfect balance), and
    every MoE block's load per expert as shares of its assignments."""
    blocks = sorted(routing)
    table = torch.stack([routing[b] for b in blocks]).cpu()
    e = table.shape[1] - len(ROUTING_FIELDS)
    loads, (dropped, entropy, aux, micro, tokens) = table[:, :e], table[:, e:].T
    assignments = loads.sum(dim=1)
    shares = loads / assignments[:, None]
    return {
        "moe_aux": (aux / micro).mean().item(),
        "moe_dropped": (dropped.sum() / assignments.sum()).item(),
        "moe_entropy": (entropy / tokens).mean().item(),
        "moe_max_violation": (shares.max(dim=1).values * e - 1).max().item(),
        "moe_load": {
            str(b): [round(v, 5) for v in row]
            for b, row in zip(blocks, shares.tolist(), strict=True)
        },
    }
