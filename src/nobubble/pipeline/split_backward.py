"""The split backward of zero-bubble schedules: I now, W later, each doing only its own work.

I computes the gradient of the stage's input (what the previous stage waits for) and of every
weight but the linear layers'; W computes the linear layers' weight gradients, the matmuls
grad_weight = grad_outputᵀ · input that I skipped. During the forward, a hook on every linear
layer keeps its input and a hook on its output keeps the gradient that reaches it during I; I is
``torch.autograd.grad`` to the input and the other weights only, so autograd leaves the linear
weight-gradient matmuls out (no path to what was asked needs them) and frees the graph. W then
forms each weight gradient as autograd's matmul backward forms it (in the dtype the layer ran in
under autocast, then cast to the weight's) and accumulates it as ``AccumulateGrad`` does, so the
gradients are bitwise those of one fused backward (tested against plain gradient accumulation).

What W holds between I and W is what the zero-bubble paper counts: each linear layer's input and
output gradient, not the whole graph. Activation checkpointing and torch.compile are refused with
this split: recomputation and compiled graphs do not run the layers' hooks as the forward did.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class _Linear:
    weight: torch.Tensor  # the tensor the forward used (a weight version, under functional_call)
    input: torch.Tensor
    grad_output: torch.Tensor | None = None


def accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad += grad`` as autograd accumulates (the first gradient is taken as it is)."""
    param.grad = grad if param.grad is None else param.grad + grad


class SplitBackward:
    """I and W for one stage module; one record per microbatch between its forward and its W."""

    def __init__(self, module: nn.Module) -> None:
        embedding = getattr(module, "embed", None)
        shared = embedding.weight if embedding is not None else None
        # a head tied to an embedding the stage also looks up gets both gradients in I
        self.deferred = [
            m for m in module.modules() if isinstance(m, nn.Linear) and m.weight is not shared
        ]
        self.records: dict[int, list[_Linear]] = {}

    @contextmanager
    def forward(self, microbatch: int) -> Iterator[None]:
        """Record the deferred layers' inputs (and, later, output gradients) of this forward."""
        records: list[_Linear] = []

        def keep(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            record = _Linear(module.weight, args[0])
            records.append(record)
            out.register_hook(lambda grad: setattr(record, "grad_output", grad))

        handles = [m.register_forward_hook(keep) for m in self.deferred]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        self.records[microbatch] = records

    def input_gradient(
        self,
        microbatch: int,
        target: torch.Tensor,
        grad: torch.Tensor | None,
        stage_input: torch.Tensor | None,
        weights: dict[str, torch.Tensor],
    ) -> torch.Tensor | None:
        """I: the stage input's gradient (None if it has none); the other weights' gradients are
        accumulated now."""
        linear = {id(r.weight) for r in self.records[microbatch]}
        others = [w for w in weights.values() if w.requires_grad and id(w) not in linear]
        wanted = ([stage_input] if stage_input is not None else []) + others
        grads = torch.autograd.grad(target, wanted, grad, allow_unused=True)
        for weight, g in zip(others, grads[len(wanted) - len(others) :], strict=True):
            if g is not None:
                accumulate(weight, g)
        return grads[0] if stage_input is not None else None

    def drop(self, microbatch: int) -> None:
        """Forget this microbatch's records: a whole B computed its weight gradients (DualPipeV
        splits some backwards of a stage and not others)."""
        del self.records[microbatch]

    def weight_gradient(self, microbatch: int) -> None:
        """W: the deferred layers' weight gradients of this microbatch."""
        for r in self.records.pop(microbatch):
            if r.grad_output is None:  # the layer's output did not reach the loss
                continue
            g = r.grad_output.reshape(-1, r.grad_output.shape[-1])
            x = r.input.to(g.dtype).reshape(-1, r.input.shape[-1])
            accumulate(r.weight, g.t().mm(x).to(r.weight.dtype))
