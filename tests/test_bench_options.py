"""``nobubble bench --options``: compile and activation checkpointing beside the plain runs."""

from __future__ import annotations

import argparse
import json

import pytest

from nobubble import cli
from nobubble.bench import add_arguments
from nobubble.bench.cli import common_settings, resolve, selected_variants
from nobubble.bench.measure import RunResult, StageResult
from nobubble.bench.report import option_summary, options_markdown
from nobubble.bench.variants import option_sets, with_options
from nobubble.config import ConfigError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve(parser.parse_args(argv))


def fake_run(tokens_per_s: float, peak_mb: tuple[float, float], loss: float = 3.0) -> RunResult:
    stages = [StageResult(0.1, 9.0, mb, 6.0, 1) for mb in peak_mb]
    return RunResult(tokens_per_s, tokens_per_s, loss, stages, [0.2, 0.2], None)


def test_option_sets_expand_our_variants_only():
    assert option_sets("compile, ac ,compile+activation_checkpointing") == [
        ("compile",),
        ("ac",),
        ("compile", "ac"),
    ]
    assert option_sets("compile,") == [("compile",)]
    variants = with_options(selected_variants("2bw+ef,torch-1f1b"), option_sets("ac,compile"))
    assert [v.name for v in variants] == ["2bw+ef", "2bw+ef+ac", "2bw+ef+compile", "torch-1f1b"]
    with_ac = variants[1]
    assert with_ac.plain == "2bw+ef"
    assert with_ac.extra == ("correction=ef", "activation_checkpointing=true")


@pytest.mark.parametrize("spec", ["fast", "ac+ac", "", ","])
def test_unknown_or_empty_options_are_refused(spec):
    with pytest.raises(ConfigError, match="--options"):
        option_sets(spec)


def test_options_need_one_of_our_variants_and_own_their_settings():
    with pytest.raises(ConfigError, match="nobubble's variants"):
        with_options(selected_variants("torch-1f1b"), [("ac",)])
    with pytest.raises(ConfigError, match="compile"):
        common_settings(parse("--options", "compile", "compile=true"))
    assert "compile=true" in common_settings(parse("compile=true"))  # without --options: as is


def test_options_are_reported_as_ratios_to_the_plain_variant():
    results = {
        "2bw": [fake_run(100, (500, 400)), fake_run(80, (510, 400))],
        "2bw+ac": [fake_run(75, (450, 380)), fake_run(64, (460, 380))],
    }
    memory = {"2bw": [fake_run(90, (300, 200))], "2bw+ac": [fake_run(70, (240, 190))]}
    row = option_summary("2bw+ac", "2bw", results, memory)
    assert row.speed_ratio == pytest.approx((0.75 + 0.8) / 2)  # paired by repeat
    assert row.memory_ratio == pytest.approx([0.8, 0.95])  # the memory pass's peaks
    assert option_summary("2bw+ac", "2bw", results, None).memory_ratio == pytest.approx(
        [455 / 505, 0.95]
    )
    table = options_markdown([row], memory_pass=True)
    assert "| 2bw+ac | 70 | 0.775 | 240 / 190 | 0.800 / 0.950 |" in table


@pytest.mark.slow
@pytest.mark.extended  # the launch path is test_bench's; the settings are tested above
def test_quick_bench_measures_activation_checkpointing_beside_the_plain_run(tmp_path, capsys):
    """Through the console entry point; activation checkpointing changes no bit of the run."""
    out, runs = tmp_path / "bench.json", tmp_path / "runs"
    argv = ["bench", "--quick", "--schedules", "2bw", "--options", "ac", "--json", str(out),
            "--runs-dir", str(runs), "p2p_timeout_s=60"]  # fmt: skip
    assert cli.main(argv) == 0
    assert "| 2bw+ac |" in capsys.readouterr().out
    report = json.loads(out.read_text())
    (row,) = report["options"]
    assert (row["name"], row["plain"]) == ("2bw+ac", "2bw")
    assert row["speed_ratio"] > 0 and all(r > 0 for r in row["memory_ratio"])
    assert row["final_loss"] == row["plain_final_loss"]
    config = json.loads((runs / "0-2bw-ac" / "config.json").read_text())
    assert config["activation_checkpointing"] is True
