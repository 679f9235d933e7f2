"""The scaling report: the power-law fit on synthetic points with known exponents, the pairing of
delayed runs with their synchronous partners, the study's check on hand-made laws, and
``nobubble report --scaling`` end to end on tiny fake run folders."""

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from nobubble.cli import main
from nobubble.config import TrainConfig
from nobubble.corrections import auto
from nobubble.delay_law import Law, load_laws
from nobubble.reporting import cli as report
from nobubble.reporting.law_fit import PARAMS, TOKENS, Point, fit_law
from nobubble.reporting.runs import ReportError, discover, result_settings
from nobubble.reporting.scaling import (
    PAPER_FIGURES,
    ladder_points,
    pair_runs,
    paper_checks,
    paper_params,
    setup_of,
    size_and_tokens,
)
from nobubble.reporting.scaling_report import origins_line

PNG = b"\x89PNG\r\n\x1a\n"
M = 1e6


def law_value(coef: float, a: float, b: float, params: float, tokens: float) -> float:
    return coef * (params / M) ** a * (tokens / M) ** b


# a size ladder at 2.6 M tokens and a length ladder at 1.1 M parameters, as issue 35's grid
SIZES = [1.1 * M, 3.3 * M, 7.4 * M, 13.8 * M]
LENGTHS = [0.33 * M, 0.66 * M, 1.3 * M, 5.2 * M]
LADDER = [(p, 2.6 * M) for p in SIZES] + [(1.1 * M, t) for t in LENGTHS]


def synthetic(coef, a, b, seeds=2, noise=0.0, rng=None, rungs=LADDER):
    """Points on the law, each seed off it by a lognormal factor of ``noise``."""
    rng = rng or np.random.default_rng(0)
    return [
        Point(p, t, tuple(law_value(coef, a, b, p, t) * np.exp(rng.normal(0, noise, seeds))))
        for p, t in rungs
    ]


def test_the_fit_recovers_known_exponents_and_its_band_covers_them():
    points = synthetic(0.5, -0.3, -0.2, seeds=4, noise=0.05, rng=np.random.default_rng(3))
    fit = fit_law("gap", "muon", "2bw", points)
    law = fit.law
    assert law.params_exp == pytest.approx(-0.3, abs=0.03)
    assert law.tokens_exp == pytest.approx(-0.2, abs=0.03)
    assert law.coef == pytest.approx(0.5, rel=0.1)
    assert law.not_measured == () and not fit.confounded and not fit.dropped
    assert len(law.samples) == 1000 and fit.skipped_samples == 0
    low, high = fit.exponent_interval(PARAMS)
    assert low < -0.3 < high
    low, high = fit.exponent_interval(TOKENS)
    assert low < -0.2 < high
    low, high = law.interval(7.4 * M, 2.6 * M)  # a measured point: the band covers the truth
    assert low < law_value(0.5, -0.3, -0.2, 7.4 * M, 2.6 * M) < high
    assert law.points == 4 * len(LADDER)
    assert law.params_range == (1.1 * M, 13.8 * M) and law.tokens_range == (0.33 * M, 5.2 * M)
    assert 1.0 < fit.scatter < 1.1  # the seeds' 5% noise, averaged over 4


def test_the_fit_is_exact_on_points_without_noise():
    points = synthetic(0.2, -0.5, 0.25)
    law = fit_law("gap", "adamw", "2bw", points).law
    assert (law.coef, law.params_exp, law.tokens_exp) == pytest.approx((0.2, -0.5, 0.25))
    assert all(s == pytest.approx((0.2, -0.5, 0.25)) for s in law.samples)  # nothing to resample


def test_only_the_axis_that_varies_is_fitted():
    rungs = [(1.1 * M, t) for t in LENGTHS]  # the length ladder alone
    points = synthetic(0.3, -0.4, -0.7, rungs=rungs)
    fit = fit_law("gap", "muon", "2bw", points)
    law = fit.law
    assert law.tokens_exp == pytest.approx(-0.7)
    assert law.params_exp == 0 and law.not_measured == (PARAMS,)
    assert law.params_range == (1.1 * M, 1.1 * M)
    assert law.coef == pytest.approx(law_value(0.3, -0.4, 0, 1.1 * M, M))  # the size folded in
    assert fit.exponent_interval(PARAMS) is None
    assert all(s[1] == 0 for s in law.samples)


def test_axes_that_vary_only_together_give_their_trend_to_params():
    rungs = [(p, 20 * p) for p in SIZES]  # a size ladder at 20 tokens per parameter
    points = synthetic(0.3, -0.4, -0.2, rungs=rungs)
    fit = fit_law("gap", "muon", "2bw", points)
    assert fit.confounded and fit.law.not_measured == (TOKENS,)
    assert fit.law.params_exp == pytest.approx(-0.6)  # both exponents: tokens = 20 params
    assert fit.law.tokens_exp == 0


def test_points_at_or_below_zero_are_left_out_and_counted():
    rungs = [(p, 2.6 * M) for p in SIZES]
    points = synthetic(0.1, -0.5, 0.0, rungs=rungs)
    points.append(Point(30 * M, 2.6 * M, (0.01, -0.03)))  # mean -0.01: a run that beats sync
    fit = fit_law("gap", "muon", "2bw", points)
    assert [p.params for p in fit.dropped] == [30 * M]
    assert fit.law.params_exp == pytest.approx(-0.5)
    assert fit.law.params_range == (1.1 * M, 13.8 * M)  # the fitted points' range
    assert fit.law.points == 8


def test_bootstrap_samples_that_lose_an_axis_are_skipped_and_counted():
    points = [Point(M, M, (0.3, -0.1)), Point(4 * M, M, (0.2, 0.2))]  # seed means 0.1, 0.2
    fit = fit_law("gap", "muon", "2bw", points)
    assert fit.law.params_exp == pytest.approx(math.log(2) / math.log(4))
    # resampling (-0.1, -0.1) (a quarter of the time) leaves one point: no slope to fit
    assert fit.skipped_samples + len(fit.law.samples) == 1000
    assert 150 < fit.skipped_samples < 350


def test_a_single_point_has_no_law():
    fit = fit_law("gap", "muon", "2bw", [Point(M, M, (0.1, 0.2))])
    assert fit.law is None and fit.why_none.startswith("muon 2bw gap:")  # names its law


# --- the study's check, on hand-made laws -----------------------------------------------------


def hand_law(quantity, optim, setup, coef, samples, params_exp=0.0, tokens_exp=0.0):
    return Law(
        quantity, optim, setup, coef, params_exp, tokens_exp, tuple(samples),
        params_range=(M, 10 * M), tokens_range=(M, 4 * M),
    )  # fmt: skip


def test_the_study_s_size_is_its_360m_shape_without_embedding():
    # 32 blocks of d = 960, 15 + 5 heads of 64, d_ff = 2560, two norms of 960
    block = 2 * 960 * 64 * (15 + 5) + 3 * 960 * 2560 + 2 * 960
    assert paper_params() == 32 * block == 314_634_240


def test_the_check_s_arithmetic_on_hand_made_laws():
    tokens = 2e9
    laws = [
        # flat laws (exponents 0): the prediction is the coefficient at any size
        hand_law("gap", "muon", "2bw", 0.006, [(0.004, 0, 0), (0.024, 0, 0)]),
        hand_law("gap", "muon", "2bw+auto", 0.02, [(0.015, 0, 0), (0.025, 0, 0)]),
        hand_law("gap", "adamw", "2bw", 0.2, [(0.2, -0.1, 0)], params_exp=-0.1),
    ]
    checks, missing = paper_checks(laws, tokens)
    by = {(c.figure.optim, c.figure.setup, c.law.quantity): c for c in checks}
    assert set(by) == {("muon", "2bw", "gap"), ("muon", "2bw+auto", "gap"), ("adamw", "2bw", "gap")}
    # no relative-gap laws given; AdamW's figure has no sync loss, so no relative gap to miss
    assert missing == ["muon 2bw relative_gap", "muon 2bw+auto relative_gap"]

    muon = by["muon", "2bw", "gap"]
    assert muon.paper == pytest.approx(2.590 - 2.578)
    assert muon.predicted == pytest.approx(0.006)
    # two samples: the 5% and 95% quantiles interpolate between them
    assert muon.band == pytest.approx((0.004 + 0.05 * 0.02, 0.004 + 0.95 * 0.02))
    assert muon.inside and muon.miss == 1.0
    assert muon.ratio == pytest.approx(0.5)
    assert muon.beyond == pytest.approx((314_634_240 / (10 * M), tokens / (4 * M)))

    ef = by["muon", "2bw+auto", "gap"]
    assert ef.paper == pytest.approx(0.005)
    assert ef.band == pytest.approx((0.0155, 0.0245))
    assert not ef.inside
    assert ef.miss == pytest.approx(0.0155 / 0.005)  # the study's figure 3.1x below the band
    assert ef.ratio == pytest.approx(4.0)

    adamw = by["adamw", "2bw", "gap"]
    assert adamw.predicted == pytest.approx(0.2 * 314.63424**-0.1)
    assert adamw.band == pytest.approx((adamw.predicted, adamw.predicted))  # one sample
    assert adamw.miss == pytest.approx(0.28 / adamw.predicted)


def test_the_study_s_relative_figures_are_its_gaps_over_its_sync_loss():
    relative = {(f.optim, f.setup): f.relative_gap for f in PAPER_FIGURES}
    assert relative["muon", "2bw"] == pytest.approx(0.012 / 2.578)
    assert relative["muon", "2bw+auto"] == pytest.approx(0.005 / 2.578)
    assert relative["adamw", "2bw"] is None


# --- run folders ---------------------------------------------------------------------------

SMALL = {"d_model": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 352}


XEON = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_capability": "AVX512", "cpus": 2, "gpu": None}
EPYC = {"cpu": "AMD EPYC", "cpu_capability": "AVX512", "cpus": 2, "gpu": None}


def make_run(
    root: Path, name: str, final: float, machine: dict = XEON, commit: str = "abc1234", **settings
) -> Path:
    """A finished run folder: the loss falls from 5.0 through ``final + 1`` at half its steps
    to ``final`` at its last (a non-finite ``final``: it diverged); made on ``machine`` by
    nobubble ``commit``."""
    cfg = TrainConfig(**settings)
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(cfg.to_json())
    steps = cfg.steps
    evals = [(0, 5.0), (steps // 2, final + 1.0), (steps, final)]
    lines = [{"step": s, "val_loss": v, "val_bpb": v, "train_time_s": float(s)} for s, v in evals]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = {"final_val_loss": final, "final_val_bpb": final, "machine": machine}
    summary["code"] = {"nobubble": commit, "torch": "2.13.0+cpu"}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_a_pair_across_machines_or_code_versions_is_left_out_unless_allowed(tmp_path):
    """Each gap is one machine's and one code version's; different pairs may differ."""
    root = tmp_path / "runs"
    make_run(root, "sync0", 2.0, schedule="sync", seed=0, steps=40)
    make_run(root, "2bw0", 2.3, schedule="2bw", seed=0, steps=40, machine=EPYC)
    make_run(root, "sync1", 2.0, schedule="sync", seed=1, steps=40, commit="def5678")
    make_run(root, "2bw1", 2.3, schedule="2bw", seed=1, steps=40)
    make_run(root, "sync2", 2.0, schedule="sync", seed=2, steps=40, machine=EPYC)
    make_run(root, "2bw2", 2.3, schedule="2bw", seed=2, steps=40, machine=EPYC)
    make_run(root, "sync3", 2.0, schedule="sync", seed=3, steps=40)
    make_run(root, "2bw3", 2.3, schedule="2bw", seed=3, steps=40)
    runs, _ = discover([root])
    ladder = pair_runs(runs)
    assert sorted(p.delayed.path.name for p in ladder.pairs) == ["2bw2", "2bw3"]
    machine, code = sorted(ladder.excluded)
    assert "2bw0" in machine and "its machine is AMD EPYC" in machine
    assert "2bw1" in code and "its code is nobubble abc1234" in code and "def5678" in code
    line = origins_line(ladder.pairs)
    assert "1 on AMD EPYC" in line and "1 on Intel(R) Xeon(R) Processor" in line
    assert len(pair_runs(runs, allow_mixed=True).pairs) == 4


def test_auto_is_recognised_by_the_choice_it_resolves_to():
    asked = TrainConfig(optim="muon", schedule="2bw", correction="auto", stages=2, chunks=1)
    resolved = auto.resolve(asked)
    assert setup_of(result_settings(resolved.to_dict())) == "2bw+auto"
    other = TrainConfig(**{**resolved.to_dict(), "ef_gamma": resolved.ef_gamma + 0.5})
    assert setup_of(result_settings(other.to_dict())) == f"2bw+{resolved.correction}"
    plain = TrainConfig(optim="muon", schedule="2bw", stages=2, chunks=1)
    assert setup_of(result_settings(plain.to_dict())) == "2bw"
    assert setup_of(result_settings(TrainConfig(schedule="1f1b").to_dict())) == "sync"


def test_a_delayed_run_without_its_partner_is_reported_not_dropped(tmp_path):
    root = tmp_path / "runs"
    for seed in (0, 1):
        make_run(root, f"sync{seed}", 2.0, schedule="sync", seed=seed, steps=40)
        make_run(root, f"2bw{seed}", 2.3, schedule="2bw", seed=seed, steps=40)
    lonely = make_run(root, "2bw2", 2.3, schedule="2bw", seed=2, steps=40)
    other_lr = make_run(root, "2bw_lr", 2.3, schedule="2bw", seed=0, steps=40, lr=1e-2)
    diverged = make_run(root, "2bw_nan", math.nan, schedule="2bw", seed=1, steps=80)
    make_run(root, "sync_80", 2.0, schedule="sync", seed=1, steps=80)
    runs, _ = discover([root])
    ladder = pair_runs(runs)
    assert sorted((p.delayed.path.name, p.sync.path.name) for p in ladder.pairs) == [
        ("2bw0", "sync0"),
        ("2bw1", "sync1"),
    ]
    assert len(ladder.unpaired) == 2
    assert any(str(lonely) in line for line in ladder.unpaired)
    assert any(str(other_lr) in line for line in ladder.unpaired)
    assert len(ladder.excluded) == 1 and str(diverged) in ladder.excluded[0]
    points = ladder_points(ladder.pairs)
    (key, members), *rest = points.items()
    assert not rest and [p.seed for p in members] == [0, 1]
    assert key[:2] == ("adamw", "2bw") and key[3] == 40 * 16 * 256  # steps x batch x seq_len
    assert all(p.gap == pytest.approx(0.3) for p in members)


def test_a_ladder_point_that_mixes_settings_is_refused(tmp_path):
    root = tmp_path / "runs"
    for seed, warmup in ((0, 10), (1, 20)):
        make_run(root, f"sync{seed}", 2.0, schedule="sync", seed=seed, warmup_steps=warmup)
        make_run(root, f"2bw{seed}", 2.3, schedule="2bw", seed=seed, warmup_steps=warmup)
    runs, _ = discover([root])
    with pytest.raises(ReportError, match="warmup_steps"):
        ladder_points(pair_runs(runs).pairs)


def gap_law(params: float, tokens: float) -> float:
    return law_value(0.2, -0.5, -0.3, params, tokens)


RUNGS = [("tiny", {}, 40), ("small", SMALL, 40), ("small", SMALL, 80)]  # two sizes, two lengths


@pytest.fixture
def ladder_dir(tmp_path: Path) -> Path:
    """Three rungs, two seeds each, the gap on ``gap_law``; one delayed run without a partner."""
    root = tmp_path / "runs"
    for name, shape, steps in RUNGS:
        for seed in (0, 1):
            settings = {**shape, "steps": steps, "seed": seed}
            params, tokens = size_and_tokens(result_settings(TrainConfig(**settings).to_dict()))
            sync = 2.0 + 0.01 * seed
            delayed = sync + gap_law(params, tokens)
            make_run(root, f"{name}-{steps}-sync-{seed}", sync, schedule="sync", **settings)
            make_run(root, f"{name}-{steps}-2bw-{seed}", delayed, schedule="2bw", **settings)
    make_run(root, "lonely", 2.5, schedule="2bw", seed=5, steps=40)
    return root


def test_report_scaling_end_to_end(ladder_dir, tmp_path):
    out = tmp_path / "out"
    argv = ["report", "--scaling", str(ladder_dir), "--out", str(out), "--paper-tokens", "7.2e9"]
    assert main(argv) == 0
    laws = {law.quantity: law for law in load_laws(out / "laws.json")}
    assert set(laws) == {"gap", "relative_gap", "excess_steps"}
    gap = laws["gap"]
    assert (gap.optim, gap.setup, gap.points) == ("adamw", "2bw", 6)
    assert (gap.coef, gap.params_exp, gap.tokens_exp) == pytest.approx((0.2, -0.5, -0.3))
    assert gap.params_range == (369_152, 2_902_016)  # the two shapes' blocks
    assert gap.tokens_range == (40 * 16 * 256, 80 * 16 * 256)
    for quantity in laws:
        for axis in ("params", "tokens"):
            assert (out / f"{quantity}_vs_{axis}.png").read_bytes()[:8] == PNG

    text = (out / "scaling.md").read_text()
    # the small model at 40 steps: sync falls by 1 over the second half of training, so it
    # reaches the delayed final loss (gap g below its midpoint loss) at S (1 - g / 2)
    g = gap_law(369_152, 40 * 16 * 256)
    steps = text.split("## The penalty in steps")[1]
    row = next(line for line in steps.splitlines() if line.startswith("| adamw | 2bw | 0.369 M"))
    assert f"| {1 / (1 - g / 2) - 1:+.3f} ± 0.000 |" in row
    assert f"| {40 * (1 - g / 2):.0f} ± 0 |" in row
    unpaired = text.split("## Unpaired")[1]
    assert str(ladder_dir / "lonely") in unpaired
    check = text.split("## The study's table as a check")[1].split("## Plots")[0]
    predicted = gap_law(314_634_240, 7.2e9)
    row = next(line for line in check.splitlines() if line.startswith("| adamw | 2bw | gap |"))
    assert f"| {predicted:.3g} |" in row and "| no |" in row  # an exact law: a band of width 0


def test_report_scaling_without_the_study_s_tokens_runs_no_check(ladder_dir, tmp_path):
    out = tmp_path / "out"
    assert main(["report", "--scaling", str(ladder_dir), "--out", str(out)]) == 0
    check = (out / "scaling.md").read_text().split("## The study's table as a check")[1]
    assert "| adamw | 2bw | gap |" not in check.split("## Plots")[0]


@pytest.mark.parametrize(
    "extra",
    [["--paper-tokens", "7e9"], ["--scaling", "--vs", "lr"]],  # a bad count: tests/test_sizes.py
)
def test_report_refuses_options_that_do_not_go_together(ladder_dir, tmp_path, extra):
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    args = parser.parse_args([str(ladder_dir), "--out", str(tmp_path / "out"), *extra])
    with pytest.raises(ReportError):
        report.run(args)
