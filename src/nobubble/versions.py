"""Weight versions of one stage, shared by the one-process engine and the pipeline runtime.

Version v of a stage is its weights after v optimizer steps (version 0: the initial weights). With
gradient delay d (:mod:`nobubble.schedules.registry`) the gradient applied at step t is computed at
version max(t - d, 0): :func:`gradient_version`.


Every version is a set of independent leaf tensors that forwards and backwards run with (through
``torch.func.functional_call``); gradients land on those leaves. A parameter that no optimizer
steps (``requires_grad=False``, such as an MoE balance bias) is versioned alike, without
gradients. The optimizer's parameters never
take part in a forward: they alias the storage of the newest version, so an optimizer step updates
that version in place. When an in-flight microbatch still needs the newest version, the step first
copies it into a free buffer and points the parameters there ("a version switch is a pointer flip,
not a copy" for everyone reading the old version). Nothing autograd saved is ever modified.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

Weights = dict[str, torch.Tensor]


def gradient_version(step: int, delay: int) -> int:
    """The weight version at which the gradient applied at ``step`` was computed."""
    return max(step - delay, 0)


def _leaf(value: torch.Tensor, trainable: bool) -> torch.Tensor:
    return value.detach().clone().requires_grad_(trainable)


class VersionStore:
    """Versions ``v -> Weights`` of the parameters ``params`` (the optimizer's)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], version: int = 0) -> None:
        self.params = params
        self.versions: dict[int, Weights] = {}
        self.free: list[Weights] = []
        self.newest = version
        self.adopt(version, {n: p.detach() for n, p in params.items()})

    def adopt(self, version: int, values: Weights) -> None:
        """Hold a copy of ``values`` as ``version``; if it is the newest, the optimizer's too."""
        weights = {
            n: _leaf(values[n].to(p.device), p.requires_grad) for n, p in self.params.items()
        }
        self.versions[version] = weights
        if version >= self.newest:
            self.newest = version
            self._point_params_at(weights)

    def _point_params_at(self, weights: Weights) -> None:
        for name, param in self.params.items():
            if isinstance(param, DTensor):  # a tensor-parallel shard (nobubble.model.tensor_split)
                # ``.data =`` on a DTensor gives it a copy, not the version's storage; its local
                # shard is what the optimizer writes (tests/test_tensor_parallel.py holds this)
                param._local_tensor = weights[name]._local_tensor
            else:
                param.data = weights[name].data

    def __getitem__(self, version: int) -> Weights:
        try:
            return self.versions[version]
        except KeyError:
            held = sorted(self.versions)
            raise RuntimeError(f"weight version {version} is not held (held: {held})") from None

    def held(self) -> list[int]:
        return sorted(self.versions)

    def take_gradients(self, version: int) -> None:
        """Move the gradients accumulated on ``version`` onto the optimizer's parameters."""
        for name, param in self.params.items():
            leaf = self.versions[version][name]
            param.grad, leaf.grad = leaf.grad, None

    def begin_step(self, still_needed: bool) -> int:
        """Make the newest version the target of the coming optimizer step; return its number.

        If ``still_needed`` (a microbatch in flight or to come uses the current newest version),
        the step writes into a copy held as a new version; otherwise it updates in place and the
        current newest version simply becomes the next one.
        """
        current = self.versions.pop(self.newest)
        if still_needed:
            self.versions[self.newest] = current
            target = self.spare()
            with torch.no_grad():
                for name, tensor in target.items():
                    tensor.copy_(current[name])
            current = target
            self._point_params_at(current)
        self.newest += 1
        self.versions[self.newest] = current
        return self.newest

    def spare(self) -> Weights:
        """A set of leaf buffers shaped like the parameters, to overwrite: a free one if any."""
        if self.free:
            return self.free.pop()
        return {
            n: torch.empty_like(p).requires_grad_(p.requires_grad) for n, p in self.params.items()
        }

    def take(self, version: int) -> Weights:
        """Hand ``version``'s buffers over to the caller, who may overwrite them (it is no
        longer held)."""
        if version == self.newest:
            raise RuntimeError(f"version {version} is the optimizer's and cannot be handed over")
        weights = self[version]
        del self.versions[version]
        return weights

    def recycle(self, weights: Weights) -> None:
        """Buffers obtained from :meth:`spare` or :meth:`take` that nobody reads any more."""
        self.free.append(weights)

    def release(self, version: int) -> None:
        """Nothing will use ``version`` again: keep its buffer for reuse."""
        if version != self.newest and version in self.versions:
            self.free.append(self.versions.pop(version))

    def release_older_than(self, version: int) -> None:
        for v in [v for v in self.versions if v < version]:
            self.release(v)

    def load(self, snapshot: dict[int, Weights]) -> None:
        """Replace every version by those of ``snapshot`` (a checkpoint's)."""
        self.versions.clear()
        self.free.clear()
        self.newest = -1
        for version in sorted(snapshot):
            self.adopt(version, snapshot[version])

    def snapshot(self) -> dict[int, Weights]:
        return {v: {n: t.detach() for n, t in w.items()} for v, w in self.versions.items()}
