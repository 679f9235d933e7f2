"""LR schedules at key steps (step t turns w[t] into w[t+1]) and set_lr."""

import itertools
import math

import pytest
import torch

from nobubble.config import TrainConfig
from nobubble.optim.lr_schedule import lr_at, set_lr
from nobubble.stage_update import build_stage_optimizer


def _cfg(schedule: str, **kw) -> TrainConfig:
    base = dict(lr=1.0, steps=100, warmup_steps=10, min_lr_ratio=0.1, decay_frac=0.2)
    return TrainConfig(lr_schedule=schedule, **(base | kw))


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_linear_warmup_reaches_the_peak_on_its_last_step(schedule: str) -> None:
    cfg = _cfg(schedule)
    assert [lr_at(t, cfg) for t in (0, 1, 4, 9)] == pytest.approx([0.1, 0.2, 0.5, 1.0])


def test_cosine_key_steps() -> None:
    cfg = _cfg("cosine")  # peak at t=9, floor 0.1 at t=99; progress = (t-9)/90
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 90)))
    assert lr_at(54, cfg) == pytest.approx(0.55)  # halfway: mean of peak and floor
    assert lr_at(99, cfg) == pytest.approx(0.1)
    assert lr_at(150, cfg) == pytest.approx(0.1)  # past the end it stays at the floor
    values = [lr_at(t, cfg) for t in range(9, 100)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_cosine_without_warmup_starts_at_the_peak() -> None:
    cfg = _cfg("cosine", warmup_steps=0, steps=11, min_lr_ratio=0.0)
    assert lr_at(0, cfg) == 1.0
    assert lr_at(5, cfg) == pytest.approx(0.5)
    assert lr_at(10, cfg) == pytest.approx(0.0, abs=1e-15)


def test_wsd_key_steps() -> None:
    cfg = _cfg("wsd")  # 20 decay steps: t=80..99, from the peak at t=79 to 0.1 at t=99
    assert lr_at(10, cfg) == 1.0
    assert lr_at(79, cfg) == 1.0
    assert lr_at(80, cfg) == pytest.approx(1.0 - 0.9 / 20)
    assert lr_at(89, cfg) == pytest.approx(0.55)
    assert lr_at(99, cfg) == pytest.approx(0.1)


def test_wsd_decay_longer_than_the_run_after_warmup_starts_at_the_warmup_peak() -> None:
    cfg = _cfg("wsd", steps=20, decay_frac=0.9)  # decay would start before warmup ends
    assert lr_at(9, cfg) == 1.0
    assert lr_at(19, cfg) == pytest.approx(0.1)
    assert lr_at(14, cfg) == pytest.approx(0.55)


def test_constant_after_warmup() -> None:
    cfg = _cfg("constant")
    assert {lr_at(t, cfg) for t in (9, 10, 50, 99)} == {1.0}


def test_set_lr_sets_every_group_of_a_composite_and_respects_lr_scale() -> None:
    named = [
        ("blocks.0.attn.wq.weight", torch.nn.Parameter(torch.zeros(4, 4))),
        ("norm.weight", torch.nn.Parameter(torch.ones(4))),
    ]
    opt = build_stage_optimizer(named, TrainConfig(optim="muon", correction="ef"), delay=1)
    assert len(opt.param_groups) == 2
    opt.param_groups[1]["lr_scale"] = 0.5
    set_lr(opt, 0.25)
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.125]


def test_unknown_schedule_is_an_error_even_during_warmup() -> None:
    with pytest.raises(ValueError, match="cosine, wsd, constant"):
        lr_at(0, _cfg("linear"))
