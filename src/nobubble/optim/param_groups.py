"""One routing policy for every optimizer, decided per parameter from its name and shape.

Because the decision never looks at other parameters, an optimizer built over one pipeline
stage's parameters groups them exactly as the whole-model optimizer would.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Any

import torch

from nobubble.config import TrainConfig


class Kind(StrEnum):
    HIDDEN = "hidden"  # 2-D weight inside a transformer block (Muon's domain)
    EMBEDDING = "embedding"  # other >= 2-D weights: the token embedding and the output head
    GAIN = "gain"  # 1-D tensors (norm gains, biases): never weight-decayed
    EXPERT = "expert"  # an MoE block's experts, one 3-D (experts, rows, columns) tensor each
    ROUTER = "router"  # an MoE block's router: AdamW under Muon (docs/moe.md)


def classify(name: str, param: torch.Tensor) -> Kind:
    if param.ndim < 2:
        return Kind.GAIN
    if name.startswith("blocks."):
        if name.endswith("mlp.router.weight"):
            return Kind.ROUTER
        if param.ndim == 2:
            return Kind.HIDDEN
        if param.ndim == 3:
            return Kind.EXPERT
    return Kind.EMBEDDING


def param_groups(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: TrainConfig
) -> list[dict[str, Any]]:
    """One torch param group per kind present, in ``Kind`` order; parameters keep their order.

    Frozen parameters are skipped and a tensor listed twice (a tied head) is kept once. Each
    group carries its names (``param_names`` in the state dict), ``kind`` and ``weight_decay``.
    """
    by_kind: dict[Kind, list[tuple[str, torch.nn.Parameter]]] = {kind: [] for kind in Kind}
    seen: set[torch.Tensor] = set()
    for name, param in named_params:
        if param.requires_grad and param not in seen:
            seen.add(param)
            by_kind[classify(name, param)].append((name, param))
    return [
        {
            "params": named,
            "kind": kind.value,
            "weight_decay": 0.0 if kind is Kind.GAIN else cfg.weight_decay,
        }
        for kind, named in by_kind.items()
        if named
    ]
