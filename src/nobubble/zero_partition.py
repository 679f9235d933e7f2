"""Sharded data parallelism (``zero=1``, ``zero=2``): which part of a model stage's parameters
each of the stage's ``dp`` replicas updates, and the flat buckets in which the replicas exchange
gradients and new weights.

Every replica holds the whole weights (both versions under 2bw); only the optimizer's and the
correction's state, and under ``zero=2`` the reduced gradient, are split. A parameter is either

- **split** into ``dp`` blocks of rows (its first dimension, ``ceil(rows/dp)`` each, the last ones
  shorter or empty), each replica updating one block, where the optimizer is element-wise on it
  (AdamW, Lion, Adan, NAdamW, Signum, SGD, MARS's 1-D tensors; MoE experts under Muon, whose
  rows are whole expert matrices), or
- **owned** whole by one replica where the update needs the whole matrix (Muon's Newton–Schulz,
  SOAP's preconditioners, MARS's per-tensor norm); the registry says which
  (:func:`nobubble.optim.registry.updates_whole`).

Owned parameters go to replicas by a greedy balance of optimizer state (the costliest first,
to the replica that holds the least state so far, ties by elements, then by replica index),
after the split blocks, so each replica's state is as near 1/dp as whole parameters allow. A
parameter's state is what its optimizer holds for its shape
(:func:`nobubble.optim.registry.state_elements`): SOAP's eigenbases grow with the square of a
matrix's sides, not with its elements, so balancing elements would not balance SOAP's state;
under an element-wise optimizer state is a fixed multiple of elements and the plan is the one
elements give. A tied weight (``first``) is placed first, on replica 0, so that the two stages
holding its copies split it alike. The plan is a function of the parameters' names and shapes,
``dp`` and the optimizer only: every replica computes the same one.

A block of rows of a row-major tensor is contiguous, and keeps the parameter's number of
dimensions, so the optimizer classifies it as the whole parameter
(:mod:`nobubble.optim.param_groups`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nobubble.checkpoint.named_state import NamedGroup, NamedState, NamedStateError
from nobubble.optim.registry import state_elements, updates_whole


@dataclass(frozen=True)
class Part:
    """Rows ``lo``..``hi`` of parameter ``name`` (all of it when owned whole)."""

    name: str
    lo: int
    hi: int
    shape: tuple[int, ...]  # the whole parameter's

    @property
    def row(self) -> int:
        """Elements per row (a 0-d parameter: one row of one element)."""
        return _row(self.shape)

    @property
    def numel(self) -> int:
        return (self.hi - self.lo) * self.row

    @property
    def part_shape(self) -> tuple[int, ...]:
        return (self.hi - self.lo, *self.shape[1:]) if self.shape else ()

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of ``tensor`` (shaped as the parameter), a view."""
        return tensor if tensor.ndim == 0 else tensor[self.lo : self.hi]

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of ``tensor`` (shaped as the parameter) as a flat view."""
        return tensor.reshape(-1)[self.lo * self.row : self.hi * self.row]


class ShardPlan:
    """The parts of one model stage's trainable parameters (``shapes``, in order) on each of
    ``dp`` replicas; ``replica``: this process's; ``whole``: the names an update needs whole;
    ``first``: a name to place before all others (the tied weight); ``state``: the elements of
    optimizer state each whole parameter costs (default: its elements)."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        dp: int,
        replica: int,
        whole: Collection[str],
        first: str | None = None,
        state: Mapping[str, int] | None = None,
    ) -> None:
        self.shapes, self.dp, self.replica = dict(shapes), dp, replica
        cost = {n: _numel(shape) for n, shape in shapes.items()} if state is None else state
        self.owner: dict[str, int] = {}
        elements, held = [0] * dp, [0] * dp
        self._parts: list[dict[str, Part]] = [{} for _ in range(dp)]
        for name, shape in shapes.items():
            if name not in whole and len(shape) > 0:
                rows, size = shape[0], -(-shape[0] // dp)
                for r in range(dp):
                    lo, hi = min(r * size, rows), min((r + 1) * size, rows)
                    self._parts[r][name] = Part(name, lo, hi, shape)
                    elements[r] += self._parts[r][name].numel
                    held[r] += cost[name] * (hi - lo) // rows  # element-wise: by its rows
        owned = [n for n in shapes if n in whole or len(shapes[n]) == 0]
        order = list(shapes)
        owned.sort(key=lambda n: (n != first, -cost[n], -_numel(shapes[n]), order.index(n)))
        for name in owned:
            r = 0 if name == first else min(range(dp), key=lambda i: (held[i], elements[i], i))
            self.owner[name] = r
            shape = shapes[name]
            self._parts[r][name] = Part(name, 0, shape[0] if shape else 1, shape)
            elements[r] += _numel(shape)
            held[r] += cost[name]
        self.elements, self.state = elements, held  # per replica

    @classmethod
    def of(
        cls,
        params: Mapping[str, torch.Tensor],
        optim: str,
        momentum: float,
        dp: int,
        replica: int,
        first: str | None = None,
    ) -> ShardPlan:
        """The plan of a stage's trainable ``params`` under optimizer ``optim``: the registry
        says which parameters it updates whole and the state each costs it."""
        return cls(
            {n: tuple(p.shape) for n, p in params.items()},
            dp,
            replica,
            [n for n, p in params.items() if updates_whole(optim, n, p)],
            first,
            {n: state_elements(optim, momentum, n, p) for n, p in params.items()},
        )

    def parts(self, replica: int | None = None, names: Collection[str] | None = None) -> list[Part]:
        """The non-empty parts of ``replica`` (default: this one), in parameter order, of
        ``names`` (default: all)."""
        r = self.replica if replica is None else replica
        return [
            part
            for name, part in self._parts[r].items()
            if part.numel and (names is None or name in names)
        ]

    def ordered(self, replica: int, names: Collection[str]) -> list[Part]:
        """As :meth:`parts`, in the order of ``self.shapes`` (a bucket's order)."""
        found = {p.name: p for p in self.parts(replica, names)}
        return [found[n] for n in self.shapes if n in found]

    def bucket(self, names: Collection[str]) -> Bucket:
        """The flat bucket of ``names`` that the replicas exchange (see :class:`Bucket`)."""
        return Bucket([self.ordered(r, names) for r in range(self.dp)], self.replica)

    def describe(self) -> dict[str, Any]:
        """What this replica holds, for its stage report: the parameters it owns whole and how
        many elements of state-bearing parameters it updates."""
        mine = [n for n, r in self.owner.items() if r == self.replica]
        return {"owned": sorted(mine), "elements": self.elements[self.replica]}

    # -- optimizer state: this replica's part of a whole state, and whole states from parts --

    def slice_state(self, state: NamedState) -> NamedState:
        """The part of ``state`` (of whole parameters, e.g. a checkpoint's) this replica updates:
        each per-element tensor of a split parameter narrowed to its rows (copied, so the whole
        state is not kept alive), everything of a parameter it owns, nothing else."""
        parts = {p.name: p for p in self.parts()}
        mine = state.select(parts.keys() & state.names())

        def cut(name: str, value: Any) -> Any:
            return _map(value, lambda t: self._narrow(name, t, parts[name]))

        mine.params = {n: cut(n, s) for n, s in mine.params.items()}
        if mine.buffers is not None:
            mine.buffers = {n: cut(n, b) for n, b in mine.buffers.items()}
        return mine

    def join_states(self, states: Sequence[NamedState]) -> NamedState:
        """The whole state from every replica's (``states[r]``: replica ``r``'s, as its
        optimizer holds it): split parameters' tensors concatenated in replica order."""
        joined = NamedState(correction=states[0].correction)
        seen: set[str] = set()
        for state in states:
            for group in state.groups:
                new = [n for n in group.names if n not in seen]
                seen.update(new)
                if new:
                    joined.groups.append(NamedGroup(new, group.hyper, group.optimizer))
        for name in self.shapes:
            holders = [s for s in states if name in s.params]
            if holders:
                joined.params[name] = self._join(name, [s.params[name] for s in holders])
        if any(s.buffers is not None for s in states):
            joined.buffers = {}
            for name in self.shapes:
                holders = [s.buffers[name] for s in states if s.buffers and name in s.buffers]
                if holders:
                    joined.buffers[name] = self._join(name, holders)
        return joined

    def _narrow(self, name: str, tensor: torch.Tensor, part: Part) -> torch.Tensor:
        dim = None if name in self.owner else self._element_dim(name, tensor)
        if dim is None:
            return tensor
        return tensor.narrow(dim, part.lo, part.hi - part.lo).clone()

    def _join(self, name: str, values: list[Any]) -> Any:
        """One parameter's state from its replicas' parts (in replica order)."""
        first = values[0]
        if name in self.owner or len(values) == 1:
            return first
        if isinstance(first, torch.Tensor):
            dim = self._part_dim(name, first)
            return first if dim is None else torch.cat(values, dim)
        if isinstance(first, list | tuple):
            joined = [self._join(name, list(items)) for items in zip(*values, strict=True)]
            return type(first)(joined)
        if isinstance(first, dict):
            return {k: self._join(name, [v[k] for v in values]) for k in first}
        return first

    def _element_dim(self, name: str, tensor: torch.Tensor) -> int | None:
        """The dimension of ``tensor`` (a state of the whole parameter ``name``) along which it
        follows the parameter's rows; None for a scalar (a step count). Anything else cannot be
        split, and is refused: the optimizer is not element-wise on it."""
        shape = self.shapes[name]
        if tensor.ndim == 0 or not shape:
            return None
        lead = tensor.ndim - len(shape)
        if lead < 0 or tuple(tensor.shape[lead:]) != shape:
            raise NamedStateError(
                f"the optimizer state of {name} holds a tensor of shape {tuple(tensor.shape)}, "
                f"which does not follow the parameter's {shape}: it cannot be split over "
                "replicas (the optimizer is not element-wise on it); this is a bug in nobubble's "
                "sharding plan for this optimizer"
            )
        return lead

    def _part_dim(self, name: str, tensor: torch.Tensor) -> int | None:
        """As :meth:`_element_dim` for a tensor of one replica's part of ``name``."""
        shape = self.shapes[name]
        if tensor.ndim == 0 or not shape:
            return None
        return tensor.ndim - len(shape)


class Bucket:
    """One flat buffer of ``dp`` equal segments: segment r holds replica r's parts of some
    parameters (``parts[r]``), one after the other, zero-padded to the longest segment. An
    all-reduce, reduce-scatter or all-gather over the replicas exchanges it whole."""

    def __init__(self, parts: list[list[Part]], replica: int) -> None:
        self.parts, self.replica = parts, replica
        self.sizes = [sum(p.numel for p in ps) for ps in parts]
        self.segment = max(self.sizes) if self.sizes else 0

    @property
    def numel(self) -> int:
        return self.segment * len(self.parts)

    def pack(
        self,
        tensors: dict[str, torch.Tensor],
        like: torch.Tensor,
        replicas: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """The segments of ``replicas`` (default: all) filled from ``tensors`` (whole, by name;
        a missing one reads as zeros), as one flat tensor of ``like``'s dtype and device."""
        chunks: list[torch.Tensor] = [like.new_zeros(0)]
        for r in range(len(self.parts)) if replicas is None else replicas:
            for part in self.parts[r]:
                tensor = tensors.get(part.name)
                if tensor is None:
                    chunks.append(like.new_zeros(part.numel))
                else:
                    chunks.append(part.flat(tensor))
            chunks.append(like.new_zeros(self.segment - self.sizes[r]))
        return torch.cat(chunks)

    def views(self, segment: torch.Tensor, replica: int | None = None) -> dict[str, torch.Tensor]:
        """Replica ``replica``'s parts (default: this one's) in its ``segment``, each shaped as
        the part of its parameter."""
        r = self.replica if replica is None else replica
        out, offset = {}, 0
        for part in self.parts[r]:
            out[part.name] = segment[offset : offset + part.numel].view(part.part_shape)
            offset += part.numel
        return out

    def unpack(self, full: torch.Tensor, targets: dict[str, torch.Tensor]) -> None:
        """Copy every other replica's parts from ``full`` (all segments) into ``targets`` (whole
        tensors by name)."""
        for r, parts in enumerate(self.parts):
            if r == self.replica:
                continue
            offset = r * self.segment
            for part in parts:
                part.flat(targets[part.name]).copy_(full[offset : offset + part.numel])
                offset += part.numel


def _row(shape: tuple[int, ...]) -> int:
    return _numel(shape[1:]) if shape else 1


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _map(value: Any, fn: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (lists, tuples, dicts)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list | tuple):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    return value


def state_to(state: NamedState, device: torch.device | str) -> NamedState:
    """``state`` with every tensor moved to ``device`` (to send it between processes)."""
    return NamedState(
        {n: _map(s, lambda t: t.to(device)) for n, s in state.params.items()},
        [
            NamedGroup(g.names, _map(g.hyper, lambda t: t.to(device)), g.optimizer)
            for g in state.groups
        ],
        state.correction,
        None if state.buffers is None else {n: b.to(device) for n, b in state.buffers.items()},
    )
