"""Where a run trains and how torch is set up for it."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch

from nobubble.config import ConfigError, TrainConfig

# The CUDA caching allocator's settings, read once when CUDA initializes: expandable segments
# grow a segment in place instead of leaving freed blocks of odd sizes (less fragmentation as
# activations of several microbatches come and go). torch >= 2.9 reads either name.
ALLOC_CONF_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
ALLOC_CONF = "expandable_segments:True"


def device_type(name: str) -> str:
    """The kind of device the ``device`` setting ``name`` trains on here (``auto``: CUDA where
    there is one), without checking that a named one exists."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name).type


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device(device_type(name))
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda was requested but no CUDA device is available; use cpu")
    return torch.device(name)


def configure_torch(cfg: TrainConfig) -> None:
    """Threads and seed; on CUDA also its defaults (:func:`configure_cuda`). Call it before
    anything touches CUDA."""
    if resolve_device(cfg.device).type == "cuda":
        configure_cuda(cfg, os.environ)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)


def configure_cuda(cfg: TrainConfig, environ: MutableMapping[str, str]) -> None:
    """What a user expects of a GPU run: expandable segments (unless ``environ`` already sets
    the allocator) and, with ``tf32``, float32 matmuls in TensorFloat-32. Never on the CPU:
    ``set_float32_matmul_precision`` also reaches oneDNN's CPU matmuls."""
    if not any(name in environ for name in ALLOC_CONF_NAMES):
        environ[ALLOC_CONF_NAMES[0]] = ALLOC_CONF
    if cfg.tf32:
        torch.set_float32_matmul_precision("high")
