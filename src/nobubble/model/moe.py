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

Dispatch: the assignments are sorted by expert and each expert multiplies its contiguous rows,
by torch's grouped GEMM with the groups' ends on the device where it runs without a host read
(bfloat16, widths multiples of 8, a CPU or an H100/B200-class GPU: :func:`grouped_dispatch`),
else by a loop over the experts that reads their loads on the host (on a GPU one sync per layer
and microbatch). Both compute the same products: the results are equal bit for bit.

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
GROUPED_GEMM_MAJORS = (9, 10)  # the CUDA compute capabilities of torch's grouped GEMM kernel


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
        dtype = self.matmul_dtype(flat.device)
        f, d = self.w_gate.shape[1:]
        grouped = grouped_dispatch(d, f, flat.device, dtype)
        routed, loads, dropped = self._experts(
            flat, chosen.reshape(-1), picked.detach(), dtype, grouped
        )
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

    def matmul_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype the experts multiply in on ``device``: autocast's where it is on (so both
        dispatches cast to it explicitly, as autocast would), else the weights'."""
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.w_gate.dtype

    def _experts(
        self,
        flat: torch.Tensor,
        expert_of: torch.Tensor,
        priority: torch.Tensor,
        dtype: torch.dtype,
        grouped: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every assignment's expert output, in assignment order (token-major, then rank):
        zero where it was dropped. Also the load of every expert (before dropping) and how many
        assignments were dropped.

        Assignments are sorted by expert (within one, highest probability first), those past
        their expert's capacity after all the others; each expert multiplies its contiguous
        kept rows in ``dtype`` (:meth:`_grouped` if ``grouped``, else :meth:`_looped`), and the
        rows go back by the inverse permutation: every gather and scatter is a permutation, so
        the backward accumulates nothing by atomics. All of it but the loop runs on the device.
        """
        n, d = flat.shape
        k = expert_of.numel() // n
        by_score = torch.argsort(priority.reshape(-1), descending=True, stable=True)
        order = by_score[torch.argsort(expert_of[by_score], stable=True)]
        loads = expert_of.new_zeros(self.experts).scatter_add_(
            0, expert_of, torch.ones_like(expert_of)
        )
        kept = loads
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * n * k / self.experts)
            kept = loads.clamp(max=capacity)
            # each assignment's place among its expert's (0: the most probable one); those at
            # the capacity or past it move behind every kept one, in the same order
            firsts = loads.cumsum(0) - loads
            place = torch.arange(n * k, device=order.device) - firsts[expert_of[order]]
            order = order[torch.argsort(place >= capacity, stable=True)]
        rows = flat.unsqueeze(1).expand(n, k, d).reshape(n * k, d)[order].to(dtype)
        weights = [w.to(dtype) for w in (self.w_gate, self.w_up, self.w_down)]
        out = (self._grouped if grouped else self._looped)(rows, kept, *weights)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return out[inverse], loads, (loads - kept).sum()

    def _grouped(
        self, rows: torch.Tensor, kept: torch.Tensor, *weights: torch.Tensor
    ) -> torch.Tensor:
        """The experts' SwiGLU on their rows (``kept[e]`` for expert e, then the dropped rows)
        by torch's grouped GEMM, the groups' ends on the device: no host read. The kernel
        neither reads nor writes the rows past the last group, forward or backward, so with a
        capacity they are zeroed on the way in and out."""
        w_gate, w_up, w_down = weights
        ends = kept.cumsum(0)
        offs = ends.to(torch.int32)

        def times(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # x[rows of e] @ w[e]ᵀ
            return F.grouped_mm(x, w.transpose(1, 2), offs=offs)

        inside = None
        if self.capacity_factor > 0:
            inside = (torch.arange(rows.shape[0], device=rows.device) < ends[-1]).unsqueeze(1)
            rows = torch.where(inside, rows, 0)
        out = times(F.silu(times(rows, w_gate)) * times(rows, w_up), w_down)
        return out if inside is None else torch.where(inside, out, 0)

    def _looped(
        self, rows: torch.Tensor, kept: torch.Tensor, *weights: torch.Tensor
    ) -> torch.Tensor:
        """The fallback of :meth:`_grouped`, the same products: each expert on a slice of the
        rows sized on the host, so it reads ``kept`` on the host, a device-to-host copy (on a
        GPU a sync) per layer and microbatch."""
        w_gate, w_up, w_down = weights
        pieces, start = [], 0
        for expert, keep in enumerate(kept.tolist()):
            if keep:
                part = rows[start : start + keep]
                hidden = F.silu(part @ w_gate[expert].T) * (part @ w_up[expert].T)
                pieces.append(hidden @ w_down[expert].T)
            start += keep
        pieces.append(rows.new_zeros(rows.shape[0] - start, rows.shape[1]))  # the dropped
        return torch.cat(pieces)


def grouped_dispatch(d_model: int, width: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an MoE layer of these widths multiplying in ``dtype`` on ``device`` runs its
    experts by torch's grouped GEMM (else by the loop, which reads the loads on the host).

    The grouped GEMM reads its offsets on the device in bfloat16, on CUDA GPUs of compute
    capability 9.x and 10.x (H100, B200), with every row's stride a multiple of 16 bytes (both
    widths multiples of 8). On other GPUs and in other dtypes torch copies the offsets to host
    memory and loops over the groups itself (torch 2.13, aten/src/ATen/native/cuda/GroupedBlas.cpp:
    the same sync as the loop, hidden), and torch.compile refuses it in float32. On a CPU the
    same rule holds, though there no read waits for a device.
    """
    if dtype != torch.bfloat16 or d_model % 8 or width % 8:
        return False
    if device.type == "cuda":
        major = torch.cuda.get_device_properties(device).major
        return torch.version.hip is None and major in GROUPED_GEMM_MAJORS
    return device.type == "cpu"


def dispatch_in_words(mc: ModelConfig, device: torch.device, dtype: torch.dtype) -> str | None:
    """How the MoE layers of ``mc`` multiplying in ``dtype`` on ``device`` dispatch their experts,
    for summary.json (None for a dense model)."""
    if mc.moe_experts == 0:
        return None
    if grouped_dispatch(mc.d_model, mc.expert_width, device, dtype):
        return "grouped GEMM"
    return "loop over the experts (reads their loads on the host)"


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
