"""The zero-bubble split backward on one stage: I then W give one fused backward's gradients bit
for bit (float32 and bfloat16 autocast), I leaves the linear weight gradients to W."""

import dataclasses

import pytest
import torch
from torch.func import functional_call

from nobubble.config import ConfigError, TrainConfig
from nobubble.configure import resolve_config
from nobubble.model.layers import Stage
from nobubble.model.partition import partition
from nobubble.model.presets import PRESETS
from nobubble.pipeline.split_backward import SplitBackward
from nobubble.stage_options import autocast

MC = dataclasses.replace(
    PRESETS["tiny"], d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64
)


def stage(index: int) -> Stage:
    return Stage(MC, partition(MC.n_layers, 2)[index], seed=3)


def leaves(module: Stage) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().requires_grad_(True) for n, p in module.named_parameters()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("index", [0, 1])
def test_i_then_w_equals_one_backward(index, dtype):
    module = stage(index)
    torch.manual_seed(0)
    if index == 0:
        inputs = [torch.randint(0, 64, (2, 8)) for _ in range(2)]
    else:
        inputs = [torch.randn(2, 8, 32) for _ in range(2)]
    grads_out = [None if index == 1 else torch.randn(2, 8, 32) for _ in range(2)]

    def run(split: SplitBackward | None):
        weights = leaves(module)
        input_grads = []
        for mb, (x, g) in enumerate(zip(inputs, grads_out, strict=True)):
            x = x if index == 0 else x.clone().requires_grad_(True)
            recording = split.forward(mb) if split else torch.enable_grad()
            with recording, autocast(torch.device("cpu"), dtype):
                out = functional_call(module, weights, (x,))
            target = out.float().square().mean() if index == 1 else out
            if split is None:
                target.backward(g)
                input_grads.append(None if index == 0 else x.grad)
                continue
            input_grads.append(
                split.input_gradient(mb, target, g, None if index == 0 else x, weights)
            )
        if split is not None:  # every I ran, no W yet: the linear layers wait for W
            linear = {n for n in weights if n.endswith(("wq.weight", "w_up.weight", "head.weight"))}
            assert linear and all(weights[n].grad is None for n in linear)
            assert all(weights[n].grad is not None for n in weights if n.endswith("norm.weight"))
            for mb in range(2):
                split.weight_gradient(mb)
        return {n: w.grad for n, w in weights.items()}, input_grads

    fused, fused_inputs = run(None)
    split, split_inputs = run(SplitBackward(module))
    assert fused.keys() == split.keys()
    for name in fused:
        assert torch.equal(fused[name], split[name]), name
    for a, b in zip(fused_inputs, split_inputs, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_split_backward_refuses_recomputation_and_compile():
    common = {"schedule": "zb-h1", "stages": 2, "microbatches": 2, "batch_size": 2}
    for option in ("activation_checkpointing", "compile"):
        with pytest.raises(ConfigError, match="set activation_checkpointing=false and compile"):
            resolve_config(TrainConfig(**common, **{option: True}))
