"""Tied embeddings split over pipeline stages: the first stage's embedding and the last stage's
head each hold a copy of the tied weight (``embed.weight``), its gradient is the sum of both
stages' gradients, it is clipped as a group of its own, and the two copies stay bitwise equal.

Fast tests check the semantics by hand in the single-process engine; the slow ones run the real
pipeline (torchrun, gloo) against it: losses and final weights bitwise equal (as in
tests/test_pipeline_parity.py), the two copies bitwise equal at every checkpoint.
"""

import copy
import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from nobubble.config import ConfigError, TrainConfig
from nobubble.configure import build_config
from nobubble.model.layers import build_model, lm_loss
from nobubble.model.partition import TIED_WEIGHT, partition
from nobubble.one_process import DelayedTrainer, OneProcessEngine
from nobubble.optim.lr_schedule import lr_at, set_lr
from nobubble.optim.registry import build_optimizer
from tests.helpers.loops import plain_step
from tests.helpers.pipeline import assert_same_run, losses, nobubble
from tests.helpers.runs import CONSTANT, assert_close_runs, launch, resume, train

# -- the rule, by hand ---------------------------------------------------------------------------


def toy_trainer(c_head, grad_clip=0.0, delays=(0, 0)):
    """Two stages: the first holds the tied weight ``w`` and ``a``, the last a copy of ``w`` and
    ``b``. The loss is linear, so every gradient is a constant: w's embedding use gets
    (1, 1), its head use ``c_head``, a gets (0.3, 0.4), b gets (6, 8). SGD with lr 1."""
    cfg = TrainConfig(
        optim="sgd",
        momentum=0.0,
        lr=1.0,
        lr_schedule="constant",
        warmup_steps=0,
        grad_clip=grad_clip,
    )
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    a = torch.nn.Parameter(torch.tensor([0.5, 0.5]))
    b = torch.nn.Parameter(torch.tensor([-1.0, 1.0]))
    copy_of_w = torch.nn.Parameter(w.detach().clone())

    def micro_loss(weights, micro):
        head = torch.tensor(c_head)
        return (
            weights["w"] @ torch.tensor([1.0, 1.0])
            + weights["a"] @ torch.tensor([0.3, 0.4])
            + weights["w@head"] @ head
            + weights["b"] @ torch.tensor([6.0, 8.0])
        ) * micro

    stages = [{"w": w, "a": a}, {"w": copy_of_w, "b": b}]
    trainer = DelayedTrainer(stages, delays, micro_loss, cfg, tied=("w", "w@head"))
    return trainer, (w, a, b, copy_of_w)


def test_the_copies_get_the_sum_of_both_stages_gradients():
    trainer, (w, a, b, copy_of_w) = toy_trainer(c_head=[2.0, 3.0])
    stats = trainer.train_step([torch.tensor(1.0)])
    assert w.tolist() == [1.0 - 3.0, 2.0 - 4.0]  # (1, 1) + (2, 3)
    assert torch.equal(copy_of_w, w) and copy_of_w is not w
    assert a.tolist() == pytest.approx([0.2, 0.1]) and b.tolist() == [-7.0, -7.0]
    assert stats.grad_norm == pytest.approx(math.sqrt(0.25 + 25 + 100))  # the tied norm once
    assert stats.skipped_stages == []


def test_the_tied_weight_is_clipped_by_its_own_norm_on_both_stages():
    """grad_clip 1: the tied gradient (3, 4) -> (0.6, 0.8) on both copies; a's (norm 0.5) is
    left alone (clipping the first stage as a whole would shrink it too); b's -> (0.6, 0.8)."""
    trainer, (w, a, b, copy_of_w) = toy_trainer(c_head=[2.0, 3.0], grad_clip=1.0)
    stats = trainer.train_step([torch.tensor(1.0)])
    assert w.tolist() == pytest.approx([1.0 - 0.6, 2.0 - 0.8])
    assert torch.equal(copy_of_w, w)
    assert a.tolist() == pytest.approx([0.5 - 0.3, 0.5 - 0.4])
    assert b.tolist() == pytest.approx([-1.0 - 0.6, 1.0 - 0.8])
    assert stats.grad_norm == pytest.approx(math.sqrt(0.25 + 25 + 100))  # before clipping


def test_a_non_finite_tied_gradient_skips_both_copies_only():
    trainer, (w, a, b, copy_of_w) = toy_trainer(c_head=[math.inf, 0.0], grad_clip=1.0)
    stats = trainer.train_step([torch.tensor(1.0)])
    assert w.tolist() == [1.0, 2.0] and torch.equal(copy_of_w, w)
    assert a.tolist() == pytest.approx([0.2, 0.1])  # the rest of both stages goes ahead
    assert b.tolist() == pytest.approx([-1.6, 0.2])
    assert stats.skipped_stages == [0, 1] and not math.isfinite(stats.grad_norm)


def test_under_2bw_both_uses_read_the_same_old_version():
    """Step t's gradient of both copies is computed at version t-1 (w[-1] = w[0]): both uses
    read w[0] at steps 0 and 1, w[1] at step 2; the copies are equal at every version."""
    trainer, (w, _, _, copy_of_w) = toy_trainer(c_head=[0.0, 0.0], delays=(1, 1))
    seen = []
    inner = trainer.micro_loss

    def micro_loss(weights, micro):
        seen.append((weights["w"].detach().clone(), weights["w@head"].detach().clone()))
        return inner(weights, micro)

    trainer.micro_loss = micro_loss
    w0 = w.detach().clone()
    for _ in range(3):
        trainer.train_step([torch.tensor(1.0)])
        assert torch.equal(copy_of_w, w)
    w1 = w0 - torch.tensor([1.0, 1.0])
    assert [s[0].tolist() for s in seen] == [w0.tolist(), w0.tolist(), w1.tolist()]
    assert all(torch.equal(embed, head) for embed, head in seen)
    for version in trainer.stores[0].held():
        assert torch.equal(trainer.stores[0][version]["w"], trainer.stores[1][version]["w"])


# -- the real model in the single-process engine --------------------------------------------------


def config(**overrides) -> TrainConfig:
    base = dict(batch_size=4, microbatches=2, seq_len=16, lr=1e-2, warmup_steps=2, steps=4)
    return TrainConfig(**{**base, "tie_embeddings": True, "chunks": 1, **overrides})


def batches(mc, cfg, n=4):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, mc.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=gen)
            for _ in range(n)]  # fmt: skip


def run_engine(cfg, mc, data):
    engine = OneProcessEngine(cfg, mc, torch.device("cpu"))
    out = []
    feed = iter(data)
    engine.run_steps(len(data), lambda: next(feed), out.append)
    return engine, out


def untied_step(model, optimizer, batch, cfg, t, stage_of, grad_model=None):
    """The semantics written out on an *untied* model whose head starts as a copy of the
    embedding: gradient accumulation, embed.grad + head.grad on both, the two copies clipped
    alone, every stage's other parameters clipped per stage, one optimizer step."""

    def sum_copies(m):
        summed = m.embed.weight.grad + m.head.weight.grad
        m.embed.weight.grad, m.head.weight.grad = summed, summed.clone()

    def group(name):
        return "tied " + name if name in ("embed.weight", "head.weight") else stage_of(name)

    return plain_step(model, optimizer, batch, cfg, t, grad_model, group, sum_copies)


@pytest.mark.parametrize(
    ("stages", "schedule", "optim"), [(2, "sync", "adamw"), (3, "2bw", "muon"), (2, "2bw", "adamw")]
)
def test_split_tied_model_is_an_untied_one_with_summed_gradients(tiny_mc, stages, schedule, optim):
    cfg = config(stages=stages, schedule=schedule, optim=optim, grad_clip=0.05)
    mc = dataclasses.replace(tiny_mc, tie_embeddings=True)
    data = batches(mc, cfg)
    engine, stats = run_engine(cfg, mc, data)

    model = build_model(tiny_mc, cfg.seed)  # untied
    with torch.no_grad():
        model.head.weight.copy_(model.embed.weight)  # the copy starts as the embedding
    optimizer = build_optimizer(list(model.named_parameters()), cfg)
    specs = partition(mc.n_layers, stages)
    owner = {f"blocks.{i}.": s.index for s in specs for i in s.blocks} | {"norm.": stages - 1}

    def stage_of(name):
        return next(s for prefix, s in owner.items() if name.startswith(prefix))

    previous = copy.deepcopy(model)
    expected = []
    for t, batch in enumerate(data):
        before = copy.deepcopy(model)
        grad_model = previous if schedule == "2bw" else None
        expected.append(untied_step(model, optimizer, batch, cfg, t, stage_of, grad_model))
        previous = before
    assert [s.loss for s in stats] == expected
    weights = engine.named_weights()
    assert "head.weight" not in weights
    for name, p in model.named_parameters():
        assert torch.equal(weights.get(name, weights["embed.weight"]), p), name
    first, last = engine.trainer.stores[0], engine.trainer.stores[-1]
    assert first.held() == last.held()
    for version in first.held():
        assert torch.equal(first[version][TIED_WEIGHT], last[version][TIED_WEIGHT])
        assert first[version][TIED_WEIGHT] is not last[version][TIED_WEIGHT]


def test_one_stage_shares_one_weight_as_before(tiny_mc):
    """P = 1: one parameter used by both, no copy, a plain loop bit for bit."""
    cfg = config(stages=1, optim="adamw")
    mc = dataclasses.replace(tiny_mc, tie_embeddings=True)
    data = batches(mc, cfg)
    engine, stats = run_engine(cfg, mc, data)
    assert engine.trainer.tied is None and len(engine.trainer.stores) == 1
    model = build_model(mc, cfg.seed)
    optimizer = build_optimizer(list(model.named_parameters()), cfg)
    expected = []
    for t, batch in enumerate(data):
        total = 0.0
        for micro in batch.chunk(cfg.microbatches):
            loss = lm_loss(model(micro[:, :-1]), micro[:, 1:])
            (loss / cfg.microbatches).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        set_lr(optimizer, lr_at(t, cfg))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        expected.append(total / cfg.microbatches)
    assert [s.loss for s in stats] == expected
    for name, p in model.named_parameters():
        assert torch.equal(engine.named_weights()[name], p), name


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["sync", "gpipe", "1f1b", "2bw"])
def test_tied_embeddings_pipeline_under_equal_delays(schedule):
    build_config({"tie_embeddings": True, "stages": 2, "microbatches": 2, "schedule": schedule})


def test_pipedream_with_tied_embeddings_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="different versions") as refused:
        build_config({"tie_embeddings": True, "stages": 2, "schedule": "pipedream"})
    assert "set tie_embeddings=false" in str(refused.value)
    assert "delay 1" in str(refused.value)
    build_config({"tie_embeddings": True, "stages": 1, "schedule": "pipedream"})  # one stage


# -- the real pipeline ---------------------------------------------------------------------------

PARITY = [
    # (stages, schedule, microbatches, extra settings)
    (2, "2bw", 2, ["optim=adamw", "correction=ef"]),  # (the synchronous IR: the 4-stage sync case)
    (4, "sync", 4, ["optim=muon"]),
    (4, "2bw", 4, ["optim=adamw", "correction=ef"]),
]


def shard_tensors(checkpoint, shard, kind):
    return load_file(checkpoint / f"shard_{shard}" / f"{kind}.safetensors")


def assert_copies_equal(run, stages):
    """At every checkpoint, the first and the last stage's shards hold bitwise equal copies of
    every version of the tied weight, and the same optimizer (and EF) state for it; at the end,
    the copies of the ``stages``-stage run are equal (summary.json)."""
    checkpoints = sorted((run / "checkpoints").glob("step_*"))
    assert checkpoints
    for checkpoint in checkpoints:
        shards = json.loads((checkpoint / "manifest.json").read_text())["shards"]
        for kind in ("weights", "state"):
            first = shard_tensors(checkpoint, 0, kind)
            last = shard_tensors(checkpoint, shards - 1, kind)
            mine = [k for k in first if f"/{TIED_WEIGHT}" in k or k.endswith(TIED_WEIGHT)]
            assert mine == [k for k in last if f"/{TIED_WEIGHT}" in k or k.endswith(TIED_WEIGHT)]
            assert mine, f"{checkpoint.name}: no {TIED_WEIGHT} in the {kind} shards"
            for key in mine:
                assert torch.equal(first[key], last[key]), f"{checkpoint.name}: {key} differs"
    reports = json.loads((run / "summary.json").read_text())["stages"]
    digests = {r["pp_rank"]: r.get("tied_sha256") for r in reports}
    assert digests[0] is not None and digests[0] == digests[stages - 1]
    assert all(digests[s] is None for s in range(1, stages - 1))


@pytest.mark.slow
@pytest.mark.parametrize(("stages", "schedule", "micro", "extra"), PARITY)
def test_tied_pipeline_matches_the_simulation(tmp_path, stages, schedule, micro, extra):
    settings = [f"schedule={schedule}", f"stages={stages}", f"microbatches={micro}", "steps=6"]
    settings += ["tie_embeddings=true", "eval_every=3", "checkpoint_every=2", "keep_checkpoints=9"]
    nobubble(tmp_path / "pipeline", *settings, *extra, stages=stages)
    nobubble(tmp_path / "simulated", *settings, *extra)
    assert_same_run(tmp_path / "pipeline", tmp_path / "simulated")
    assert_copies_equal(tmp_path / "pipeline", stages)


@pytest.mark.slow
def test_tied_pipeline_with_replicas_equals_one_process(tmp_path):
    """P = 2, dp = 2: the tied all-reduce spans the first and the last stage of both replicas
    (sum, then divided by dp) and replaces the data-parallel one for the tied weight. Equal to
    one process within test_data_parallel's tolerance (summation order); the four copies of the
    tied weight (two stages x two replicas) bitwise equal."""
    settings = ["schedule=2bw", "stages=2", "microbatches=2", "steps=6", "eval_every=3"]
    settings += ["tie_embeddings=true", "optim=adamw", "correction=ef", "checkpoint_every=3"]
    nobubble(tmp_path / "dp", *settings, "dp=2", stages=4)
    nobubble(tmp_path / "one", *settings)
    assert_close_runs(tmp_path / "dp", tmp_path / "one")
    assert_copies_equal(tmp_path / "dp", 2)
    reports = json.loads((tmp_path / "dp" / "summary.json").read_text())["stages"]
    assert len({r["tied_sha256"] for r in reports}) == 1 and len(reports) == 4
    for stage in (0, 1):
        assert len({r["weights_sha256"] for r in reports if r["pp_rank"] == stage}) == 1


TIED_2BW = [*CONSTANT, "tie_embeddings=true", "schedule=2bw", "microbatches=4", "grad_clip=0"]
TIED_2BW += ["optim=adamw", "correction=ef"]


def test_a_tied_checkpoint_continues_exactly_on_another_split_in_the_simulator(tmp_path):
    """Both copies are saved as embed.weight; the last stage of another split reads its copy
    (versions, optimizer and EF state) by that name. Without clipping a 2-, 3- and 4-stage 2bw
    run are the same run."""
    assert train(tmp_path / "full", *TIED_2BW, "stages=3", "steps=6") == 0
    assert train(tmp_path / "cut", *TIED_2BW, "stages=2", "steps=3") == 0
    assert resume(tmp_path / "cut", "stages=3", "steps=6") == 0
    assert_same_run(tmp_path / "full", tmp_path / "cut")


@pytest.mark.slow
def test_a_tied_pipeline_checkpoint_continues_exactly_on_twice_the_stages(tmp_path):
    assert train(tmp_path / "full", *TIED_2BW, "stages=4", "steps=6") == 0
    nobubble(tmp_path / "cut", *TIED_2BW, "stages=2", "steps=3", stages=2)
    launch("--resume", str(tmp_path / "cut"), "stages=4", "steps=6", stages=4)
    assert_same_run(tmp_path / "full", tmp_path / "cut")
    assert_copies_equal(tmp_path / "cut", 4)


SMOLLM2 = ["preset=smollm2-135m", "d_model=none", "n_layers=none", "n_heads=none"]
SMOLLM2 += ["n_kv_heads=none", "d_ff=none", "seq_len=16", "batch_size=4", "microbatches=4"]
SMOLLM2 += ["steps=2", "eval_every=0", "schedule=2bw", "optim=sgd", "warmup_steps=1"]
SMOLLM2 += ["grad_clip=0"]


@pytest.mark.slow
@pytest.mark.extended  # the tied path at scale; make test runs it on tiny shapes above
def test_smollm2_135m_pipelines_over_4_stages(tmp_path):
    """The published SmolLM2-135M shape (tied, 30 blocks, vocabulary 49152), two 2bw steps on 4
    stages (first, two middle, last) against the simulator. Two stages add no path the tiny tied
    parity cases above miss, and a run of this size costs CI most of a minute."""
    nobubble(tmp_path / "simulated", *SMOLLM2, "stages=4", timeout=900)
    assert all(math.isfinite(loss) for loss in losses(tmp_path / "simulated")[0])
    nobubble(tmp_path / "pipeline", *SMOLLM2, "stages=4", stages=4, timeout=900)
    assert_same_run(tmp_path / "pipeline", tmp_path / "simulated")
    assert_copies_equal(tmp_path / "pipeline", 4)


@pytest.mark.slow
def test_a_v_schedule_with_tied_embeddings_under_torchrun_stops_every_rank_with_the_fix(tmp_path):
    """The V placement's two copies would share rank 0 (docs/pipeline.md, The V placement):
    every rank refuses before its engine is built, none waits for another, no run is left."""
    run = tmp_path / "r"
    settings = ["schedule=zb-v", "stages=2", "microbatches=4", "steps=2", "tie_embeddings=true"]
    result = nobubble(run, *settings, stages=2, check=False)
    assert result.returncode == 2
    error = result.stderr
    assert "zb-v with tied embeddings" in error and "tie_embeddings=false" in error  # the fix
    assert not run.exists()
