"""The schedule registry is the one home of each schedule's promises: what it says about delays and
weight versions is what the generated action lists do, and the config and CLI offer exactly it."""

import pytest

from nobubble.config import SCHEDULES, SYNC, SYNC_SCHEDULES
from nobubble.delay import stage_delays
from nobubble.schedules import SCHEDULE_NAMES, check_invariants, generate, lower, simulate
from nobubble.schedules.registry import SCHEDULES as SPECS


def test_config_offers_sync_and_every_registered_schedule():
    assert SCHEDULES == (SYNC, *SCHEDULE_NAMES)
    assert SYNC_SCHEDULES == (SYNC, *(n for n, spec in SPECS.items() if spec.flushes))
    assert stage_delays(SYNC, 3) == [0, 0, 0]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_generated_schedules_keep_the_registered_promises(name, stages):
    spec = SPECS[name]
    microbatches = max(stages, 2)
    actions = generate(name, stages, microbatches, steps=3)
    result = simulate(lower(actions))
    assert check_invariants(actions, name, result) == []  # delays per STEP, versions in budget
    assert stage_delays(name, stages) == spec.delays(stages)
    # the budget is tight: the schedule really holds that many versions at every stage
    assert result.weight_versions == [spec.version_budget(s, stages) for s in range(stages)]


def test_flushing_schedules_have_no_delay_and_delayed_ones_do():
    for spec in SPECS.values():
        assert (max(spec.delays(4)) == 0) == spec.flushes
