"""The applied-step error (nobubble.staleness, ``applied_error_every``): the update a stage
applied against the one the same optimizer state would apply from the fresh gradient, by hand
on toys whose gradients are known, zero under sync, and measured without changing the run."""

import json
import math
import warnings

import pytest
import torch

from nobubble.cli import main, warn_unused_settings
from nobubble.config import ConfigError
from nobubble.configure import build_config
from nobubble.corrections.registry import REGISTRY
from nobubble.optim.registry import OPTIMIZERS
from nobubble.settings_read import UnusedSettingWarning
from nobubble.stage_update import TrainedStage
from nobubble.staleness import (
    APPLIED_COSINE,
    APPLIED_ERROR,
    SYNC_STEP_COSINE,
    SYNC_STEP_ERROR,
    applied_error,
)
from nobubble.tracking import scalars_of
from tests.helpers.pipeline import SMALL, assert_same_run
from tests.helpers.quadratic import LR, quadratic_grad, quadratic_trainer


def _by_hand(applied: list[float], fresh: list[float]) -> tuple[float, float]:
    """‖a - f‖ / ‖f‖ and cos(a, f) of two 2-vectors."""
    error = math.dist(applied, fresh) / math.hypot(*fresh)
    cosine = sum(a * f for a, f in zip(applied, fresh, strict=True))
    return error, cosine / math.hypot(*applied) / math.hypot(*fresh)


def test_the_applied_error_under_sgd_on_a_toy_by_hand():
    """Stage 0 with delay 1 (2bw's): Δa = -lr·g(w[t-1]), Δf = -lr·g(w[t]); stage 1 without a
    delay, whose gradient is the fresh one: error 0, cosine 1."""
    trainer = quadratic_trainer([1, 0], applied_error_every=1)
    w = [[1.0, -2.0]]  # stage 0's trajectory
    for t in range(5):
        stats = trainer.train_step([torch.zeros(1)])
        applied = [-LR * g for g in quadratic_grad(w[max(t - 1, 0)])]
        fresh = [-LR * g for g in quadratic_grad(w[t])]
        w.append([x + d for x, d in zip(w[t], applied, strict=True)])
        error, cosine = _by_hand(applied, fresh)
        assert stats.measured[APPLIED_ERROR] == [pytest.approx(error, rel=1e-12, abs=1e-15), 0.0]
        assert stats.measured[APPLIED_COSINE] == [pytest.approx(cosine, rel=1e-12), 1.0]
    assert stats.measured[APPLIED_ERROR][0] > 0.1  # the two really differ
    assert trainer.stages[0].params["w0"].tolist() == pytest.approx(w[-1], rel=1e-15)


def test_error_feedback_acts_on_both_updates_by_hand():
    """EF with γ over SGD: w[t+1] = w[t] + (1 + γ)·u[t] - γ·u[t-1], u the base update, -lr times
    the gradient the step is given: the delayed one for Δa, the fresh one for Δf, from the same
    u[t-1] (the run's)."""
    gamma = 1.5
    trainer = quadratic_trainer([1], applied_error_every=1, correction="ef", ef_gamma=gamma)
    w, previous = [[1.0, -2.0]], [0.0, 0.0]
    for t in range(5):
        stats = trainer.train_step([torch.zeros(1)])
        base = [-LR * g for g in quadratic_grad(w[max(t - 1, 0)])]
        would = [-LR * g for g in quadratic_grad(w[t])]
        applied = [(1 + gamma) * u - gamma * p for u, p in zip(base, previous, strict=True)]
        fresh = [(1 + gamma) * u - gamma * p for u, p in zip(would, previous, strict=True)]
        w.append([x + d for x, d in zip(w[t], applied, strict=True)])
        previous = base
        error, cosine = _by_hand(applied, fresh)
        assert stats.measured[APPLIED_ERROR] == [pytest.approx(error, rel=1e-12, abs=1e-15)]
        assert stats.measured[APPLIED_COSINE] == [pytest.approx(cosine, rel=1e-12)]
        # against the synchronous step: SGD alone on the fresh gradient, Δs = u_fresh
        error, cosine = _by_hand(applied, would)
        assert stats.measured[SYNC_STEP_ERROR] == [pytest.approx(error, rel=1e-12, abs=1e-15)]
        assert stats.measured[SYNC_STEP_COSINE] == [pytest.approx(cosine, rel=1e-12)]
    assert trainer.stages[0].params["w0"].tolist() == pytest.approx(w[-1], rel=1e-15)


def test_without_an_update_correction_the_synchronous_step_is_the_fresh_one():
    """No wrapper: Δs = Δf, so both pairs of measures agree exactly."""
    trainer = quadratic_trainer([1], applied_error_every=1)
    for _ in range(3):
        measured = trainer.train_step([torch.zeros(1)]).measured
        assert measured[SYNC_STEP_ERROR] == measured[APPLIED_ERROR]
        assert measured[SYNC_STEP_COSINE] == measured[APPLIED_COSINE]


def test_the_measures_by_hand():
    applied = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.0])}
    fresh = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}
    assert applied_error(applied, fresh) == pytest.approx((math.sqrt(32) / 5, 9 / 25))
    assert applied_error(fresh, fresh) == (0.0, 1.0)


def _cases() -> list[tuple[str, str]]:
    """Every optimizer under every correction that changes the update (and none), where the
    configuration allows it under 2bw."""
    wrappers = ["none", *(name for name, c in REGISTRY.items() if c.wrap is not None)]
    cases = []
    for optim in OPTIMIZERS:
        for correction in wrappers:
            try:
                build_config({"optim": optim, "correction": correction, "schedule": "2bw"})
            except ConfigError:
                continue
            cases.append((optim, correction))
    return cases


def test_from_its_own_gradient_a_stage_would_apply_exactly_its_update():
    """update_from, given the gradient the stage steps with, returns the update apply makes,
    bit for bit, and leaves the stage alone: the copies carry the whole state."""
    cases = _cases()
    assert len(cases) > len(OPTIMIZERS)
    for optim, correction in cases:
        cfg = build_config(
            {"optim": optim, "correction": correction, "schedule": "2bw", "warmup_steps": 0}
        )
        torch.manual_seed(0)
        params = {
            "blocks.0.attn.wq.weight": torch.nn.Parameter(torch.randn(8, 8)),
            "blocks.0.norm.weight": torch.nn.Parameter(torch.randn(8)),
            "embed.weight": torch.nn.Parameter(torch.randn(5, 8)),
        }
        stage = TrainedStage(0, params, 1, cfg)
        for t in range(3):
            for p in stage.params.values():
                p.grad = torch.randn_like(p)
            would = stage.update_from({n: p.grad for n, p in stage.params.items()}, t)
            before = {n: p.detach().clone() for n, p in stage.params.items()}
            stage.apply(t, {}, 0.0)
            for name, p in stage.params.items():
                assert torch.equal(p.detach() - before[name], would[name]), (optim, correction, t)


def _train(tmp_path, name: str, *settings: str) -> list[dict]:
    out = tmp_path / name
    assert main(["train", "--no-progress", "--out", str(out), *SMALL, *settings]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_under_sync_the_applied_update_is_the_fresh_one(tmp_path):
    """Two model stages (the tied embedding split over them), two microbatches: zero up to the
    order of summation (bitwise zero on the CPU)."""
    lines = _train(
        tmp_path, "sync", "schedule=sync", "stages=2", "microbatches=2", "tie_embeddings=true",
        "steps=4", "eval_every=0", "applied_error_every=1",
    )  # fmt: skip
    measured = [line for line in lines if APPLIED_ERROR in line]
    assert [line["step"] for line in measured] == [1, 2, 3, 4]
    for line in measured:
        assert line[APPLIED_ERROR] == pytest.approx([0.0, 0.0], abs=1e-6)
        assert line[APPLIED_COSINE] == pytest.approx([1.0, 1.0], abs=1e-9)


@pytest.mark.parametrize(
    "setup",
    [
        ["optim=adamw"],
        ["optim=muon", "correction=ef", "stages=2", "microbatches=2", "tie_embeddings=true"],
    ],
    ids=["2bw", "2bw+ef-muon-2stages-tied"],
)
def test_measuring_changes_no_step(tmp_path, setup):
    """The same losses and final weights, bitwise, with the measure at every step or never;
    the measured lines say the delay matters."""
    common = ["schedule=2bw", "steps=5", "eval_every=5", *setup]
    _train(tmp_path, "plain", *common, "applied_error_every=0")
    measured = _train(tmp_path, "measured", *common, "applied_error_every=1")
    assert_same_run(tmp_path / "plain", tmp_path / "measured")
    errors = [line[APPLIED_ERROR] for line in measured if APPLIED_ERROR in line]
    assert len(errors) == 5
    assert all(e > 0 and math.isfinite(e) for stages in errors[1:] for e in stages)


def test_a_resumed_run_measures_what_an_uninterrupted_one_does(tmp_path):
    """The measure reads the optimizer and correction state, which a checkpoint restores."""
    common = [
        "schedule=2bw", "correction=ef", "lr_schedule=constant", "eval_every=0",
        "checkpoint_every=3", "applied_error_every=2",
    ]  # fmt: skip
    full = _train(tmp_path, "full", *common, "steps=6")
    _train(tmp_path, "cut", *common, "steps=3")
    assert main(["train", "--no-progress", "--resume", str(tmp_path / "cut"), "steps=6"]) == 0
    lines = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()

    def measures(records: list[dict]) -> list[tuple]:
        keys = (APPLIED_ERROR, APPLIED_COSINE)
        return [(r["step"], *(r[k] for k in keys)) for r in records if APPLIED_ERROR in r]

    assert [m[0] for m in measures(full)] == [2, 4, 6]
    assert measures([json.loads(line) for line in lines]) == measures(full)


def test_the_setting_is_checked_and_warned_about_where_it_is_not_read():
    with pytest.raises(ConfigError, match="applied_error_every"):
        build_config({"applied_error_every": -1})
    pipeline = build_config({"schedule": "2bw", "stages": 2, "microbatches": 2,
                             "applied_error_every": 5})  # fmt: skip
    with pytest.warns(UnusedSettingWarning, match="under torchrun"):
        warn_unused_settings(pipeline, {"applied_error_every"}, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sync in one process: measured (zero, a control)
        warn_unused_settings(
            build_config({"applied_error_every": 5}), {"applied_error_every"}, False
        )


def test_the_loggers_get_one_scalar_per_model_stage():
    record = {"step": 3, APPLIED_ERROR: [0.5, 0.25], APPLIED_COSINE: [0.75, 1.0]}
    assert scalars_of(record) == {
        f"{APPLIED_ERROR}/model_stage0": 0.5,
        f"{APPLIED_ERROR}/model_stage1": 0.25,
        f"{APPLIED_COSINE}/model_stage0": 0.75,
        f"{APPLIED_COSINE}/model_stage1": 1.0,
    }
