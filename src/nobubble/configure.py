"""The configuration checked against everything it names: the one place that turns settings into
a configuration a run can use.

The schema (:mod:`nobubble.config`) checks what it can alone; here, above the registries, each
name is checked against its registry (presets, optimizers, schedules, corrections), ``chunks``
is resolved to the schedule's default and ``correction=auto`` to the correction it chooses
(:mod:`nobubble.corrections.auto`: config.json holds the real settings), and the schedule, the
corrections and the model's split are checked for the shape asked for.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from nobubble.config import FIELDS, ConfigError, TrainConfig, check_choice, merge_layers
from nobubble.corrections import auto
from nobubble.corrections.registry import CORRECTION_NAMES
from nobubble.corrections.registry import check as check_corrections
from nobubble.device import device_type
from nobubble.layout import ParallelLayout
from nobubble.model.layers import Block
from nobubble.model.partition import stage_specs
from nobubble.model.presets import PRESETS, ModelConfig
from nobubble.model.resolve import model_config
from nobubble.model.tensor_split import split_dim, split_problem, tp_problem
from nobubble.optim.param_groups import Kind, classify
from nobubble.optim.registry import OPTIMIZERS, TP_OPTIMIZERS
from nobubble.schedules.registry import (
    CANDIDATES,
    SCHEDULE_NAMES,
    candidate_refusal,
    schedule_spec,
)
from nobubble.stage_options import auto_dtype

# the names each registry offers, for the settings that name an entry of one
REGISTRY_NAMES: dict[str, tuple[str, ...]] = {
    "preset": tuple(PRESETS),
    "optim": OPTIMIZERS,
    "schedule": SCHEDULE_NAMES,
    "correction": (*CORRECTION_NAMES, auto.AUTO),
}


def build_config(*layers: dict[str, Any]) -> TrainConfig:
    """Merge ``key: value`` layers over the defaults (later layers win) into a checked
    configuration, ``chunks`` resolved."""
    return resolve_config(merge_layers(*layers))


def asks_for_auto(layers: Sequence[dict[str, Any]]) -> bool:
    """Whether the last of ``layers`` to set ``correction`` asks for ``auto`` (the choice is then
    worth printing: :func:`nobubble.corrections.auto.choose`)."""
    given = [layer["correction"] for layer in layers if "correction" in layer]
    return bool(given) and str(given[-1]).strip() == auto.AUTO


def resolve_config(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` checked against the registries, with ``chunks`` resolved to the schedule's
    default where it is not given, ``correction=auto`` to its choice and ``dtype=auto`` to what
    it trains in on this machine (so config.json says it, and a resume elsewhere keeps it)."""
    if cfg.schedule in CANDIDATES:  # studied, not run: say so rather than "unknown"
        raise ConfigError(candidate_refusal(cfg.schedule))
    for key, field in FIELDS.items():
        registry = field.metadata["registry"]
        if registry is not None and registry != "correction":  # a combination: checked below
            check_choice(key, getattr(cfg, key), REGISTRY_NAMES[registry])
    spec = schedule_spec(cfg.schedule)
    if cfg.chunks is None:
        cfg = dataclasses.replace(cfg, chunks=spec.default_chunks)
    problem = spec.chunk_problem(cfg.chunks)
    if problem:
        raise ConfigError(f"chunks={cfg.chunks}: {problem}")
    if cfg.dtype == "auto":
        cfg = dataclasses.replace(cfg, dtype=auto_dtype(device_type(cfg.device)))
    cfg = auto.resolve(cfg)
    check_corrections(cfg)
    _check_schedule(cfg)
    _check_model(cfg)
    _check_tp(cfg)
    return cfg


def _check_schedule(cfg: TrainConfig) -> None:
    spec = schedule_spec(cfg.schedule)
    problem = spec.microbatch_problem(cfg.stages, cfg.microbatches)
    if problem:
        raise ConfigError(problem)
    if spec.split_backward and (cfg.activation_checkpointing or cfg.compile):
        raise ConfigError(
            f"{spec.name} splits each backward in two with hooks on the stage's linear "
            "layers, which activation checkpointing's recomputation and torch.compile's "
            "graphs do not run as the forward did; set activation_checkpointing=false and "
            "compile=false, or use 1f1b"
        )
    if spec.step_per_microbatch and cfg.microbatches != 1:
        raise ConfigError(
            f"{spec.name} steps the optimizer after every microbatch, so each step is one "
            f"microbatch; set microbatches=1 (got {cfg.microbatches}) and choose batch_size "
            "as the microbatch size"
        )
    stages = ParallelLayout.of(cfg).model_stages
    if cfg.stage_layers is not None and len(cfg.stage_layers) != stages:
        parts = (
            f"stages={cfg.stages}"
            if cfg.chunks == 1
            else f"stages x chunks = {cfg.stages} x {cfg.chunks} = {stages}"
        )
        raise ConfigError(
            f"stage_layers lists {len(cfg.stage_layers)} stages but {parts}; give one block "
            "count per model stage"
        )


def _check_model(cfg: TrainConfig) -> None:
    """The model's shape and its split over the model stages, as training will resolve them (but
    for the vocabulary, which is only known once the tokenizer is read); a tied weight needs one
    delay at both of its uses."""
    mc = model_config(cfg, tokenizer_vocab=1)
    _check_muon_blocks(cfg, mc)
    try:
        stages = len(stage_specs(cfg, mc))
    except ConfigError as exc:
        if cfg.chunks == 1:
            raise
        model_stages = ParallelLayout.of(cfg).model_stages
        raise ConfigError(
            f"{cfg.schedule} cuts the model into stages x chunks = {cfg.stages} x "
            f"{cfg.chunks} = {model_stages} stages, and {exc}, or fewer chunks"
        ) from None
    if mc.tie_embeddings and stages > 1:
        spec, last = schedule_spec(cfg.schedule), stages - 1
        if not spec.can_tie(stages):
            raise ConfigError(
                f"the head is tied to the embedding (tie_embeddings), and {spec.name} trains the "
                f"embedding (stage 0) with gradient delay {spec.delay(0, stages)} and the "
                f"head (stage {last}) with delay {spec.delay(last, stages)}, so the two uses "
                "of the one tied weight would need different versions of it; set "
                "tie_embeddings=false, or use 2bw (delay 1 on every stage) or a synchronous "
                "schedule"
            )


def _check_muon_blocks(cfg: TrainConfig, mc: ModelConfig) -> None:
    """``muon_blocks`` > 1 needs Muon, and every hidden matrix's split dimension divisible by it
    (the matrices of one dense and one MoE block, built on the meta device, name them)."""
    if cfg.muon_blocks == 1:
        return
    if cfg.optim != "muon":
        raise ConfigError(
            f"muon_blocks={cfg.muon_blocks} splits Muon's orthogonalization into blocks, and "
            f"optim={cfg.optim} has none; set muon_blocks=1, or optim=muon"
        )
    first = {mc.is_moe(i): i for i in reversed(range(mc.n_layers))}  # one block of each kind
    with torch.device("meta"):
        matrices = [
            (name, tuple(param.shape))
            for moe, index in first.items()
            for local, param in Block(mc, moe).named_parameters()
            if classify(name := f"blocks.{index}.{local}", param) is Kind.HIDDEN
        ]
    divisor = math.gcd(*(shape[split_dim(name)] for name, shape in matrices))
    for name, shape in matrices:
        problem = split_problem(name, shape, cfg.muon_blocks)
        if problem:
            counts = [n for n in range(1, min(divisor, 64) + 1) if divisor % n == 0]
            raise ConfigError(
                f"muon_blocks={cfg.muon_blocks}: {problem}; choose muon_blocks among "
                f"{', '.join(map(str, counts))} (the divisors of every hidden matrix's split "
                "dimension), or change the model's width"
            )


# the schedules a stage split over tp ranks runs (tests/test_tensor_parallel.py holds each to the
# one-process engine); the others (zero-bubble's split backward, interleaving, V) are refused
TP_SCHEDULES = ("1f1b", "2bw")


def _check_tp(cfg: TrainConfig) -> None:
    """Tensor parallelism (``tp`` > 1): the model splits evenly, and the run asks for nothing the
    split stages do not do yet, each refusal naming what is missing and the fix."""
    if cfg.tp == 1:
        return
    mc = model_config(cfg, tokenizer_vocab=1)
    problem = tp_problem(mc, cfg.tp)
    if problem:
        raise ConfigError(problem)
    missing = {
        "dp > 1 (the replicas' all-reduce of split gradients; zero)": cfg.dp > 1,
        f"schedule={cfg.schedule} (only {', '.join(TP_SCHEDULES)})": cfg.schedule
        not in TP_SCHEDULES,
        f"optim={cfg.optim} (only {', '.join(TP_OPTIMIZERS)}: whole-matrix optimizers such as "
        "muon need the gathered or blockwise update)": cfg.optim not in TP_OPTIMIZERS,
        f"correction={cfg.correction} (only none or ef)": cfg.correction not in ("none", "ef"),
        "tie_embeddings over several stages (the tied copies' group per tp index)": (
            mc.tie_embeddings and cfg.stages > 1
        ),
        "activation_checkpointing": cfg.activation_checkpointing,
        "compile": cfg.compile,
        "emulate_nccl": cfg.emulate_nccl,
    }
    asked = [what for what, on in missing.items() if on]
    if asked:
        raise ConfigError(
            f"tp={cfg.tp} is not supported yet with: {'; '.join(asked)} "
            "(docs/pipeline.md, 'Tensor parallelism inside a stage'); set tp=1, or change those "
            f"settings (dp=1, schedule {' or '.join(TP_SCHEDULES)}, optim adamw, correction none "
            "or ef, tie_embeddings=false)"
        )
