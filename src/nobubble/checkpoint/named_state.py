"""Optimizer state keyed by parameter name, loadable into an optimizer over any partition.

A torch ``state_dict`` numbers parameters by their position in the optimizer, so it only fits an
optimizer built over the same parameters in the same order: a pipeline stage's optimizer cannot
read the one-process engine's, nor stage 1 of four the state of stage 0 of two.
:class:`NamedState` holds the same information by name:

- ``params``: each parameter's state (``exp_avg``, ``momentum_buffer``, SOAP's lists of
  matrices, ...), as the optimizer keeps it;
- ``groups``: every param group's hyperparameters, with the names the group covers and the class
  of the optimizer that owns it (a :class:`~nobubble.optim.CompositeOptimizer` contributes the
  groups of all its parts). Group-level state lives here too: the pytorch_optimizer optimizers
  count their steps in the group (``group["step"]``);
- ``correction`` and ``buffers``: the update correction's name and its buffers by parameter name
  (:class:`~nobubble.corrections.base.UpdateCorrection`: error feedback's Δ[t-1], the
  nesterov velocity, ...); None without one.

:func:`load_named_state` loads such a state into an optimizer built (by
:func:`~nobubble.optim.build_optimizer`) over any subset of the parameters: the whole model in
the one-process engine, one stage of any split in the pipeline. Every group of the target takes the
hyperparameters of the saved groups that covered its names, which must agree (groups are per
kind of parameter and the same for every stage, so they do unless the state is inconsistent).

:func:`encode` and :func:`decode` turn a state into tensors (for safetensors) plus a JSON
document (scalars, hyperparameters, structure), so a checkpoint needs no pickle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from nobubble.corrections.base import UpdateCorrection
from nobubble.corrections.ef import ErrorFeedback
from nobubble.optim.composite import CompositeOptimizer, OptimizerLike

_STRUCTURE = ("params", "param_names")  # group keys that are structure, not hyperparameters


def whole(value: Any) -> Any:
    """``value`` gathered whole if it is a tensor-parallel DTensor shard, else as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


class NamedStateError(ValueError):
    """A named optimizer state does not fit the optimizer it is loaded into."""


@dataclass
class NamedGroup:
    """One param group: the names it covers, its hyperparameters (and group-level state)."""

    names: list[str]
    hyper: dict[str, Any]
    optimizer: str | None = None  # class of the owning torch optimizer; None if not recorded


@dataclass
class NamedState:
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    groups: list[NamedGroup] = field(default_factory=list)
    correction: str | None = None  # the update correction's kind ("ef", "nesterov", ...)
    buffers: dict[str, torch.Tensor] | None = None  # its buffers by name (None: no correction)

    def names(self) -> set[str]:
        """Every parameter the state covers (with or without per-parameter state yet)."""
        return {name for group in self.groups for name in group.names}

    def nbytes(self) -> int:
        """The bytes of every tensor the state holds (each storage once)."""
        storages: dict[int, int] = {}

        def count(value: Any) -> None:
            if isinstance(value, torch.Tensor):
                if isinstance(value, DTensor):  # a tensor-parallel shard: this rank's part
                    value = value.to_local()
                storage = value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            elif isinstance(value, list | tuple):
                for item in value:
                    count(item)
            elif isinstance(value, dict):
                for item in value.values():
                    count(item)

        count(self.params)
        count(self.buffers or {})
        count([group.hyper for group in self.groups])
        return sum(storages.values())

    def select(self, names: Collection[str]) -> NamedState:
        """The part of the state that covers ``names`` (groups keep only those names)."""
        wanted = set(names)
        groups = [
            NamedGroup([n for n in g.names if n in wanted], g.hyper, g.optimizer)
            for g in self.groups
        ]
        return NamedState(
            {n: s for n, s in self.params.items() if n in wanted},
            [g for g in groups if g.names],
            self.correction,
            None
            if self.buffers is None
            else {n: t for n, t in self.buffers.items() if n in wanted},
        )

    def whole(self) -> NamedState:
        """This state with every tensor-parallel DTensor shard gathered whole (a collective over
        each shard's tp ranks, which must all call it: the same names in the same order)."""
        params = {n: {k: whole(v) for k, v in state.items()} for n, state in self.params.items()}
        buffers = None if self.buffers is None else {n: whole(t) for n, t in self.buffers.items()}
        return dataclasses.replace(self, params=params, buffers=buffers)

    @staticmethod
    def merge(parts: Iterable[NamedState]) -> NamedState:
        """One state from the states of disjoint sets of parameters (checkpoint shards)."""
        merged = NamedState()
        kinds = set()
        for part in parts:
            overlap = merged.names() & part.names()
            if overlap:
                raise NamedStateError(
                    f"two optimizer states both cover {sorted(overlap)[:3]}; they cannot be merged"
                )
            merged.params.update(part.params)
            merged.groups.extend(part.groups)
            kinds.add(part.correction)
            merged.correction = part.correction
            if part.buffers is not None:
                merged.buffers = {**(merged.buffers or {}), **part.buffers}
        if len(kinds) > 1:
            raise NamedStateError(
                f"the optimizer states were saved with different corrections ({_kinds(kinds)})"
            )
        return merged


def _kinds(kinds: Iterable[str | None]) -> str:
    return ", ".join(sorted(kind or "none" for kind in kinds))


# -- optimizer <-> named state -------------------------------------------------------------------


def _parts(
    optimizer: OptimizerLike,
) -> tuple[list[torch.optim.Optimizer], UpdateCorrection | None]:
    correction = optimizer if isinstance(optimizer, UpdateCorrection) else None
    base = correction.base if correction is not None else optimizer
    parts = base.optimizers if isinstance(base, CompositeOptimizer) else [base]
    return list(parts), correction


def _group_names(group: dict[str, Any]) -> list[str]:
    names = group.get("param_names")
    if names is None:
        raise NamedStateError(
            "an optimizer group carries no parameter names; build the optimizer over named "
            "parameters (as nobubble.optim.build_optimizer does)"
        )
    return list(names)


def _named_parameters(optimizer: OptimizerLike) -> dict[str, torch.Tensor]:
    """name -> parameter, over every group of every part."""
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for name, param in zip(_group_names(group), group["params"], strict=True):
            if name in out:
                raise NamedStateError(f"parameter {name} appears twice in the optimizer")
            out[name] = param
    return out


def _add_state_dict(state: NamedState, sd: dict[str, Any], optimizer: str | None) -> None:
    """Add one torch optimizer's position-keyed ``state_dict`` to ``state``."""
    for group in sd["param_groups"]:
        names = _group_names(group)
        hyper = {k: v for k, v in group.items() if k not in _STRUCTURE}
        state.groups.append(NamedGroup(names, hyper, optimizer))
        for index, name in zip(group["params"], names, strict=True):
            if index in sd["state"]:
                state.params[name] = dict(sd["state"][index])


def named_state(optimizer: OptimizerLike) -> NamedState:
    """The state of ``optimizer`` (any of :data:`nobubble.optim.OPTIMIZERS`, with or without an
    update correction) keyed by parameter name. Tensors are the optimizer's own, not copies."""
    parts, correction = _parts(optimizer)
    state = NamedState()
    for part in parts:
        _add_state_dict(state, part.state_dict(), type(part).__name__)
    if correction is not None:
        name_of = {param: name for name, param in _named_parameters(optimizer).items()}
        state.correction = correction.kind
        state.buffers = {name_of[param]: buf for param, buf in correction.buffers.items()}
    return state


def from_state_dict(sd: dict[str, Any]) -> NamedState:
    """A named state from a position-keyed state dict of :class:`ErrorFeedback`,
    :class:`CompositeOptimizer` or a torch optimizer, as nobubble's checkpoints before format 2
    stored it (the groups carry ``param_names``; the optimizer classes are not known)."""
    state = NamedState()
    base = sd["base"] if "prev_delta" in sd else sd
    for part in base.get("optimizers", [base]):
        _add_state_dict(state, part, None)
    if "prev_delta" in sd:
        order = [name for group in state.groups for name in group.names]  # ErrorFeedback._params
        state.correction = ErrorFeedback.kind
        state.buffers = {order[index]: delta for index, delta in sd["prev_delta"].items()}
    return state


def load_named_state(
    optimizer: OptimizerLike, state: NamedState, skip_unowned: bool = False
) -> None:
    """Load ``state`` into ``optimizer``, built over any subset of the parameters it covers.

    Every parameter of the optimizer must be in ``state``; a parameter of ``state`` that the
    optimizer does not hold is an error unless ``skip_unowned`` (loading from a set of checkpoint
    shards, which may hold other stages' parameters too). The optimizer takes the tensors of
    ``state`` over (cast to its parameters' device and dtype as torch's ``load_state_dict`` does),
    so a state is loaded once.
    """
    params = _named_parameters(optimizer)
    saved = state.names()
    missing = sorted(set(params) - saved)
    if missing:
        raise NamedStateError(
            f"the saved optimizer state has no entry for {len(missing)} parameter(s) of this "
            f"optimizer, e.g. {missing[:3]}; it was saved for another model or another subset"
        )
    extra = sorted(saved - set(params))
    if extra and not skip_unowned:
        raise NamedStateError(
            f"the saved optimizer state covers {len(extra)} parameter(s) this optimizer does not "
            f"hold, e.g. {extra[:3]}; it was saved for another model"
        )
    parts, correction = _parts(optimizer)
    mine = None if correction is None else correction.kind
    if mine != state.correction:
        raise NamedStateError(
            f"the saved optimizer state was saved with correction={state.correction or 'none'}, "
            f"this optimizer has correction={mine or 'none'}"
        )
    group_of = {name: group for group in state.groups for name in group.names}
    for part in parts:
        _load_part(part, state, group_of)
    if correction is not None and state.buffers is not None:
        correction.buffers = {
            params[name]: buf.to(device=params[name].device, dtype=params[name].dtype)
            for name, buf in state.buffers.items()
            if name in params
        }


def _load_part(
    part: torch.optim.Optimizer, state: NamedState, group_of: dict[str, NamedGroup]
) -> None:
    """Translate the named state into ``part``'s positions and let ``part`` load it."""
    cls = type(part).__name__
    current = part.state_dict()
    groups, per_param = [], {}
    for group in current["param_groups"]:
        names = _group_names(group)
        sources = [group_of[name] for name in names]
        other = {s.optimizer for s in sources} - {None, cls}
        if other:
            raise NamedStateError(
                f"{names[0]} was optimized by {other.pop()}, this optimizer uses {cls}: the "
                "state was saved with another optimizer"
            )
        groups.append({**_agreed_hyper(sources, names), "params": group["params"]})
        groups[-1]["param_names"] = names
        for index, name in zip(group["params"], names, strict=True):
            if name in state.params:
                per_param[index] = state.params[name]
    part.load_state_dict({"state": per_param, "param_groups": groups})


def _agreed_hyper(sources: list[NamedGroup], names: list[str]) -> dict[str, Any]:
    """The hyperparameters of the saved groups behind one target group; they must agree."""
    first, seen = sources[0], {id(sources[0])}
    for source, name in zip(sources, names, strict=True):
        if id(source) in seen:
            continue
        seen.add(id(source))
        for key in sorted(first.hyper.keys() | source.hyper.keys()):
            a, b = first.hyper.get(key), source.hyper.get(key)
            if not _same(a, b):
                raise NamedStateError(
                    f"{names[0]} and {name} share a param group here but were saved in groups "
                    f"that disagree on {key!r} ({a!r} vs {b!r}); the saved state is inconsistent"
                )
    return dict(first.hyper)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


# -- named state <-> (tensors, JSON) -------------------------------------------------------------

# JSON stands for itself except for three markers: {"tensor": key} (a tensor stored under key),
# {"tuple": [...]} and {"dict": {...}} (so that hyperparameters keep their types).


def _encode(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors[key] = value
        return {"tensor": key}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, f"{key}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{key}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _encode(v, f"{key}/{k}", tensors) for k, v in value.items()}}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise NamedStateError(
        f"optimizer state {key} is a {type(value).__name__}, which a checkpoint cannot store "
        "without pickle; nobubble stores tensors, numbers, strings and lists/tuples/dicts of them"
    )


def _decode(value: Any, tensor: Callable[[str], torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensor) for v in value]
    if isinstance(value, dict):
        if "tensor" in value:
            return tensor(value["tensor"])
        if "tuple" in value:
            return tuple(_decode(v, tensor) for v in value["tuple"])
        return {k: _decode(v, tensor) for k, v in value["dict"].items()}
    return value


def encode(state: NamedState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors by key, a JSON document) that :func:`decode` turns back into ``state``.

    Tensor keys: ``optim/{name}/{state key}`` (``/{i}`` into lists), ``group/{i}/{key}`` for a
    tensor hyperparameter, ``{correction}/{name}`` for a correction's buffer (``ef/{name}``:
    error feedback's, listed under ``"ef"`` as before other corrections existed; the others
    under ``"correction": {"kind": ..., "names": [...]}``).
    """
    tensors: dict[str, torch.Tensor] = {}
    params = {
        name: {k: _encode(v, f"optim/{name}/{k}", tensors) for k, v in values.items()}
        for name, values in state.params.items()
    }
    groups = [
        {
            "optimizer": group.optimizer,
            "names": group.names,
            "hyper": {k: _encode(v, f"group/{i}/{k}", tensors) for k, v in group.hyper.items()},
        }
        for i, group in enumerate(state.groups)
    ]
    doc: dict[str, Any] = {"params": params, "groups": groups, "ef": None}
    if state.correction is not None:
        buffers = state.buffers or {}
        names = sorted(buffers)
        tensors.update({f"{state.correction}/{name}": buffers[name] for name in names})
        if state.correction == ErrorFeedback.kind:
            doc["ef"] = names
        else:
            doc["correction"] = {"kind": state.correction, "names": names}
    return tensors, doc


def decode(
    doc: dict[str, Any],
    tensor: Callable[[str], torch.Tensor],
    names: Collection[str] | None = None,
) -> NamedState:
    """The state :func:`encode` wrote, reading tensors with ``tensor(key)``; with ``names``, only
    the part covering those parameters (and only their tensors are read)."""
    wanted = None if names is None else set(names)

    def keep(name: str) -> bool:
        return wanted is None or name in wanted

    groups = []
    for group in doc["groups"]:
        covered = [n for n in group["names"] if keep(n)]
        if covered:
            hyper = {k: _decode(v, tensor) for k, v in group["hyper"].items()}
            groups.append(NamedGroup(covered, hyper, group.get("optimizer")))
    params = {
        name: {k: _decode(v, tensor) for k, v in values.items()}
        for name, values in doc["params"].items()
        if keep(name)
    }
    kind, names = None, None
    if doc.get("ef") is not None:
        kind, names = ErrorFeedback.kind, doc["ef"]
    elif doc.get("correction") is not None:
        kind, names = doc["correction"]["kind"], doc["correction"]["names"]
    buffers = None
    if kind is not None:
        buffers = {name: tensor(f"{kind}/{name}") for name in names if keep(name)}
    return NamedState(params, groups, kind, buffers)
