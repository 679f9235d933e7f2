"""Weight prediction (correction=predict): hand-computed trajectories, no use of the future,
the weights held, the pipeline against the simulator, checkpoints and resume.

The hand cases reuse the delay tests' quadratics (tests/helpers/quadratic.py): each stage owns
one scalar w with loss 0.5·w², so the gradient is the point the step runs at,
ŵ[t] = w[c] + d·(w[c] - w[c-1]) with c = max(t - d, 0) and w[-1] = w[0].
"""

import pytest
import torch
from safetensors import safe_open

from nobubble.config import ConfigError
from nobubble.configure import build_config
from nobubble.one_process import DelayedTrainer
from nobubble.runfolder.folder import run_name
from nobubble.schedules.registry import schedule_spec
from tests.helpers.pipeline import assert_same_run, losses
from tests.helpers.quadratic import adamw_update, column, run_steps, scalar_trainer
from tests.helpers.runs import cut_back_to, resume, train


def points_seen(trainer: DelayedTrainer) -> list[list[float]]:
    """Record, for every step, the weights each stage's forward runs at."""
    seen: list[list[float]] = []
    inner = trainer.micro_loss

    def micro_loss(weights, micro):
        seen.append([w.item() for w in weights.values()])
        return inner(weights, micro)

    trainer.micro_loss = micro_loss
    return seen


def test_sgd_2bw_runs_at_the_prediction_and_updates_the_true_weights():
    # ŵ[t] = 2·w[t-1] - w[t-2], w[t+1] = w[t] - 0.5·ŵ[t]
    # t=0: ŵ = w0 = 1            w1 = 1 - .5 = .5
    # t=1: ŵ = w0 = 1 (c = 0)    w2 = .5 - .5 = 0
    # t=2: ŵ = 2·.5 - 1 = 0      w3 = 0
    # t=3: ŵ = 2·0 - .5 = -.5    w4 = 0 + .25 = .25
    # t=4: ŵ = 2·0 - 0 = 0       w5 = .25
    # t=5: ŵ = 2·.25 - 0 = .5    w6 = .25 - .25 = 0
    trainer = scalar_trainer([1], correction="predict")
    seen = points_seen(trainer)
    assert column(run_steps(trainer, 6), 0) == [1.0, 0.5, 0.0, 0.0, 0.25, 0.25, 0.0]
    assert column(seen, 0) == [1.0, 1.0, 0.0, -0.5, 0.0, 0.5]
    # plain 2bw runs at w[t-1]: 1, 1, .5, 0 (test_delay_exact)


def test_pipedream_extrapolates_over_each_stage_delay():
    trainer = scalar_trainer(schedule_spec("pipedream").delays(3), correction="predict")
    seen = points_seen(trainer)
    history = run_steps(trainer, 5)
    # delay 2: ŵ[t] = w[c] + 2·(w[c] - w[c-1]), c = t-2; w[t+1] = w[t] - 0.5·ŵ[t]
    # t=0,1,2: ŵ = w0 = 1: w = 1, .5, 0, -.5
    # t=3: ŵ = .5 + 2·(.5 - 1) = -.5: w4 = -.5 + .25 = -.25
    # t=4: ŵ = 0 + 2·(0 - .5) = -1: w5 = -.25 + .5 = .25
    assert column(seen, 0) == [1.0, 1.0, 1.0, -0.5, -1.0]
    assert column(history, 0) == [1.0, 0.5, 0.0, -0.5, -0.25, 0.25]
    # delay 1: as 2bw above; delay 0: the weights themselves (sync)
    assert column(history, 1) == [1.0, 0.5, 0.0, 0.0, 0.25, 0.25]
    assert column(seen, 2) == column(history, 2)[:5] == [1.0, 0.5, 0.25, 0.125, 0.0625]


def test_adamw_2bw_takes_the_gradient_at_the_prediction():
    trainer = scalar_trainer([1], optim="adamw", correction="predict")
    seen = points_seen(trainer)
    got = column(run_steps(trainer, 5), 0)
    weights, points, m, v = [1.0], [], 0.0, 0.0
    for t in range(5):
        newer, older = weights[max(t - 1, 0)], weights[max(t - 2, 0)]
        points.append(newer + (newer - older))
        m, v, update = adamw_update(m, v, points[-1], t + 1)  # the gradient of 0.5·ŵ²
        weights.append(weights[-1] - update)
    assert column(seen, 0) == pytest.approx(points, rel=1e-12, abs=1e-12)
    assert got == pytest.approx(weights, rel=1e-12, abs=1e-12)
    # t=2 runs at 2·w1 - w0 = 2·(1 - .5) - 1 = 0 (AdamW's first step is lr·sign(g) = .5)
    assert points[:3] == pytest.approx([1.0, 1.0, 0.0], abs=1e-7)


def test_ef_changes_the_update_and_prediction_the_point():
    # ŵ as above; EF (γ = 1): Δ[t] = 0.5·ŵ[t], w[t+1] = w[t] - Δ[t] - (Δ[t] - Δ[t-1])
    # t=0: ŵ = 1, Δ = .5:              w1 = 1 - .5 - .5 = 0
    # t=1: ŵ = w0 = 1, Δ = .5:         w2 = 0 - .5 - 0 = -.5
    # t=2: ŵ = 2·0 - 1 = -1, Δ = -.5:  w3 = -.5 + .5 - (-.5 - .5) = 1
    # t=3: ŵ = 2·(-.5) - 0 = -1, Δ = -.5: w4 = 1 + .5 - 0 = 1.5
    trainer = scalar_trainer([1], correction="ef+predict")
    seen = points_seen(trainer)
    assert column(run_steps(trainer, 4), 0) == [1.0, 0.0, -0.5, 1.0, 1.5]
    assert column(seen, 0) == [1.0, 1.0, -1.0, -1.0]


def batch_losses(schedule_delays: list[int], batches: list[float], **overrides) -> list[float]:
    """The loss of every step of a quadratic pulled towards each step's batch value x:
    0.5·(w - x)², SGD."""
    trainer = scalar_trainer(schedule_delays, **overrides)
    trainer.micro_loss = lambda weights, micro: sum(
        0.5 * ((w - micro) ** 2).sum() for w in weights.values()
    )
    return [trainer.train_step([torch.tensor([x], dtype=torch.float64)]).loss for x in batches]


def test_the_prediction_never_uses_an_update_not_computed_yet():
    """In a real 2bw pipeline step t's forwards start before the update of step t-1 exists, so
    the batch of step k reaches the weights at step k+2 at the earliest: the loss of step k+1
    must not depend on it. (The simulator has stepped t-1 when step t starts: a prediction from
    its newest weights would make it depend, and turn 2bw back into sync.)"""
    k = 2
    batches = [0.5, -1.0, 2.0, 0.25, 1.5, -0.5]
    other = [*batches[:k], -3.0, *batches[k + 1 :]]
    for delays, correction in [([1], "predict"), ([1], "ef+predict"), ([2], "predict")]:
        a = batch_losses(delays, batches, correction=correction)
        b = batch_losses(delays, other, correction=correction)
        delay = delays[0]
        assert a[:k] == b[:k]
        assert a[k] != b[k]  # its own batch
        assert a[k + 1 : k + 1 + delay] == b[k + 1 : k + 1 + delay]  # not yet reached
        assert a[k + 1 + delay] != b[k + 1 + delay]  # reached: the test can fail
    sync = batch_losses([0], batches), batch_losses([0], other)
    assert sync[0][k + 1] != sync[1][k + 1]  # control: without delay it reaches step k+1


def test_a_stage_holds_one_more_version_and_nothing_else():
    for schedule, stages, held in [("2bw", 3, [3, 3, 3]), ("pipedream", 3, [4, 3, 1])]:
        trainer = scalar_trainer(schedule_spec(schedule).delays(stages), correction="predict")
        for _ in range(5):
            trainer.train_step([torch.zeros(1)])
        # versions t-d-1 .. t between steps; no prediction and no spare buffer left behind
        assert [len(store.held()) for store in trainer.stores] == held
        assert [stage.point.copies() for stage in trainer.stages] == held
        assert [store.free for store in trainer.stores] == [[]] * stages


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"schedule": "sync"}, "predict: sync with stages=1 has no gradient delay"),
        (
            {"schedule": "1f1b", "stages": 2, "microbatches": 2},
            "1f1b with stages=2 has no gradient delay",
        ),
        ({"schedule": "pipedream", "stages": 1, "microbatches": 1}, "pipedream with stages=1"),
    ],
)
def test_predict_without_a_delay_is_refused(settings, error):
    with pytest.raises(ConfigError, match=error):
        build_config({**settings, "correction": "predict"})


def test_predict_combines_with_ef():
    cfg = build_config({"schedule": "2bw", "correction": "ef+predict"})
    assert run_name(cfg).startswith("tiny-adamw-2bw-ef-predict-")


# -- the training loop: checkpoints and resume ----------------------------------------------------


def test_a_2bw_checkpoint_holds_the_version_the_next_prediction_needs(tmp_path, capsys):
    assert (
        train(tmp_path / "r", "schedule=2bw", "steps=4", "microbatches=2", "correction=predict")
        == 0
    )
    path = tmp_path / "r" / "checkpoints" / "step_000004" / "shard_0" / "weights.safetensors"
    with safe_open(path, "pt") as f:
        versions = {key.split("/")[0] for key in f.keys()}  # noqa: SIM118
    assert versions == {"v2", "v3", "v4"}  # ŵ[4] = 2·w[3] - w[2]
    assert train(tmp_path / "plain", "schedule=2bw", "steps=4", "microbatches=2") == 0
    plain, predicted = losses(tmp_path / "plain")[0], losses(tmp_path / "r")[0]
    assert plain[:2] == predicted[:2]  # both run at w[0] (no change before the first update)
    assert all(x != y for x, y in zip(plain[2:], predicted[2:], strict=True))
    assert resume(tmp_path / "r", "correction=none", "steps=5") == 2
    assert "correction cannot change within a run" in capsys.readouterr().err


@pytest.mark.parametrize(
    "settings",
    [
        ["schedule=2bw", "microbatches=2", "correction=predict"],
        ["schedule=pipedream", "stages=3", "optim=muon", "correction=ef+predict"],
    ],
    ids=["2bw", "pipedream+ef"],
)
def test_resume_is_identical_to_an_uninterrupted_run(tmp_path, settings):
    settings = [*settings, "steps=8", "eval_every=4", "checkpoint_every=3", "keep_checkpoints=5"]
    assert train(tmp_path / "full", *settings) == 0
    assert train(tmp_path / "cut", *settings) == 0
    cut_back_to(tmp_path / "cut", 6)
    assert resume(tmp_path / "cut") == 0
    assert_same_run(tmp_path / "full", tmp_path / "cut")
