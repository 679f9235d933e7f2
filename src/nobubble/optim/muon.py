"""Muon with its Newton–Schulz orthogonalization in a chosen dtype (``muon_ns_dtype``).

``torch.optim.Muon`` orthogonalizes every update in bfloat16, fixed inside ``torch.optim._muon``;
its constructor takes the polynomial's coefficients and step count but neither the function nor
the dtype. bfloat16 is what a GPU's tensor cores do fast; a CPU without bfloat16 matrix units
multiplies bfloat16 matrices far slower than float32 (34x on this project's machine, which
advertises avx512_bf16), and the five iterations then dominate the step. So :class:`Muon`
subclasses torch's and replaces its step with the same update whose orthogonalization runs in
``ns_dtype``; in bfloat16 it is bitwise torch's (tested).

``auto`` resolves by the device type alone (:func:`ns_dtype`), so every rank and both engines
resolve it alike (the simulator and the pipeline stay bitwise equal) and a run continues on
another host of the same type with the same arithmetic. A CPU feature flag would not be a sound
rule: avx512_bf16 is present on machines where bfloat16 matmul is the slow path.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

# torch's Muon constants and LR adjustment (torch.optim._muon), so the update is exactly torch's
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _adjust_lr

Coefficients = tuple[float, float, float]


def ns_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype ``muon_ns_dtype=setting`` orthogonalizes in on ``device``: ``auto`` is bfloat16
    on CUDA and float32 elsewhere (float32 is never the slow path of a CPU)."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, setting)


def orthogonalize(
    matrix: torch.Tensor,
    dtype: torch.dtype,
    coefficients: Coefficients = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
    steps: int = DEFAULT_NS_STEPS,
    eps: float = EPS,
) -> torch.Tensor:
    """Muon's quintic Newton–Schulz iteration on ``matrix``, computed and returned in ``dtype``.

    For ``matrix = U·S·Vᵀ`` it gives about ``U·S'·Vᵀ`` with every singular value in S' near 1:
    the coefficients favour a steep start over exact convergence, so S' stays within about
    [0.5, 1.5] (torch's docstring; tests/test_muon.py checks the band). The operations are
    torch's, in the same order, so that in bfloat16 the result is torch's bitwise.
    """
    a, b, c = coefficients
    x = matrix.to(dtype)
    tall = matrix.size(0) > matrix.size(1)
    if tall:  # iterate on the wide orientation: the Gram matrix is the smaller side's
        x = x.T
    x = x / x.norm().clamp(min=eps)  # not in place: x may be the caller's tensor (float32)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def momentum_direction(
    grad: torch.Tensor, buffer: torch.Tensor, momentum: float, nesterov: bool
) -> torch.Tensor:
    """Update Muon's momentum ``buffer`` (an EMA of ``grad``, in place) and return the direction
    it orthogonalizes: the buffer, or with Nesterov the gradient moved towards it."""
    buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(buffer, momentum) if nesterov else buffer


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` orthogonalizing in ``ns_dtype`` (bfloat16: bitwise torch's update).

    The dtype is an attribute, not a param-group entry: the state dict keeps torch's shape (and
    its class name, which checkpoints record), and the config, not a checkpoint, chooses it.
    """

    def __init__(
        self, params: Iterable[Any], ns_dtype: torch.dtype = torch.bfloat16, **kwargs: Any
    ) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buffer = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                direction = momentum_direction(p.grad, buffer, group["momentum"], group["nesterov"])
                ortho = orthogonalize(
                    direction,
                    self.ns_dtype,
                    group["ns_coefficients"],
                    group["ns_steps"],
                    group["eps"],
                )
                p.mul_(1 - lr * decay)
                p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
