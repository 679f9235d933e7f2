"""The optimizer registry: config → optimizer over any subset of named parameters.

Every factory takes the param groups of :func:`nobubble.optim.param_groups.param_groups` (one per
kind, each with its weight decay) and maps the config's hyperparameters onto the library's
arguments; docs/optimizers.md lists the mapping and the reasons behind each choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from nobubble.config import TrainConfig
from nobubble.config.extras import require
from nobubble.optim.composite import CompositeOptimizer, OptimizerLike
from nobubble.optim.expert_muon import ExpertMuon
from nobubble.optim.muon import Muon, ns_dtype
from nobubble.optim.param_groups import Kind, classify, param_groups

Groups = list[dict[str, Any]]

# torch's NAdam warms its momentum up as β1·(1 - 0.5·0.96^(t·momentum_decay)) (Dozat); at the
# default 4e-3 that is about β1/2 for the first thousand steps. Unless nadam_momentum_decay asks
# for that warm-up, a decay this large makes 0.96^(...) underflow to 0 from step 1, so the
# momentum is β1 throughout, as in NAdamW.
_CONSTANT_NADAM_MOMENTUM = 1e6


def _adamw(groups: Groups, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def _nadamw(groups: Groups, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.NAdam(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        momentum_decay=cfg.nadam_momentum_decay or _CONSTANT_NADAM_MOMENTUM,
        decoupled_weight_decay=True,
    )


def _muon(groups: Groups, cfg: TrainConfig) -> CompositeOptimizer:
    """Muon on the hidden matrices (in ``muon_blocks`` blocks each) and on every expert's matrix
    (whole), AdamW on embeddings, head, routers and gains; same ``lr`` for all. Newton–Schulz
    runs in ``muon_ns_dtype`` resolved for the parameters' device (the same on every rank: it
    depends on the device type only)."""
    hidden = [g for g in groups if g["kind"] == Kind.HIDDEN]
    experts = [g for g in groups if g["kind"] == Kind.EXPERT]
    rest = [g for g in groups if g["kind"] not in (Kind.HIDDEN, Kind.EXPERT)]
    _, first = groups[0]["params"][0]
    muon_args = {
        "lr": cfg.lr,
        "momentum": cfg.momentum,
        "nesterov": cfg.nesterov,
        "adjust_lr_fn": cfg.muon_adjust_lr,
        "ns_dtype": ns_dtype(cfg.muon_ns_dtype, first.device),
    }
    parts: list[torch.optim.Optimizer] = []
    if hidden:
        parts.append(Muon(hidden, blocks=cfg.muon_blocks, **muon_args))
    if experts:
        parts.append(ExpertMuon(experts, **muon_args))
    if rest:
        parts.append(_adamw(rest, cfg))
    return CompositeOptimizer(parts)


def _pytorch_optimizer(cfg: TrainConfig) -> ModuleType:
    """The optional library of lion, adan, soap, mars and signum (the extra ``optimizers``)."""
    return require("pytorch_optimizer", f"optim={cfg.optim}")


def _lion(groups: Groups, cfg: TrainConfig) -> torch.optim.Optimizer:
    return _pytorch_optimizer(cfg).Lion(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decouple=True
    )


def _adan(groups: Groups, cfg: TrainConfig) -> torch.optim.Optimizer:
    # weight_decouple=True: AdamW-style w·(1 - lr·wd) like every other optimizer here (the
    # library default is the paper's proximal w/(1 + lr·wd)); max_grad_norm=0 turns off Adan's
    # own clipping, which uses the global norm of all the parameters it was given.
    return _pytorch_optimizer(cfg).Adan(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2, cfg.beta3),
        eps=cfg.eps,
        weight_decouple=True,
        max_grad_norm=0.0,
    )


_SOAP_MAX_PRECONDITION_DIM = 10000  # a longer side is not preconditioned (the library's default)


def _soap(groups: Groups, cfg: TrainConfig) -> torch.optim.Optimizer:
    for group in groups:
        if group["kind"] == Kind.EMBEDDING:
            # Precondition only the d_model side: a vocab x vocab eigenbasis costs V² memory
            # and an O(V³) eigendecomposition for little gain.
            group["max_precondition_dim"] = min(min(p.shape) for _, p in group["params"])
    return _pytorch_optimizer(cfg).SOAP(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        max_precondition_dim=_SOAP_MAX_PRECONDITION_DIM,
    )


def _mars(groups: Groups, cfg: TrainConfig) -> torch.optim.Optimizer:
    # 1-D tensors take MARS's internal AdamW at lr·(lr_1d/lr): lr_1d=lr keeps that factor 1 so
    # set_lr scales both; they are gains, so no decay.
    betas = (cfg.beta1, cfg.beta2)
    return _pytorch_optimizer(cfg).MARS(
        groups,
        lr=cfg.lr,
        betas=betas,
        lr_1d=cfg.lr,
        betas_1d=betas,
        weight_decay_1d=0.0,
        eps=cfg.eps,
    )


def _signum(groups: Groups, cfg: TrainConfig) -> torch.optim.Optimizer:
    return _pytorch_optimizer(cfg).SignSGD(
        groups, lr=cfg.lr, momentum=cfg.momentum, weight_decouple=True
    )


def _sgd(groups: Groups, cfg: TrainConfig) -> torch.optim.Optimizer:
    nesterov = cfg.nesterov and cfg.momentum > 0  # torch rejects Nesterov without momentum
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=nesterov)


_FACTORIES: dict[str, Callable[[Groups, TrainConfig], OptimizerLike]] = {
    "adamw": _adamw,
    "muon": _muon,
    "lion": _lion,
    "adan": _adan,
    "soap": _soap,
    "mars": _mars,
    "signum": _signum,
    "nadamw": _nadamw,
    "sgd": _sgd,
}
OPTIMIZERS: tuple[str, ...] = tuple(_FACTORIES)
_ADAM = ("beta1", "beta2", "eps")
# the settings each factory reads besides lr and weight_decay (muon's AdamW part included);
# tests/test_optim_registry.py holds this against what building each optimizer really reads
_SETTINGS_READ: dict[str, tuple[str, ...]] = {
    "adamw": _ADAM,
    "muon": (*_ADAM, "momentum", "nesterov", "muon_adjust_lr", "muon_ns_dtype", "muon_blocks"),
    "lion": ("beta1", "beta2"),
    "adan": (*_ADAM, "beta3"),
    "soap": _ADAM,
    "mars": _ADAM,
    "signum": ("momentum",),
    "nadamw": (*_ADAM, "nadam_momentum_decay"),
    "sgd": ("momentum", "nesterov"),
}


# the kinds of parameter whose update needs the whole tensor: a matrix function of it or a norm
# over it. Every other parameter the optimizer updates element by element (its state has the
# parameter's shape, or is a scalar), so a block of its rows can be updated on its own, which
# sharded data parallelism does (zero=1, 2: nobubble.zero_partition). tests/test_sharding.py
# holds this against the optimizers: a block's update equals its rows of the whole update, or,
# for these kinds, does not.
_UPDATES_WHOLE: dict[str, frozenset[Kind]] = {
    # Newton–Schulz on each hidden matrix; an expert tensor's rows are whole expert matrices,
    # each orthogonalized on its own (ExpertMuon); the rest is AdamW
    "muon": frozenset({Kind.HIDDEN}),
    # eigenbases of every dimension of a matrix; 1-D tensors take Adam (precondition_1d off)
    "soap": frozenset(Kind) - {Kind.GAIN},
    # MARS scales each >= 2-D tensor's corrected gradient by its norm; 1-D ones take AdamW
    "mars": frozenset({Kind.HIDDEN, Kind.EMBEDDING, Kind.EXPERT, Kind.ROUTER}),
}


# the optimizers that train a stage split over tensor-parallel ranks (nobubble.model.tensor_split):
# element-wise ones, whose update of a shard is that shard of the whole update, and that run on
# torch's DTensor shards; tests/test_tensor_parallel.py holds AdamW to the one-process engine
TP_OPTIMIZERS = ("adamw",)


def updates_whole(optim: str, name: str, param: torch.Tensor) -> bool:
    """Whether optimizer ``optim`` needs all of parameter ``name`` to update any of it."""
    return classify(name, param) in _UPDATES_WHOLE.get(optim, frozenset())


# The elements of state an optimizer holds for a parameter of a kind and shape (with a momentum
# setting), scalars left out: what sharded data parallelism balances over the replicas
# (nobubble.zero_partition). tests/test_optim_registry.py holds it against the optimizers' states.
StateCost = Callable[[Kind, tuple[int, ...], float], int]


def _per_element(count: int) -> StateCost:
    return lambda kind, shape, momentum: count * math.prod(shape)


def _momentum_buffer(kind: Kind, shape: tuple[int, ...], momentum: float) -> int:
    return math.prod(shape) if momentum else 0  # no buffer without momentum


def _muon_state(kind: Kind, shape: tuple[int, ...], momentum: float) -> int:
    moments = 1 if kind in (Kind.HIDDEN, Kind.EXPERT) else 2  # Muon's momentum; AdamW's two
    return moments * math.prod(shape)


def _soap_state(kind: Kind, shape: tuple[int, ...], momentum: float) -> int:
    """Adam's two moments (in the eigenbasis) and, for each side of a matrix short enough to be
    preconditioned, its statistics and eigenbasis (side² each); 1-D tensors take plain Adam.
    The embeddings' limit is their shorter side (:func:`_soap`)."""
    limit = min(shape) if kind == Kind.EMBEDDING else _SOAP_MAX_PRECONDITION_DIM
    sides = [side for side in shape if side <= limit] if len(shape) >= 2 else []
    return 2 * math.prod(shape) + 2 * sum(side * side for side in sides)


_STATE_COST: dict[str, StateCost] = {
    "adamw": _per_element(2),
    "muon": _muon_state,
    "lion": _per_element(1),
    "adan": _per_element(4),  # exp_avg, exp_avg_sq, exp_avg_diff and the previous gradient
    "soap": _soap_state,
    "mars": _per_element(3),  # exp_avg, exp_avg_sq and the last gradient
    "signum": _momentum_buffer,
    "nadamw": _per_element(2),
    "sgd": _momentum_buffer,
}


def state_elements(optim: str, momentum: float, name: str, param: torch.Tensor) -> int:
    """The elements of state optimizer ``optim`` holds for parameter ``name`` (scalars aside)."""
    return _STATE_COST[optim](classify(name, param), tuple(param.shape), momentum)


def settings_read(optim: str, momentum: float) -> frozenset[str]:
    """The settings optimizer ``optim`` reads (sgd reads nesterov only with momentum > 0)."""
    keys = set(_SETTINGS_READ[optim])
    if optim == "sgd" and momentum == 0:
        keys.discard("nesterov")  # torch rejects Nesterov without momentum: _sgd drops it
    return frozenset(keys)


OPTIMIZER_SETTINGS = frozenset(key for keys in _SETTINGS_READ.values() for key in keys)


def build_optimizer(
    named_params: list[tuple[str, torch.nn.Parameter]], cfg: TrainConfig
) -> OptimizerLike:
    """The optimizer ``cfg.optim`` over these parameters (a stage's delay correction wraps it:
    :func:`nobubble.stage_update.build_stage_optimizer`).

    Any subset (one pipeline stage's parameters) gives the same per-parameter updates as the
    whole model: the parameter groups and every optimizer's math are per parameter.
    """
    if cfg.optim not in _FACTORIES:
        raise ValueError(f"unknown optimizer {cfg.optim!r}; choose one of: {', '.join(OPTIMIZERS)}")
    groups = param_groups(named_params, cfg)
    if not groups:
        raise ValueError("build_optimizer got no trainable parameters")
    return _FACTORIES[cfg.optim](groups, cfg)
