"""``activation_checkpointing`` (bitwise exact) and ``compile`` (within a stated tolerance)."""

import dataclasses
import json
import math

import pytest
import torch

from nobubble.cli import main
from nobubble.config import ConfigError, TrainConfig
from nobubble.configure import build_config, resolve_config
from nobubble.data.tokenizer import load_tokenizer
from nobubble.model.layers import build_model
from nobubble.model.presets import PRESETS
from nobubble.model.resolve import model_config
from nobubble.one_process import OneProcessEngine
from nobubble.stage_options import check_compilable
from tests.helpers.pipeline import SMALL, assert_same_run, final_weights, metrics, nobubble

STEPS = 3
MC = dataclasses.replace(
    PRESETS["tiny"], d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=64
)
DELAYED = dict(schedule="2bw", correction="ef", stages=2, microbatches=2)


def simulate(**settings):
    """Losses and newest weights of STEPS simulated steps, and how often a block began a forward
    (a recomputation stops once it has what the backward needs)."""
    cfg = TrainConfig(batch_size=4, seq_len=32, lr=1e-2, warmup_steps=1, steps=STEPS, **settings)
    cfg = resolve_config(cfg)
    engine = OneProcessEngine(cfg, MC, torch.device("cpu"))
    calls = []
    engine.model.blocks["0"].register_forward_pre_hook(lambda *_: calls.append(1))
    gen = torch.Generator().manual_seed(0)
    batches = iter([torch.randint(0, 64, (4, 33), generator=gen) for _ in range(STEPS)])
    losses = []
    engine.run_steps(STEPS, lambda: next(batches), lambda stats: losses.append(stats.loss))
    return losses, engine.named_weights(), len(calls)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activation_checkpointing_changes_no_bit(dtype):
    """2bw + EF: every backward recomputes its blocks with the stashed (older) weight version,
    not the newest one the module holds by then; autocast is recomputed alike."""
    losses, weights, forwards = simulate(dtype=dtype, **DELAYED)
    losses_ac, weights_ac, forwards_ac = simulate(
        dtype=dtype, activation_checkpointing=True, **DELAYED
    )
    assert losses_ac == losses
    for name in weights:
        assert torch.equal(weights_ac[name], weights[name]), name
    assert forwards == STEPS * 2  # one forward per microbatch ...
    assert forwards_ac == 2 * forwards  # ... and with checkpointing its recomputation


# The pipeline with activation checkpointing: tests/test_profiling.py, whose profiled 2-stage run
# checkpoints its activations and must equal the plain simulation bit for bit.


def test_compile_without_a_cpp_compiler_is_refused_up_front(monkeypatch):
    def missing() -> str:
        raise RuntimeError("no g++ found")

    monkeypatch.setattr("torch._inductor.cpp_builder.get_cpp_compiler", missing)
    with pytest.raises(ConfigError, match="compile=true on the CPU needs a C\\+\\+ compiler"):
        check_compilable(torch.device("cpu"))


# Measured on this test's runs (torch 2.13, CPU inductor, 2bw + EF, AdamW, 3 steps): gradient
# norms agree to 7e-8 (relative), losses exactly, the weights' change from their initial values
# to 5e-7 of its size; on a wider model (d_model 64) 1e-6 and 4e-5 (AdamW's normalization
# magnifies the gradients' last bits). The bounds leave a margin for other CPUs' kernels.
LOSS_RTOL = 1e-5
CHANGE_RTOL = 1e-3


def initial_weights(run) -> dict[str, torch.Tensor]:
    """The weights ``run`` started from (they depend on its config and tokenizer alone)."""
    cfg = build_config(json.loads((run / "config.json").read_text()))
    model = build_model(model_config(cfg, load_tokenizer(run).vocab_size), cfg.seed)
    return {n: p.detach() for n, p in model.named_parameters()}


def change_difference(weights: dict, reference: dict, initial: dict) -> float:
    """|weights - reference| / |reference - initial| over every parameter (norms)."""
    apart = math.sqrt(sum(((weights[n] - reference[n]) ** 2).sum().item() for n in reference))
    moved = math.sqrt(sum(((reference[n] - initial[n]) ** 2).sum().item() for n in reference))
    return apart / moved


@pytest.mark.slow
def test_compile_in_both_backends_matches_eager_within_tolerance(tmp_path):
    """One compilation per grad mode (training, evaluation), none per weight version; the
    pipeline (one stage under torchrun: the same graphs, from inductor's cache) computes exactly
    what the compiled simulation computes."""
    from torch._dynamo.utils import counters

    settings = [*SMALL, "schedule=2bw", "correction=ef", "microbatches=2", f"steps={STEPS}"]
    settings += ["n_layers=2", "eval_every=0"]
    main(["train", "--no-progress", "--out", str(tmp_path / "eager"), *settings])
    torch._dynamo.reset()
    counters.clear()
    main(["train", "--no-progress", "--out", str(tmp_path / "compiled"), *settings, "compile=true"])
    assert counters["stats"]["unique_graphs"] == 2
    nobubble(tmp_path / "pipeline", *settings[len(SMALL) :], "compile=true", stages=1)

    eager, reference = metrics(tmp_path / "eager"), final_weights(tmp_path / "eager")
    initial = initial_weights(tmp_path / "eager")
    for run in ("compiled", "pipeline"):
        for got, want in zip(metrics(tmp_path / run), eager, strict=True):
            for key in ("train_loss", "grad_norm", "val_loss"):
                if key in want:
                    assert got[key] == pytest.approx(want[key], rel=LOSS_RTOL), (run, key)
        difference = change_difference(final_weights(tmp_path / run), reference, initial)
        assert difference < CHANGE_RTOL, (run, difference)
    # the same graphs compiled alike: the two backends agree bit for bit
    assert_same_run(tmp_path / "pipeline", tmp_path / "compiled")
