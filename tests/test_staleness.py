"""Staleness you can see (nobubble.staleness): the weight drift of a delayed stage and the
cosine between its delayed and its fresh gradient, by hand and in the run's records."""

import json
import math
import warnings

import pytest
import torch

from nobubble.checkpoint.files import CheckpointReader, newest_weights
from nobubble.cli import main, warn_unused_settings
from nobubble.configure import build_config
from nobubble.settings_read import UnusedSettingWarning
from nobubble.staleness import COSINE, DRIFT, weight_drift
from nobubble.tracking import scalars_of
from nobubble.versions import VersionStore
from tests.helpers.pipeline import SMALL
from tests.helpers.quadratic import quadratic_grad, quadratic_trainer


def test_weight_drift_by_hand():
    """‖w[t] - w[t-d]‖ / ‖w[t]‖ over the trained parameters: (3, 4) from (0, 4) is 3/5."""
    params = {
        "a": torch.nn.Parameter(torch.tensor([0.0, 4.0])),
        "bias": torch.nn.Parameter(torch.tensor([100.0]), requires_grad=False),  # not trained
    }
    store = VersionStore(params)
    assert weight_drift(store, 1) == 0.0  # nothing has moved yet (w[-1] = w[0])
    store.begin_step(still_needed=True)  # version 1, a copy of version 0 the step updates
    with torch.no_grad():
        params["a"].copy_(torch.tensor([3.0, 4.0]))
        params["bias"].fill_(-50.0)
    assert weight_drift(store, 1) == pytest.approx(3 / 5, rel=1e-15)
    assert weight_drift(store, 0) is None  # no delay: it reads the newest weights


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.hypot(*a) / math.hypot(*b)


def test_the_gradient_cosine_on_a_toy_by_hand():
    """Stage 0 with delay 1 (2bw's), stage 1 with none (pipedream's last): the delayed gradient
    at w[t-1] against the fresh one at w[t], measured every second step."""
    trainer = quadratic_trainer([1, 0], staleness_every=2)
    w, stats = [[1.0, -2.0]], []  # stage 0's trajectory: w[t+1] = w[t] - 0.5·g(w[t-1])
    for t in range(5):
        stats.append(trainer.train_step([torch.zeros(1)]))
        g = quadratic_grad(w[max(t - 1, 0)])
        w.append([x - 0.5 * gi for x, gi in zip(w[t], g, strict=True)])
    assert [COSINE in s.measured for s in stats] == [False, True, False, True, False]
    for t in (1, 3):
        expected = _cos(quadratic_grad(w[t - 1]), quadratic_grad(w[t]))
        assert stats[t].measured == {COSINE: [pytest.approx(expected, rel=1e-12), None]}
    assert stats[1].measured[COSINE][0] < 0.99  # the two really differ here
    final = trainer.stages[0].params["w0"].tolist()
    assert final == pytest.approx(w[-1], rel=1e-15)  # measuring changed nothing
    # the weight drift of stage 0 now: |w[5] - w[4]| / |w[5]|
    drift = math.dist(w[5], w[4]) / math.hypot(*w[5])
    assert trainer.weight_drift() == [pytest.approx(drift, rel=1e-12), None]


def _train(tmp_path, name: str, *settings: str) -> list[dict]:
    out = tmp_path / name
    assert main(["train", "--no-progress", "--out", str(out), *SMALL, *settings]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_each_evaluation_records_the_drift_the_checkpoint_holds(tmp_path):
    """2bw on one model stage: the last evaluation's drift is ‖v6 - v5‖/‖v6‖ of the checkpoint
    of step 6, which holds both versions."""
    lines = _train(tmp_path, "2bw", "schedule=2bw", "steps=6", "eval_every=3")
    evals = [line for line in lines if "val_loss" in line]
    assert [e["step"] for e in evals] == [0, 3, 6]
    assert DRIFT not in evals[0]  # before the first update nothing has moved
    assert all(len(e[DRIFT]) == 1 and e[DRIFT][0] > 0 for e in evals[1:])
    reader = CheckpointReader(tmp_path / "2bw" / "checkpoints" / "step_000006")
    tensors = reader.weights(reader.index)  # "v{version}/{name}": v5 and v6 (a dense model)
    names = [key.split("/", 1)[1] for key in tensors if key.startswith("v6/")]
    moved = sum(
        float((tensors[f"v6/{n}"] - tensors[f"v5/{n}"]).double().pow(2).sum()) for n in names
    )
    size = sum(float(tensors[f"v6/{n}"].double().pow(2).sum()) for n in names)
    assert evals[-1][DRIFT][0] == pytest.approx(math.sqrt(moved / size), rel=1e-12)
    assert not any(COSINE in line for line in lines)  # staleness_every=0: never measured

    sync = _train(tmp_path, "sync", "schedule=sync", "steps=3", "eval_every=3")
    assert not any(DRIFT in line for line in sync)  # no delay, nothing to drift from


TIMES = ("tokens_per_s", "train_time_s", COSINE)


@pytest.mark.parametrize("model", [[], ["moe_experts=4", "moe_top_k=2"]], ids=["dense", "moe"])
def test_measuring_the_cosine_changes_no_step_and_keeps_its_lines(tmp_path, model):
    """The extra forward and backward leave the step, and a MoE step's routing sums, as they
    were."""
    common = ["schedule=pipedream", "stages=2", "steps=6", "eval_every=0", "log_every=5", *model]
    plain = _train(tmp_path, "plain", *common)
    measured = _train(tmp_path, "measured", *common, "staleness_every=2")
    assert [line["step"] for line in plain] == [0, 5, 6]
    assert [line["step"] for line in measured] == [0, 2, 4, 5, 6]  # every measurement kept
    by_step = {line["step"]: line for line in measured}
    for line in plain[1:]:
        kept = {k: v for k, v in by_step[line["step"]].items() if k not in TIMES}
        assert kept == {k: v for k, v in line.items() if k not in TIMES}
    assert [len(by_step[s][COSINE]) for s in (2, 4, 6)] == [2, 2, 2]
    assert all(by_step[s][COSINE][1] is None for s in (2, 4, 6))  # the last stage: no delay
    assert all(0 < by_step[s][COSINE][0] <= 1 for s in (2, 4, 6))
    a = newest_weights(tmp_path / "plain" / "checkpoints" / "step_000006")
    b = newest_weights(tmp_path / "measured" / "checkpoints" / "step_000006")
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_the_loggers_get_one_scalar_per_model_stage():
    record = {"step": 3, "val_loss": 2.0, DRIFT: [0.1, None, 0.3], COSINE: [0.9, None, 0.7]}
    assert scalars_of(record) == {
        "val_loss": 2.0,
        f"{DRIFT}/model_stage0": 0.1,
        f"{DRIFT}/model_stage2": 0.3,
        f"{COSINE}/model_stage0": 0.9,
        f"{COSINE}/model_stage2": 0.7,
    }


@pytest.mark.parametrize(
    ("settings", "torchrun", "why"),
    [
        ({"schedule": "sync"}, False, "no stage has a gradient delay"),
        ({"schedule": "2bw", "stages": 2, "microbatches": 2}, True, "under torchrun"),
    ],
)
def test_staleness_every_where_it_is_not_read_warns(settings, torchrun, why):
    cfg = build_config({**settings, "staleness_every": 5})
    with pytest.warns(UnusedSettingWarning, match=why):
        warn_unused_settings(cfg, {"staleness_every"}, torchrun)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_unused_settings(build_config({"schedule": "2bw", "staleness_every": 5}), {"x"}, False)
