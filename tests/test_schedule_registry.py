"""The schedule registry is the one home of each schedule's promises: what it says about delays and
weight versions is what the generated action lists do, and the config and CLI offer exactly it."""

import pytest

from nobubble.config import SCHEDULES, SYNC, SYNC_SCHEDULES, ConfigError, TrainConfig, validate
from nobubble.delay import stage_delays
from nobubble.schedules import SCHEDULE_NAMES, check_invariants, generate, lower, simulate
from nobubble.schedules.registry import SCHEDULES as SPECS


def test_config_offers_sync_and_every_schedule():
    assert (SYNC, *SPECS) == SCHEDULES
    assert (SYNC, *(n for n, spec in SPECS.items() if spec.flushes)) == SYNC_SCHEDULES
    assert stage_delays(SYNC, 3) == [0, 0, 0]


def test_chunks_are_the_schedules_and_count_model_stages():
    """``stages`` counts processes; interleaved-1f1b cuts the model into stages x chunks."""
    cfg = TrainConfig(schedule="interleaved-1f1b", stages=2, microbatches=2, batch_size=2)
    validate(cfg)
    assert (cfg.stage_chunks(), cfg.model_stages()) == (2, 4)
    three = TrainConfig(schedule="interleaved-1f1b", stages=2, chunks=3, microbatches=2)
    assert three.model_stages() == 6
    assert TrainConfig(schedule="2bw", stages=3).model_stages() == 3
    with pytest.raises(ConfigError, match="chunks=1: interleaved-1f1b needs at least 2"):
        validate(TrainConfig(schedule="interleaved-1f1b", stages=2, chunks=1, microbatches=2))
    with pytest.raises(ConfigError, match="chunks=2: 1f1b runs one stage per rank"):
        validate(TrainConfig(schedule="1f1b", stages=2, chunks=2, microbatches=2))
    with pytest.raises(ConfigError, match="chunks=2: sync runs one model stage"):
        validate(TrainConfig(schedule="sync", chunks=2))
    with pytest.raises(ConfigError, match=r"lists 2 stages but stages x chunks = 2 x 2 = 4"):
        validate(
            TrainConfig(schedule="interleaved-1f1b", stages=2, microbatches=2, stage_layers=[2, 2])
        )


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_generated_schedules_keep_the_registered_promises(name, stages):
    spec = SPECS[name]
    microbatches = 2 * stages
    actions = generate(name, stages, microbatches, steps=3)
    result = simulate(lower(actions))
    assert check_invariants(actions, name, result) == []  # delays per STEP, versions in budget
    model_stages = stages * spec.default_chunks
    assert result.stages == model_stages
    assert stage_delays(name, model_stages) == spec.delays(model_stages)
    # the budget is tight: the schedule really holds that many versions at every stage
    budgets = [spec.version_budget(s, model_stages) for s in range(model_stages)]
    assert result.stage_weight_versions == budgets
    chunks = spec.default_chunks
    held = [spec.activation_budget(r, stages, microbatches, chunks) for r in range(stages)]
    assert result.peak_activations == held


def test_flushing_schedules_have_no_delay_and_delayed_ones_do():
    for spec in SPECS.values():
        assert (max(spec.delays(4)) == 0) == spec.flushes
