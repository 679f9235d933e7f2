"""The schedule registry is the one home of each schedule's promises: what it says about delays and
weight versions is what the generated action lists do, and the config and CLI offer exactly it."""

import pytest

from nobubble.config import ConfigError, TrainConfig
from nobubble.configure import build_config, resolve_config
from nobubble.layout import ParallelLayout
from nobubble.schedules import SCHEDULE_NAMES, check_invariants, generate, lower, simulate
from nobubble.schedules.registry import PIPELINE_SCHEDULES, SYNCHRONOUS_SCHEDULES, schedule_spec
from nobubble.schedules.registry import SCHEDULES as SPECS


def test_sync_is_an_entry_with_the_semantics_of_1f1b():
    """sync is plain gradient accumulation: 1f1b's delays and order, left out of the listings
    of distinct pipeline orders, and first in the names the config accepts."""
    sync, one_f_one_b = schedule_spec("sync"), schedule_spec("1f1b")
    assert SCHEDULE_NAMES[0] == "sync" and sync.same_as == "1f1b"
    assert sync.delays(3) == one_f_one_b.delays(3) == [0, 0, 0]
    assert "sync" not in PIPELINE_SCHEDULES and "1f1b" in PIPELINE_SCHEDULES
    assert generate("sync", 3, 6, steps=2) == generate("1f1b", 3, 6, steps=2)
    flushing = {name for name, spec in SPECS.items() if spec.flushes}
    assert flushing == SYNCHRONOUS_SCHEDULES and "sync" in SYNCHRONOUS_SCHEDULES


def test_chunks_are_the_schedules_and_count_model_stages():
    """``stages`` counts processes; interleaved-1f1b cuts the model into stages x chunks."""
    cfg = build_config(
        {"schedule": "interleaved-1f1b", "stages": 2, "microbatches": 2, "batch_size": 2}
    )
    assert (cfg.chunks, ParallelLayout.of(cfg).model_stages) == (2, 4)
    three = build_config(
        {"schedule": "interleaved-1f1b", "stages": 2, "chunks": 3, "microbatches": 2}
    )
    assert ParallelLayout.of(three).model_stages == 6
    two_bw = build_config({"schedule": "2bw", "stages": 3, "microbatches": 3, "batch_size": 3})
    assert ParallelLayout.of(two_bw).model_stages == 3
    with pytest.raises(ConfigError, match="chunks=1: interleaved-1f1b needs at least 2"):
        resolve_config(TrainConfig(schedule="interleaved-1f1b", stages=2, chunks=1, microbatches=2))
    with pytest.raises(ConfigError, match="chunks=2: 1f1b runs one stage per rank"):
        resolve_config(TrainConfig(schedule="1f1b", stages=2, chunks=2, microbatches=2))
    with pytest.raises(ConfigError, match="chunks=2: sync runs one stage per rank"):
        resolve_config(TrainConfig(schedule="sync", chunks=2))
    with pytest.raises(ConfigError, match=r"lists 2 stages but stages x chunks = 2 x 2 = 4"):
        resolve_config(
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
    assert schedule_spec(name).delays(model_stages) == spec.delays(model_stages)
    # the budget is tight: the schedule really holds that many versions at every stage
    budgets = [spec.version_budget(s, model_stages) for s in range(model_stages)]
    assert result.stage_weight_versions == budgets
    chunks = spec.default_chunks
    held = [spec.activation_budget(r, stages, microbatches, chunks) for r in range(stages)]
    assert result.peak_activations == held


def test_flushing_schedules_have_no_delay_and_delayed_ones_do():
    for spec in SPECS.values():
        assert (max(spec.delays(4)) == 0) == spec.flushes


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_a_tied_weight_needs_one_delay_at_the_first_and_last_stage(name):
    """Only pipedream (stage s is P-1-s steps old) reads the embedding and the head at two
    versions; configure refuses tied embeddings exactly there."""
    spec = schedule_spec(name)
    assert spec.can_tie(1)
    assert spec.can_tie(4) is (name != "pipedream")
    # the pipeline runtime ties neither where the delays differ nor under the V placement
    assert spec.pipeline_can_tie(4) is (name not in ("pipedream", "zb-v", "dualpipev"))
    tied = {"schedule": name, "stages": 2, "microbatches": 1 if name == "pipedream" else 4}
    tied |= {"n_layers": 4, "tie_embeddings": True}
    if spec.can_tie(2):
        build_config(tied)
    else:
        with pytest.raises(ConfigError, match="tie_embeddings"):
            build_config(tied)
