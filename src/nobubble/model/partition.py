"""The partition: which model stage owns which part of the model (and so which parameter).

The model is ``[embedding, block 0..L-1, norm+head]``; a model stage owns a contiguous slice of
it. This module is the one place that answers "which stage owns this": the split itself
(:func:`partition`, :func:`stage_specs`) and each parameter's owner (:func:`stage_parameter_names`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nobubble.config import ConfigError, TrainConfig
from nobubble.layout import ParallelLayout
from nobubble.model.flops import block_flops, head_flops
from nobubble.model.presets import ModelConfig

TIED_WEIGHT = "embed.weight"  # the tied embedding/head weight, under this name in every layout
TIED_HEAD_USE = "head.weight"  # where the full model's head reads it (a key of functional_call)


@dataclass(frozen=True)
class StageSpec:
    """What one pipeline stage owns: the embedding?, a range of blocks, the norm+head?"""

    index: int
    blocks: range
    has_embed: bool
    has_head: bool


def holds_tied_copy(mc: ModelConfig, spec: StageSpec) -> bool:
    """Whether this stage holds one of the two copies of a tied weight split over stages: the
    first or the last stage of a pipeline of several stages (one stage holds it once)."""
    return mc.tie_embeddings and spec.has_embed != spec.has_head


def partition(
    n_layers: int,
    stages: int,
    embed_cost: float = 1.0,
    head_cost: float = 1.0,
    stage_layers: list[int] | None = None,
    even: bool = False,
) -> list[StageSpec]:
    """Split the blocks into ``stages`` contiguous runs.

    With ``stage_layers`` the runs have exactly those lengths. Otherwise the split minimizes the
    most expensive stage, where a block costs 1, the embedding ``embed_cost`` (stage 0) and the
    norm+head ``head_cost`` (last stage). Only the first and last stage may hold no block.
    Among the splits with that slowest stage, ``even`` takes the most even one (the least sum of
    squared stage costs), lighter at the front where several are: the first stages hold the
    most microbatches in flight (and, under 2bw, the stash), so a full front stage is the
    costliest place for memory. Without ``even``, the earlier rule: the stages filled from the
    front (the split of ``partition=blocks``, which run folders and studies recorded without
    ``stage_layers`` ran).
    """
    if stages < 1:
        raise ConfigError(f"stages must be >= 1, got {stages}")
    if stage_layers is not None:
        if len(stage_layers) != stages or sum(stage_layers) != n_layers:
            raise ConfigError(
                f"stage_layers {stage_layers} must list {stages} block counts summing to the "
                f"model's {n_layers} blocks"
            )
        if any(n < 0 for n in stage_layers):
            raise ConfigError(f"stage_layers {stage_layers} has a negative block count")
        counts = list(stage_layers)
    else:
        counts = _balanced_counts(n_layers, stages, embed_cost, head_cost)
        if even:
            counts = _even_counts(n_layers, stages, _cost(stages, embed_cost, head_cost), counts)
    for i, n in enumerate(counts):
        if n == 0 and 0 < i < stages - 1:
            raise ConfigError(
                f"stage {i} of {stages} would hold no block; use fewer stages (the model has "
                f"{n_layers} blocks) or give stage_layers explicitly"
            )
    specs, start = [], 0
    for i, n in enumerate(counts):
        specs.append(StageSpec(i, range(start, start + n), i == 0, i == stages - 1))
        start += n
    return specs


def _balanced_counts(n_layers: int, stages: int, embed: float, head: float) -> list[int]:
    if stages > n_layers + 2 or (stages > 2 and n_layers < stages - 2):
        raise ConfigError(
            f"cannot split {n_layers} blocks over {stages} stages: every stage but the first and "
            f"the last needs a block, so at most {n_layers + 2} stages; use fewer stages or more "
            "blocks (n_layers)"
        )

    cost = _cost(stages, embed, head)
    # best[s][k]: minimal max cost placing the first k blocks on stages 0..s
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(stages)]
    choice = [[0] * (n_layers + 1) for _ in range(stages)]
    for k in range(n_layers + 1):
        best[0][k] = cost(0, k)
    for s in range(1, stages):
        middle = s < stages - 1
        for k in range(n_layers + 1):
            for n in range(1 if middle else 0, k + 1):
                value = max(best[s - 1][k - n], cost(s, n))
                if value < best[s][k] - 1e-12:
                    best[s][k], choice[s][k] = value, n
    counts, k = [], n_layers
    for s in range(stages - 1, 0, -1):
        counts.append(choice[s][k])
        k -= choice[s][k]
    counts.append(k)
    return counts[::-1]


def _cost(stages: int, embed: float, head: float) -> Callable[[int, int], float]:
    """The cost of ``n`` blocks on stage ``stage``: theirs, the embedding's, the head's."""

    def cost(stage: int, n: int) -> float:
        return n + (embed if stage == 0 else 0.0) + (head if stage == stages - 1 else 0.0)

    return cost


def _even_counts(
    n_layers: int, stages: int, cost: Callable[[int, int], float], minmax: list[int]
) -> list[int]:
    """Among the splits whose slowest stage costs no more than ``minmax``'s (a min-max split),
    the one with the least sum of squared stage costs; of those, the lightest front (the
    fewest blocks on stage 0, then on stage 1, ...)."""
    limit = max(cost(s, n) for s, n in enumerate(minmax))
    tol = 1e-9 * max(1.0, limit)

    def sizes(stage: int, placed: int) -> range:
        low = 1 if 0 < stage < stages - 1 else 0
        high = low
        while placed + high <= n_layers and cost(stage, high) <= limit + tol:
            high += 1
        return range(low, high)

    # least[s][k]: the least sum of squared costs of blocks k.. on stages s..
    inf = float("inf")
    least = [[inf] * (n_layers + 1) for _ in range(stages + 1)]
    least[stages][n_layers] = 0.0
    for s in range(stages - 1, -1, -1):
        for k in range(n_layers + 1):
            for n in sizes(s, k):
                least[s][k] = min(least[s][k], cost(s, n) ** 2 + least[s + 1][k + n])
    counts, placed = [], 0
    for s in range(stages):  # the fewest blocks that still reach the least sum
        target = least[s][placed] + tol * max(1.0, least[s][placed])
        n = next(
            n for n in sizes(s, placed) if cost(s, n) ** 2 + least[s + 1][placed + n] <= target
        )
        counts.append(n)
        placed += n
    return counts


def flop_costs(mc: ModelConfig, seq_len: int) -> tuple[float, float]:
    """The embedding's and the head's training FLOPs per token, in blocks (the mean block's):
    the lookup counts none, the head 6 d V."""
    block = sum(block_flops(mc, i, seq_len) for i in range(mc.n_layers)) / max(mc.n_layers, 1)
    return 0.0, head_flops(mc) / block


def resolve_partition(cfg: TrainConfig, mc: ModelConfig) -> TrainConfig:
    """``cfg`` with ``partition=flops`` resolved into explicit ``stage_layers`` for the model
    ``mc`` (its vocabulary known): the blocks split so the most expensive model stage has the
    fewest FLOPs, the embedding and the head weighed by theirs. Saved in config.json, so a
    resumed run, the report and every process read the split, not the rule."""
    if not split_by_flops(cfg):
        return cfg
    return dataclasses.replace(cfg, stage_layers=[len(s.blocks) for s in stage_specs(cfg, mc)])


def split_by_flops(cfg: TrainConfig) -> bool:
    """Whether ``cfg``'s split is the rule of ``partition=flops``, not yet resolved into
    ``stage_layers`` (which a run saves once it knows its vocabulary)."""
    return cfg.partition == "flops" and cfg.stage_layers is None


def stage_specs(cfg: TrainConfig, mc: ModelConfig) -> list[StageSpec]:
    """The model stages of ``cfg`` (``stages`` x chunks of them) for the model ``mc``: the one
    call every backend, check and tool makes to learn the split."""
    stages = ParallelLayout.of(cfg).model_stages
    if split_by_flops(cfg):
        return partition(mc.n_layers, stages, *flop_costs(mc, cfg.seq_len), even=True)
    return partition(mc.n_layers, stages, cfg.embed_cost, cfg.head_cost, cfg.stage_layers)


def stage_parameter_names(names: Sequence[str], specs: Sequence[StageSpec]) -> list[list[str]]:
    """Assign every parameter name of the full model to the stage that owns it."""
    owner: dict[str, int] = {}
    for spec in specs:
        if spec.has_embed:
            owner["embed"] = spec.index
        if spec.has_head:
            owner["norm"] = owner["head"] = spec.index
        for block in spec.blocks:
            owner[f"blocks.{block}"] = spec.index
    grouped: list[list[str]] = [[] for _ in specs]
    for name in names:
        prefix = name.split(".")[0]
        key = f"blocks.{name.split('.')[1]}" if prefix == "blocks" else prefix
        grouped[owner[key]].append(name)
    return grouped
