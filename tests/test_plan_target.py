"""nobubble plan --optim: time to the synchronous final loss on a hand-computed plan and a
hand-made laws file, the verdict, the extrapolation label, and a missing or damaged file."""

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from nobubble import delay_law
from nobubble.cli import main
from nobubble.config import ConfigError
from nobubble.config.parallel import ParallelSettings
from nobubble.delay_law import Law, save_laws
from nobubble.model.presets import ModelConfig
from nobubble.planning import cli as plan_cli
from nobubble.planning import target as target_module
from nobubble.planning.costs import non_embedding_parameters
from nobubble.planning.estimate import ClusterPlan, Estimate
from nobubble.planning.hardware import DEVICES, LINKS
from nobubble.planning.shapes import PLANNING_SHAPES
from nobubble.planning.target import time_to_target
from nobubble.schedules.registry import PIPELINE_SCHEDULES

# a block: q, o (2·64·64) + k, v (2·64·32) + gate, up, down (3·64·128) + 2 norms = 36,992
SHAPE = ModelConfig(d_model=64, n_layers=8, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64,
                    vocab_size=100)  # fmt: skip
PARAMS = 8 * 36_992  # 295,936
TOKENS = 20 * PARAMS  # the default budget: 5,918,720 tokens
STEPS = 11_560  # of 8 microbatches x 2 sequences x 32 tokens = 512 tokens


def plan() -> ClusterPlan:
    return ClusterPlan(
        model=SHAPE, parallel=ParallelSettings(stages=4, microbatches=8), microbatch_size=2,
        seq_len=32, device=DEVICES["h100"], mfu=0.5, p2p=LINKS["ib-ndr"],
        allreduce=LINKS["ib-ndr"],
    )  # fmt: skip


def law(setup: str, scale: float = 1.0, params_range=(1e5, 1e6), tokens_range=(1e6, 1e7)) -> Law:
    """excess_steps = coef · params / tokens: with 20 tokens per parameter, coef / 20. Bootstrap
    coefs scale·(1, 2, 3): at the default budget 0.05, 0.1, 0.15 times scale, whose 90% interval
    (linear between order statistics, at positions 0.1 and 1.9) is scale·(0.055, 0.145)."""
    samples = tuple((scale * c, 1.0, -1.0) for c in (3.0, 1.0, 2.0))
    return Law("excess_steps", "muon", setup, 2.0 * scale, 1.0, -1.0, samples, params_range,
               tokens_range, points=12)  # fmt: skip


def estimates() -> list[Estimate]:
    """Step times by hand: 2bw 1.0 s, zb-h2 1.1 s, 1f1b 1.2 s, pipedream 1.0 s."""
    return [
        Estimate("2bw", 1.0, 0.0, 0.0, 0.0, [10.0]),
        Estimate("pipedream", 1.0, 0.0, 0.0, 0.0, [10.0]),
        Estimate("zb-h2", 1.1, 0.0, 0.0, 0.0, [20.0]),
        Estimate("1f1b", 1.2, 0.0, 0.0, 0.0, [10.0]),
    ]


def test_non_embedding_parameters_are_the_blocks():
    assert non_embedding_parameters(SHAPE) == PARAMS
    # SmolLM2-360M: 32 x (2·960·64·(15+5) + 3·960·2560 + 2·960)
    assert non_embedding_parameters(PLANNING_SHAPES["smollm2-360m"]) == 314_634_240


def test_time_to_target_by_hand():
    laws = [law("2bw", scale=2.0), law("2bw+auto")]
    t = time_to_target(plan(), estimates(), laws, "muon", TOKENS, limit_gb=80.0)
    assert (t.params, t.steps) == (PARAMS, STEPS)
    rows = {r.setup: r for r in t.rows}
    assert set(rows) == {"2bw", "2bw+auto", "zb-h2", "1f1b"}
    assert rows["1f1b"].steps == (STEPS,) * 3
    assert rows["1f1b"].time_s == pytest.approx((1.2 * STEPS,) * 3)
    assert rows["2bw+auto"].steps == pytest.approx((STEPS * 1.055, STEPS * 1.1, STEPS * 1.145))
    assert rows["2bw+auto"].time_s == pytest.approx((STEPS * 1.055, STEPS * 1.1, STEPS * 1.145))
    assert rows["2bw"].steps == pytest.approx((STEPS * 1.11, STEPS * 1.2, STEPS * 1.29))
    centrals = [r.time_s[1] for r in t.rows]  # zb-h2 and 2bw+auto tie at 1.1 s x STEPS
    assert centrals == sorted(centrals) and [r.setup for r in t.rows][2:] == ["2bw", "1f1b"]
    assert t.best_sync.setup == "zb-h2"
    # pipedream's delay is P-1-s steps: no law fitted on a one-step delay applies
    assert (
        list(t.uncovered) == ["pipedream"] and "0 to 3 steps by stage" in t.uncovered["pipedream"]
    )
    assert t.missing == []
    # the best synchronous schedule is the fastest that fits
    assert time_to_target(plan(), estimates(), laws, "muon", TOKENS, 15.0).best_sync.setup == "1f1b"


@pytest.mark.parametrize(
    ("scale", "answer", "speedup"),
    [
        (0.5, "sooner", (1.1 / 1.0725, 1.1 / 1.05, 1.1 / 1.0275)),
        (1.0, "undecided", (1.1 / 1.145, 1.0, 1.1 / 1.055)),  # 1.055-1.145 straddles zb-h2's 1.1
        (2.0, "later", (1.1 / 1.29, 1.1 / 1.2, 1.1 / 1.11)),
    ],
)
def test_the_verdict_against_the_best_synchronous_schedule(scale, answer, speedup):
    t = time_to_target(plan(), estimates(), [law("2bw+auto", scale)], "muon", TOKENS, 80.0)
    (verdict,) = t.verdicts()
    assert (verdict.setup, verdict.against, verdict.answer) == ("2bw+auto", "zb-h2", answer)
    assert verdict.speedup == pytest.approx(speedup)
    assert t.missing == ["2bw"]


def test_the_extrapolation_is_how_far_beyond_the_measured_range():
    inside = law("2bw+auto")
    outside = law("2bw+auto", params_range=(1e4, 1e5), tokens_range=(1e6, 2e6))
    for each, expected in ((inside, (1.0, 1.0)), (outside, (PARAMS / 1e5, TOKENS / 2e6))):
        t = time_to_target(plan(), estimates(), [each], "muon", TOKENS, 80.0)
        row = next(r for r in t.rows if r.law)
        assert t.outside(row) == pytest.approx(expected)


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    return plan_cli.run(parser.parse_args(list(argv)))


PLAN = ("--preset", "tiny", "--seq-len", "256", "--stages", "2", "--microbatches", "4")


def write_laws(tmp_path: Path, laws: list[Law]) -> str:
    path = tmp_path / "laws.json"
    save_laws(laws, path)
    return str(path)


def test_the_command_prints_the_time_to_target_and_its_json(tmp_path, capsys):
    # tiny: 2.9 M non-embedding parameters, 58 M tokens by default
    measured = {"params_range": (1e6, 1e7), "tokens_range": (1e6, 1e8)}
    laws = write_laws(
        tmp_path, [law("2bw+auto", params_range=(1e4, 1e5), tokens_range=(1e6, 1e8)),
                   law("2bw", **measured)]
    )  # fmt: skip
    assert cli(*PLAN, "--optim", "muon", "--laws", laws) == 0
    out = capsys.readouterr().out
    assert "| 1f1b |" in out and "best under 80 GB per GPU" in out  # the throughput plan
    params = non_embedding_parameters(PLANNING_SHAPES["tiny"])
    lines = out.splitlines()
    auto = next(line for line in lines if line.startswith("2bw+auto: law of 12 runs"))
    assert f"extrapolated: {params / 1e5:.3g}x beyond the measured size" in auto
    assert "tokens" not in auto.split("extrapolated:")[1]  # inside the measured tokens
    plain = next(line for line in lines if line.startswith("2bw: law of 12 runs"))
    assert "extrapolated" not in plain and plain.endswith("inside it")
    assert any(line.startswith("pipedream: no time to target") for line in lines)
    assert cli(*PLAN, "--optim", "muon", "--laws", laws, "--tokens", "1e9", "--json") == 0
    data = json.loads(capsys.readouterr().out)["time_to_target"]
    steps = -(-1e9 // (4 * 256))  # 4 microbatches of one 256-token sequence
    assert (data["non_embedding_params"], data["tokens"], data["sync_steps"]) == (
        params, 1e9, steps,
    )  # fmt: skip
    rows = {r["setup"]: r for r in data["rows"]}
    e = 2.0 * params / 1e9  # the central coef, 2, times params / tokens
    assert rows["2bw+auto"]["steps"][1] == pytest.approx(steps * (1 + e))
    assert rows["2bw+auto"]["time_s"][1] == pytest.approx(
        steps * (1 + e) * rows["2bw+auto"]["step_s"]
    )
    assert rows["1f1b"]["steps"] == [steps] * 3 and not rows["1f1b"]["fitted"]
    assert rows["2bw+auto"]["outside_measured"] == pytest.approx(
        {"params": params / 1e5, "tokens": 1e9 / 1e8}
    )
    assert {v["setup"] for v in data["verdicts"]} == {"2bw", "2bw+auto"}
    assert data["best_sync"] in rows and "pipedream" in data["uncovered"]


def test_without_a_fitted_law_the_plan_says_so_and_still_prints(tmp_path, capsys, monkeypatch):
    shipped = Path(delay_law.__file__).parent / "delay_laws.json"
    assert shipped == target_module.SHIPPED_LAWS
    monkeypatch.setattr(target_module, "SHIPPED_LAWS", tmp_path / "absent.json")
    assert cli(*PLAN, "--optim", "adamw") == 0
    out = capsys.readouterr().out
    assert "| 2bw |" in out and "best under 80 GB per GPU" in out
    (line,) = [line for line in out.splitlines() if "no fitted law" in line]
    assert "adamw" in line and "nobubble report --scaling" in line
    laws = write_laws(tmp_path, [law("2bw")])  # muon's only
    assert cli(*PLAN, "--optim", "adamw", "--laws", laws, "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["time_to_target"]) == {"optim", "note"}
    assert len(data["predictions"]) == len(PIPELINE_SCHEDULES)  # each runs P = 2, M = 4


@pytest.mark.parametrize("text", ["{", '[{"quantity": "gap"}]', '{"a": 1}', "[1]"])
def test_a_damaged_laws_file_is_one_line_and_exit_2(tmp_path, capsys, text):
    path = tmp_path / "laws.json"
    path.write_text(text)
    assert main(["plan", *PLAN, "--optim", "muon", "--laws", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--laws {path}: not a laws file" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--optim", "muon", "--laws", "/no/such/laws.json"), "no such file"),
        (("--tokens", "1e9"), "--tokens goes with --optim"),
        (("--laws", "x.json"), "--laws goes with --optim"),
        (("--optim", "muon", "--grid", "2,4"), "--optim times one plan, not a --grid"),
    ],
)
def test_bad_time_to_target_flags_are_explained(argv, message):
    with pytest.raises(ConfigError, match=message):
        cli(*PLAN, *argv)


def test_a_token_budget_that_is_not_positive_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:  # refused while the command line is read
        main(["plan", *PLAN, "--optim", "muon", "--tokens", "0"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tokens" in err


def test_when_no_synchronous_schedule_fits_the_fastest_is_compared_and_marked():
    t = time_to_target(plan(), estimates(), [law("2bw+auto")], "muon", TOKENS, limit_gb=0.5)
    assert t.best_sync.setup == "zb-h2" and not t.best_sync.fits
    assert [v.fits for v in t.verdicts()] == [False]


def test_an_axis_the_law_did_not_fit_is_labelled_an_assumption(tmp_path, capsys):
    """A law fitted on one size (the length ladder alone) has no size exponent: a plan at
    another size says the penalty there is assumed, in the extrapolation line, the verdict and
    the JSON; a plan at the measured size does not."""
    params = non_embedding_parameters(PLANNING_SHAPES["tiny"])
    one_size = Law("excess_steps", "muon", "2bw+auto", 0.01, 0.0, 0.0, ((0.01, 0.0, 0.0),),
                   (1e5, 1e5), (1e6, 1e9), points=8, not_measured=("params",))  # fmt: skip
    at_size = dataclasses.replace(one_size, params_range=(params, params))
    for each, beyond in ((one_size, True), (at_size, False)):
        assert cli(*PLAN, "--optim", "muon", "--laws", write_laws(tmp_path, [each])) == 0
        lines = capsys.readouterr().out.splitlines()
        law_line = next(line for line in lines if line.startswith("2bw+auto: law of 8 runs"))
        verdict = next(line for line in lines if line.startswith("2bw+auto reaches"))
        assert ("no exponent fitted" in law_line) is beyond
        assert ("assumed, not measured: the penalty at another size" in verdict) is beyond
        assert "another tokens" not in verdict  # the tokens axis was fitted
    assert cli(*PLAN, "--optim", "muon", "--laws", write_laws(tmp_path, [one_size]), "--json") == 0
    rows = json.loads(capsys.readouterr().out)["time_to_target"]["rows"]
    assert next(r for r in rows if r["setup"] == "2bw+auto")["not_measured"] == ["params"]
