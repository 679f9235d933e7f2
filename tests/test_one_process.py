"""The one-process engine on the real model, against plain PyTorch loops written out here."""

import copy
import json

import pytest
import torch

from nobubble.cli import main
from nobubble.config import TrainConfig
from nobubble.configure import resolve_config
from nobubble.model.layers import build_model
from nobubble.one_process import OneProcessEngine
from nobubble.stage_update import build_stage_optimizer
from tests.helpers.loops import plain_step
from tests.helpers.pipeline import SMALL, metrics

STEPS = 5


def config(**overrides) -> TrainConfig:
    base = dict(batch_size=4, microbatches=2, seq_len=16, lr=1e-2, warmup_steps=2, steps=STEPS)
    return resolve_config(TrainConfig(**{**base, **overrides}))


def batches(mc, cfg, n=STEPS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, mc.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=gen)
        for _ in range(n)
    ]


def run_engine(cfg, mc, data):
    engine = OneProcessEngine(cfg, mc, torch.device("cpu"))
    losses = []
    feed = iter(data)
    engine.run_steps(len(data), lambda: next(feed), lambda s: losses.append(s.loss))
    return losses, engine.named_weights()


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_sync_is_bit_identical_to_a_plain_training_loop(tiny_mc, optim):
    cfg = config(optim=optim)
    data = batches(tiny_mc, cfg)
    losses, weights = run_engine(cfg, tiny_mc, data)

    model = build_model(tiny_mc, cfg.seed)
    optimizer = build_stage_optimizer(list(model.named_parameters()), cfg, delay=0)
    expected = [plain_step(model, optimizer, b, cfg, t) for t, b in enumerate(data)]
    assert losses == expected
    for name, p in model.named_parameters():
        assert torch.equal(weights[name], p), name


@pytest.mark.parametrize(("optim", "ef"), [("adamw", False), ("adamw", True), ("muon", True)])
def test_2bw_matches_a_loop_that_keeps_the_previous_model(tiny_mc, optim, ef):
    cfg = config(optim=optim, schedule="2bw", correction="ef" if ef else "none")
    data = batches(tiny_mc, cfg)
    losses, weights = run_engine(cfg, tiny_mc, data)

    model = build_model(tiny_mc, cfg.seed)
    previous = copy.deepcopy(model)  # w[t-1], with w[-1] = w[0]
    optimizer = build_stage_optimizer(list(model.named_parameters()), cfg, delay=0)
    expected = []
    for t, batch in enumerate(data):
        before = copy.deepcopy(model)  # w[t]
        expected.append(plain_step(model, optimizer, batch, cfg, t, grad_model=previous))
        previous = before
    assert losses == pytest.approx(expected, rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(weights[name], p, rtol=1e-6, atol=1e-7, msg=name)


def test_pipedream_gives_each_stage_its_own_old_weights(tiny_mc):
    cfg = config(schedule="pipedream", stages=3, microbatches=1, batch_size=2)
    data = batches(tiny_mc, cfg)
    losses, weights = run_engine(cfg, tiny_mc, data)

    # stages of a 4-block model over 3 stages: [embed, b0], [b1, b2], [b3, norm, head]
    def stage_of(name: str) -> int:
        if name.startswith("embed") or name.startswith("blocks.0."):
            return 0
        if name.startswith(("blocks.1.", "blocks.2.")):
            return 1
        return 2

    model = build_model(tiny_mc, cfg.seed)
    optimizer = build_stage_optimizer(list(model.named_parameters()), cfg, delay=0)
    history = [copy.deepcopy(model.state_dict())]
    expected = []
    for t, batch in enumerate(data):
        mixed = copy.deepcopy(model)
        state = {n: history[max(t - (2 - stage_of(n)), 0)][n] for n in model.state_dict()}
        mixed.load_state_dict(state)
        expected.append(plain_step(model, optimizer, batch, cfg, t, mixed, stage_of))
        history.append(copy.deepcopy(model.state_dict()))
    assert losses == pytest.approx(expected, rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(weights[name], p, rtol=1e-6, atol=1e-7, msg=name)


def test_delayed_step_runs_each_microbatch_once(tiny_mc):
    cfg = config(schedule="2bw")
    engine = OneProcessEngine(cfg, tiny_mc, torch.device("cpu"))
    calls = []
    engine.trainer.micro_loss = lambda w, m, f=engine.micro_loss: calls.append(1) or f(w, m)
    feed = iter(batches(tiny_mc, cfg))
    engine.run_steps(3, lambda: next(feed), lambda s: None)
    assert len(calls) == 3 * cfg.microbatches
    assert [store.held() for store in engine.trainer.stores] == [[2, 3]]  # two versions


def test_2bw_and_sync_differ(tiny_mc):
    """Guards the tests above against a delay that silently does nothing."""
    data = batches(tiny_mc, config())
    sync_losses, _ = run_engine(config(), tiny_mc, data)
    delayed_losses, _ = run_engine(config(schedule="2bw"), tiny_mc, data)
    assert sync_losses[0] == delayed_losses[0]  # both at w[0]
    assert all(a != b for a, b in zip(sync_losses[1:], delayed_losses[1:], strict=True))


def test_dp_in_one_process_says_it_is_the_same_run(tmp_path, capsys):
    """The one-process engine has nothing to split: dp > 1 there trains what the replicas train
    together, and it says so (a run can change dp on resume in either launcher)."""
    args = [*SMALL, "steps=1", "eval_every=0", "batch_size=4", "microbatches=2"]
    assert main(["train", "--out", str(tmp_path / "dp2"), "--no-progress", *args, "dp=2"]) == 0
    err = capsys.readouterr().err
    assert "dp=2" in err and "torchrun" in err  # the setting, and how to split the work
    assert main(["train", "--out", str(tmp_path / "dp1"), "--no-progress", *args]) == 0
    assert "in one process" not in capsys.readouterr().err
    assert (
        metrics(tmp_path / "dp2")[-1]["train_loss"] == metrics(tmp_path / "dp1")[-1]["train_loss"]
    )
    # zero shards the state over the replicas: nothing to shard in one process, the same run
    zero = ["train", "--out", str(tmp_path / "z"), "--no-progress", *args, "dp=2", "zero=2"]
    assert main(zero) == 0
    assert "dp=2 with zero=2 in one process" in capsys.readouterr().err
    assert metrics(tmp_path / "z")[-1]["train_loss"] == metrics(tmp_path / "dp1")[-1]["train_loss"]


def test_a_flops_partition_is_saved_as_the_split_it_resolved_to(tmp_path):
    """partition=flops needs the vocabulary: the run resolves it into stage_layers once the
    tokenizer is known and config.json holds the split, so a resume reads the split itself."""
    run = tmp_path / "r"
    args = [*SMALL, "steps=2", "eval_every=0", "stages=2", "schedule=2bw", "microbatches=2"]
    assert main(["train", "--out", str(run), "--no-progress", *args, "partition=flops"]) == 0
    saved = json.loads((run / "config.json").read_text())
    assert saved["partition"] == "flops" and sum(saved["stage_layers"]) == 4
    assert main(["train", "--resume", str(run), "steps=3", "--no-progress"]) == 0
    assert json.loads((run / "config.json").read_text())["stage_layers"] == saved["stage_layers"]
