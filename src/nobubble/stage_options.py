"""The options of a stage module: activation checkpointing, torch.compile, the MoE loss share,
and the dtype its matmuls run in (:func:`autocast`).

Both backends build their modules (the one-process engine's whole model, a pipeline rank's
stage) and
hand them here, so the two apply the options alike (docs/training.md, "Compile and activation
checkpointing").
"""

from __future__ import annotations

import contextlib

import torch

from nobubble.config import ConfigError, TrainConfig
from nobubble.model.layers import Stage


def apply_stage_options(module: Stage, cfg: TrainConfig, device: torch.device) -> None:
    """Set ``module`` up as ``cfg`` asks: recompute block activations, compile its forward, and
    give the auxiliary losses of its MoE layers a microbatch's share of the step's loss; its
    rotary tables are made for the run's ``seq_len`` first.

    Compiling compiles the module's call in place (``nn.Module.compile``): parameter names stay
    those of the model, and ``functional_call`` with any weight version runs the compiled code
    (the weights are inputs of the compiled graph, not constants, so a new version needs no
    recompilation).
    """
    module.activation_checkpointing = cfg.activation_checkpointing
    module.rope(cfg.seq_len)  # the run's rotary tables, before a compiled forward could grow them
    for layer in module.moe_layers():  # its auxiliary loss is scaled as the step's loss is
        layer.loss_scale = 1 / cfg.microbatches
    if cfg.compile:
        check_compilable(device)
        module.compile()


def check_compilable(device: torch.device) -> None:
    """Refuse ``compile=true`` where torch.compile cannot work, before anything runs."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise ConfigError(
            "compile=true: torch.compile does not support this Python or platform; set "
            "compile=false"
        )
    if device.type != "cpu":
        return
    try:  # inductor compiles CPU kernels with a C++ compiler: find it now, not mid-step
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # another torch layout: inductor says so itself if it fails
        return
    try:
        get_cpp_compiler()
    except Exception as exc:
        raise ConfigError(
            "compile=true on the CPU needs a C++ compiler for torch.compile's generated kernels "
            f"and none was found ({exc}); install g++ (or point CXX at one), or set "
            "compile=false"
        ) from None


def compute_dtype(dtype: str, device: torch.device) -> str:
    """What the ``dtype`` setting means on ``device``: ``auto`` is bfloat16 on CUDA and float32
    elsewhere (a CPU run stays as it was before ``auto`` was the default)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.type == "cuda" else "float32"


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """The context a stage's forward runs in: bfloat16 autocast for its matmuls, or nothing."""
    if compute_dtype(dtype, device) == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def precision(cfg: TrainConfig, device: torch.device) -> str:
    """The precision a run computes in on ``device``, in words (a CUDA run's closing line)."""
    words = "bfloat16 autocast" if compute_dtype(cfg.dtype, device) == "bfloat16" else "float32"
    if device.type == "cuda":
        words += ", TF32 float32 matmuls" if cfg.tf32 else ", float32 matmuls without TF32"
    return words
