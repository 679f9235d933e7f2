"""``compile=true`` compiles every stage before the pipeline's first action
(:func:`nobubble.stage_options.compile_ahead`): the dry run that does it leaves the stage as it
found it, and after it the run compiles nothing more."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from nobubble.configure import build_config
from nobubble.layout import ParallelLayout
from nobubble.model.layers import Stage
from nobubble.model.partition import StageSpec
from nobubble.model.presets import PRESETS
from nobubble.stage_options import apply_stage_options, compile_ahead, dry_run

CPU = torch.device("cpu")
MC = dataclasses.replace(
    PRESETS["tiny"], d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64
)
MOE = dataclasses.replace(MC, moe_experts=4, moe_top_k=2, moe_d_ff=32)
SETTINGS = {"batch_size": 4, "microbatches": 2, "seq_len": 16, "device": "cpu"}
HIDDEN = (2, 16, 32)  # a microbatch's activation: rows, positions, d_model

STAGES = {  # the tokens in or an activation; the logits out or an activation
    "whole": StageSpec(0, range(2), has_embed=True, has_head=True),
    "first": StageSpec(0, range(1), has_embed=True, has_head=False),
    "middle": StageSpec(1, range(1, 2), has_embed=False, has_head=False),
    "last": StageSpec(1, range(1, 2), has_embed=False, has_head=True),
}


def state(module: Stage) -> dict[str, torch.Tensor]:
    """Its weights and buffers (the routing sums are not in its state_dict)."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return {name: t.detach().clone() for name, t in tensors}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mc", [MC, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("where", sorted(STAGES))
def test_a_dry_run_leaves_the_stage_as_it_found_it(where, mc, dtype):
    """Weights, buffers (an MoE layer's routing sums grow in every backward), gradients (none
    yet) and the RNG streams are as before; the dry run did run a forward and a backward."""
    cfg = build_config({**SETTINGS, "dtype": dtype, "activation_checkpointing": True})
    module = Stage(mc, STAGES[where], seed=1)
    apply_stage_options(module, cfg, CPU)
    before, rng = state(module), torch.get_rng_state()
    calls = []
    module.register_forward_hook(lambda m, args, out: calls.append(torch.is_grad_enabled()))
    block = next(iter(module.blocks.values()))
    block.register_full_backward_hook(lambda *_: calls.append("backward"))

    dry_run(module, cfg, CPU, HIDDEN, torch.float32)

    assert calls == [True, "backward", False]  # training forward, its backward, evaluation
    after = state(module)
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    assert all(p.grad is None for p in module.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    if mc.moe_experts:
        assert all(not layer.routing_sums.any() for layer in module.moe_layers())


def test_compile_ahead_runs_only_with_compile_then_waits_for_every_rank():
    events = []
    module = Stage(MC, STAGES["middle"], seed=1)
    apply_stage_options(module, build_config(SETTINGS), CPU)  # not compiled: only its calls count
    module.register_forward_hook(lambda *_: events.append("forward"))
    for compile_ in (False, True):
        cfg = build_config({**SETTINGS, "compile": compile_})
        compile_ahead([module], cfg, CPU, HIDDEN, torch.float32, lambda: events.append("barrier"))
    assert events == ["forward", "forward", "barrier"]


def compilations() -> tuple[int, int]:
    """Dynamo's graphs so far, and the compiled graphs inductor has loaded (forward and backward
    graphs; compiled now or found in its caches, which load a backward with its forward)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    loaded = compilation_time_metrics.get("PyCodeCache.load_by_key_path", [])
    return counters["stats"]["unique_graphs"], len(loaded)


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_engine_compiles_before_step_0_and_the_run_compiles_nothing_more(one_process_group):
    """A one-stage pipeline (the stage has the embedding and the head) with activation
    checkpointing: building the engine makes the training forward, its backward and the
    evaluation forward, from the initial weights, which it leaves as they were; two steps and an
    evaluation then add no graph."""
    from nobubble.pipeline.runtime import PipelineEngine

    torch._dynamo.reset()
    cfg = build_config(
        {**SETTINGS, "compile": True, "activation_checkpointing": True, "steps": 2, "lr": 1e-2}
    )
    mc = dataclasses.replace(MC, tie_embeddings=True)
    before = compilations()
    engine = PipelineEngine(cfg, mc, CPU, 1, ParallelLayout.of(cfg))
    compiled = compilations()
    assert compiled[0] - before[0] >= 2 and compiled[1] - before[1] >= 3
    (held,) = engine.held.values()
    initial = Stage(mc, held.spec, cfg.seed)
    for name, weight in initial.named_parameters():
        assert torch.equal(held.trained.params[name], weight), name
        assert held.trained.params[name].grad is None

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (4, 17), generator=gen) for _ in range(3)]
    feed = iter(batches)
    losses = []
    engine.run_steps(2, lambda: next(feed), lambda stats: losses.append(stats.loss))
    engine.evaluate(batches[2:], torch.ones(64, dtype=torch.long))  # a byte per token
    assert len(losses) == 2 and compilations() == compiled
