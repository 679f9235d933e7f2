"""Muon with its Newton–Schulz orthogonalization in a chosen dtype (``muon_ns_dtype``).

``torch.optim.Muon`` orthogonalizes every update in bfloat16, fixed inside ``torch.optim._muon``;
its constructor takes the polynomial's coefficients and step count but neither the function nor
the dtype. bfloat16 is what a GPU's tensor cores do fast, and so does a CPU with bfloat16
matrix instructions; a CPU without them emulates bfloat16 matrix products or falls back to a
generic kernel, many times slower than float32 (docs/optimizers.md has the measurements), and the
five iterations then dominate the step. So :class:`Muon` subclasses torch's and replaces its
step with the same update whose orthogonalization runs in ``ns_dtype``; in bfloat16 it is
bitwise torch's (tested).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from nobubble.model.tensor_split import blocks as blocks_of
from nobubble.model.tensor_split import split_problem

# torch's Muon constants and LR adjustment, so that the update is exactly torch's. They are
# private to torch.optim._muon (nobubble's one home for them: ExpertMuon takes adjust_lr from
# here), and torch may move them in any release: tests/test_torch_private.py names what moved,
# and so does importing this module.
try:
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS
    from torch.optim._muon import _adjust_lr as adjust_lr
except ImportError as exc:
    raise ImportError(
        f"nobubble's Muon (nobubble/optim/muon.py) uses private names of torch.optim._muon that "
        f"torch {torch.__version__} does not have ({exc}); install the torch nobubble is tested "
        "with (scripts/bootstrap.sh: torch==2.13.0), or adapt nobubble/optim/muon.py to this torch"
    ) from exc

Coefficients = tuple[float, float, float]

# x86 features (torch.cpu.get_capabilities) that give bfloat16 matrix products instructions of
# their own: with one, bfloat16 Newton–Schulz beats float32; without, it is the slow path. ARM's
# bf16 is left out: not measured, and float32 is never far from the fastest.
BF16_MATMUL_FEATURES = ("avx512_bf16", "amx_bf16")


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU has bfloat16 matrix instructions (cpuinfo's answer, which torch caches)."""
    capabilities = torch.cpu.get_capabilities()
    return any(capabilities.get(feature, False) for feature in BF16_MATMUL_FEATURES)


def ns_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype ``muon_ns_dtype=setting`` orthogonalizes in on ``device``: ``auto`` is bfloat16
    on CUDA and on a CPU with bfloat16 matrix instructions, float32 elsewhere. It depends on the
    device type and the host's CPU only, so the ranks of one machine and both engines resolve it
    alike (the one-process engine and the pipeline stay bitwise equal)."""
    if setting != "auto":
        return getattr(torch, setting)
    if device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16_matmul()):
        return torch.bfloat16
    return torch.float32


def orthogonalize(
    matrix: torch.Tensor,
    dtype: torch.dtype,
    coefficients: Coefficients = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
    steps: int = DEFAULT_NS_STEPS,
    eps: float = EPS,
) -> torch.Tensor:
    """Muon's quintic Newton–Schulz iteration on ``matrix``, computed and returned in ``dtype``.

    For ``matrix = U·S·Vᵀ`` it gives about ``U·S'·Vᵀ`` with the singular values in S' near 1:
    the coefficients favour a steep start over exact convergence, so five steps take every
    singular value above 0.05 of the Frobenius norm into [0.68, 1.14], not to 1
    (tests/test_muon.py). The operations are torch's, in the same order, so that in bfloat16 the
    result is torch's bitwise.
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

    ``blocks`` > 1 emulates Muon under tensor parallelism without gathering (``muon_blocks``):
    each matrix's direction is cut into the blocks tensor parallelism's ranks would hold
    (:func:`nobubble.model.tensor_split.blocks`, so the parameters must be given with their
    names), each orthogonalized on its own and applied with the learning rate adjusted to its
    own shape, as a whole matrix is. The momentum stays whole: it is elementwise.
    """

    def __init__(
        self,
        params: Iterable[Any],
        ns_dtype: torch.dtype = torch.bfloat16,
        blocks: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype
        self.blocks = blocks
        if blocks > 1:
            for group in self.param_groups:
                if "param_names" not in group:
                    raise ValueError(f"Muon with blocks={blocks} needs named parameters")
                for name, p in zip(group["param_names"], group["params"], strict=True):
                    problem = split_problem(name, tuple(p.shape), blocks)
                    if problem:
                        raise ValueError(f"muon_blocks={blocks}: {problem}")

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            names = group.get("param_names", [None] * len(group["params"]))
            for name, p in zip(names, group["params"], strict=True):
                if p.grad is None:
                    continue
                buffer = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                direction = momentum_direction(p.grad, buffer, group["momentum"], group["nesterov"])
                p.mul_(1 - lr * decay)
                if self.blocks == 1:
                    pairs: Iterable[tuple[torch.Tensor, torch.Tensor]] = [(direction, p)]
                else:
                    pairs = zip(
                        blocks_of(direction, name, self.blocks),
                        blocks_of(p, name, self.blocks),
                        strict=True,
                    )
                for part, target in pairs:
                    ortho = orthogonalize(
                        part,
                        self.ns_dtype,
                        group["ns_coefficients"],
                        group["ns_steps"],
                        group["eps"],
                    )
                    target.add_(ortho, alpha=-adjust_lr(lr, group["adjust_lr_fn"], target.shape))
