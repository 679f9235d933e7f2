"""The delay semantics against hand-computed trajectories on quadratics.

Each "stage" owns one scalar parameter with loss 0.5·w², so its gradient is w itself and every
value below can be checked with pencil and paper.
"""

import pytest
import torch

from nobubble.schedules.registry import schedule_spec
from nobubble.versions import gradient_version
from tests.helpers.quadratic import adamw_update, column, run_steps, scalar_trainer


def test_delay_profiles():
    assert schedule_spec("sync").delays(4) == [0, 0, 0, 0]
    assert schedule_spec("1f1b").delays(4) == [0, 0, 0, 0]
    assert schedule_spec("2bw").delays(4) == [1, 1, 1, 1]
    assert schedule_spec("pipedream").delays(4) == [3, 2, 1, 0]
    assert [gradient_version(t, 1) for t in range(4)] == [0, 0, 1, 2]


def test_sgd_sync_halves_the_weight_each_step():
    # w[t+1] = w[t] - 0.5·w[t]
    assert column(run_steps(scalar_trainer([0]), 3), 0) == [1.0, 0.5, 0.25, 0.125]


def test_sgd_2bw_uses_the_gradient_of_the_previous_weights():
    # w[t+1] = w[t] - 0.5·w[t-1], w[-1] = w[0] = 1
    # w1 = 1 - 0.5 = 0.5; w2 = 0.5 - 0.5·1 = 0; w3 = 0 - 0.5·0.5 = -0.25; w4 = -0.25 - 0 = -0.25
    assert column(run_steps(scalar_trainer([1]), 4), 0) == [1.0, 0.5, 0.0, -0.25, -0.25]


def test_pipedream_gives_stage_s_a_delay_of_p_minus_1_minus_s():
    history = run_steps(scalar_trainer(schedule_spec("pipedream").delays(3)), 5)
    # delay 2: w[t+1] = w[t] - 0.5·w[t-2]: 1, .5, 0, -.5, -.75, -.75
    assert column(history, 0) == [1.0, 0.5, 0.0, -0.5, -0.75, -0.75]
    # delay 1 (as 2bw) and delay 0 (as sync)
    assert column(history, 1) == [1.0, 0.5, 0.0, -0.25, -0.25, -0.125]
    assert column(history, 2) == [1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125]


def test_error_feedback_on_sgd_sync():
    # Δ[t] = 0.5·w[t]; w[t+1] = w[t] - Δ[t] - (Δ[t] - Δ[t-1]), Δ[-1] = 0
    # w1 = 1 - .5 - .5 = 0; Δ1 = 0: w2 = 0 - 0 - (0 - .5) = .5; Δ2 = .25: w3 = .5 - .25 - .25 = 0
    assert column(run_steps(scalar_trainer([0], correction="ef"), 3), 0) == [1.0, 0.0, 0.5, 0.0]


def test_error_feedback_with_gamma_on_sgd_2bw():
    # Δ[t] = 0.5·w[t-1]; w[t+1] = w[t] - Δ[t] - 0.5·(Δ[t] - Δ[t-1])
    # Δ0 = .5: w1 = 1 - .5 - .25 = .25; Δ1 = .5: w2 = .25 - .5 - 0 = -.25
    # Δ2 = .5·w1 = .125: w3 = -.25 - .125 - .5·(.125 - .5) = -.1875
    got = column(run_steps(scalar_trainer([1], correction="ef", ef_gamma=0.5), 3), 0)
    assert got == [1.0, 0.25, -0.25, -0.1875]


@pytest.mark.parametrize("delay", [0, 1])
def test_adamw_state_is_built_from_the_stale_gradients(delay):
    trainer = scalar_trainer([delay], optim="adamw")
    got = column(run_steps(trainer, 3), 0)
    weights, m, v = [1.0], 0.0, 0.0
    for t in range(3):
        g = weights[max(t - delay, 0)]  # gradient of 0.5·w² at the version used
        m, v, update = adamw_update(m, v, g, t + 1)
        weights.append(weights[-1] - update)
    assert got == pytest.approx(weights, rel=1e-12, abs=1e-12)
    if delay:  # the stale second step repeats the first gradient: the same full-size step
        assert got[2] == pytest.approx(1.0 - 2 * 0.5, abs=1e-7)


def test_versions_held_are_exactly_what_the_delay_needs():
    trainer = scalar_trainer(schedule_spec("pipedream").delays(3))
    for _ in range(5):
        trainer.train_step([torch.zeros(1)])
    # stage s keeps d_s old versions plus the newest one
    assert [len(store.held()) for store in trainer.stores] == [3, 2, 1]
