"""The options of a stage module: activation checkpointing, torch.compile (and, in a pipeline,
compiling before the first action: :func:`compile_ahead`), the MoE loss share, and the dtype its
matmuls run in (:func:`autocast`; ``dtype=auto``: :func:`compute_dtype`).

Both backends build their modules (the one-process engine's whole model, a pipeline rank's
stage) and
hand them here, so the two apply the options alike (docs/training.md, "Compile and activation
checkpointing").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch.func import functional_call

from nobubble.config import ConfigError, TrainConfig
from nobubble.model.layers import Stage, lm_loss


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


def compile_ahead(
    modules: Iterable[Stage],
    cfg: TrainConfig,
    device: torch.device,
    hidden_shape: tuple[int, int, int],
    received: torch.dtype,
    barrier: Callable[[], None],
) -> None:
    """With ``compile=true``, compile a pipeline process's stage modules before its first
    action: a :func:`dry_run` of each, then ``barrier`` (every rank, under ``group_timeout_s``).
    Compiling takes minutes on a large stage, and a peer waiting for a stage's first message
    would otherwise count it against ``p2p_timeout_s``. ``hidden_shape``: a microbatch's
    activation; ``received``: the dtype activations and gradients arrive in."""
    if not cfg.compile:
        return
    for module in modules:
        dry_run(module, cfg, device, hidden_shape, received)
    barrier()


def dry_run(
    module: Stage,
    cfg: TrainConfig,
    device: torch.device,
    hidden_shape: tuple[int, int, int],
    received: torch.dtype,
) -> None:
    """One training forward and backward and one evaluation forward of ``module`` on a microbatch
    of zeros, each called as the pipeline calls it, so that the graphs torch.compile makes and
    their guards are those of the run: training through ``functional_call`` with plain leaf
    tensors, as a weight version is (:mod:`nobubble.versions`; here views of the parameters,
    whose gradients land on the views), the token rows a slice of a longer row, a later stage's
    input a leaf that requires grad; the evaluation with the module's own parameters, without
    autograd. It leaves nothing behind: the buffers (MoE routing sums) are put back and the RNG
    streams forked; no gradient, optimizer, data or weight is touched."""
    rows, length, _ = hidden_shape
    tokens = torch.zeros(rows, length + 1, dtype=torch.long, device=device)
    x = tokens[:, :-1] if module.spec.has_embed else None
    weights = {n: p.detach().requires_grad_(p.requires_grad) for n, p in module.named_parameters()}
    buffers = {name: b.clone() for name, b in module.named_buffers()}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if x is None:
            x = torch.zeros(hidden_shape, dtype=received, device=device, requires_grad=True)
        with autocast(device, cfg.dtype):
            out = functional_call(module, weights, (x,))
        if module.spec.has_head:
            (lm_loss(out, tokens[:, 1:]) / cfg.microbatches).backward()
        else:
            out.backward(torch.zeros(hidden_shape, dtype=received, device=device))
        with torch.no_grad(), autocast(device, cfg.dtype):
            module(x.detach())
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            buffer.copy_(buffers[name])


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


def auto_dtype(device_type: str) -> str:
    """What ``dtype=auto`` trains in on a device of type ``device_type``: bfloat16 on CUDA,
    float32 elsewhere (a CPU run stays as it was before auto was the default)."""
    return "bfloat16" if device_type == "cuda" else "float32"


def compute_dtype(dtype: str, device: torch.device) -> str:
    """What the ``dtype`` setting means on ``device`` (``auto``: :func:`auto_dtype`; a
    configuration built by :func:`nobubble.configure.build_config` holds it resolved)."""
    return auto_dtype(device.type) if dtype == "auto" else dtype


def wire_dtype(p2p_dtype: str, dtype: str, device: torch.device) -> torch.dtype | None:
    """The dtype a pipeline's activations and gradients travel in (``p2p_dtype``): bfloat16
    under bfloat16 autocast with ``auto``; None (as the stages hold them, float32) otherwise."""
    if p2p_dtype == "auto" and compute_dtype(dtype, device) == "bfloat16":
        return torch.bfloat16
    return None


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
