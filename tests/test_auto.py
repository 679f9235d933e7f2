"""``correction=auto``: the best measured correction per optimizer and schedule, from one table
that names the run set of each choice; resolved when the configuration is built, so config.json,
a resumed run and the report see the real settings."""

import json
import re
import tomllib
from pathlib import Path

import pytest

from nobubble.cli import main
from nobubble.config import ConfigError
from nobubble.configure import asks_for_auto, build_config
from nobubble.corrections.auto import CHOICES, choose
from nobubble.corrections.registry import REGISTRY, chosen
from tests.helpers.pipeline import SMALL

ROOT = Path(__file__).resolve().parent.parent
PHASES = {
    phase["name"]
    for phase in tomllib.loads((ROOT / "experiments" / "corrections.toml").read_text())["phase"]
}


def _shape(schedule: str) -> dict:
    return {"stages": 4, "microbatches": 1} if schedule == "pipedream" else {}


@pytest.mark.parametrize(("optim", "schedule"), sorted(CHOICES))
def test_each_choice_is_a_real_correction_with_its_strength_and_its_runs(optim, schedule):
    measured = CHOICES[optim, schedule]
    cfg = build_config(
        {"optim": optim, "schedule": schedule, "correction": "auto"} | _shape(schedule)
    )
    names = chosen(cfg)
    assert "+".join(names) == measured.correction  # resolved, refused by nothing
    assert set(measured.settings) == {k for n in names for k in REGISTRY[n].settings}
    assert all(getattr(cfg, k) == v for k, v in measured.settings.items())
    phases = re.findall(r"(?:phases?|,|and) ([a-z_]+)", measured.runs.split("docs/")[0])
    assert phases and set(phases) <= PHASES, measured.runs  # phases of corrections.toml
    assert "docs/results.md" in measured.runs  # where the measurements are written up
    assert re.search(r"\d+%", measured.closes)


def test_auto_prints_its_choice_and_config_json_records_it(tmp_path, capsys):
    out = tmp_path / "run"
    settings = ["--out", str(out), *SMALL, "optim=muon", "schedule=2bw", "steps=3"]
    assert main(["train", "--no-progress", *settings, "correction=auto"]) == 0
    printed = capsys.readouterr().out
    said = [line for line in printed.splitlines() if "correction=auto" in line]
    assert len(said) == 1 and all(f in said[0] for f in ("muon", "2bw", "ef", "ef_gamma=1.5"))
    assert CHOICES["muon", "2bw"].runs in printed  # the runs that made the choice, named
    saved = json.loads((out / "config.json").read_text())
    assert (saved["correction"], saved["ef_gamma"]) == ("ef", 1.5)
    assert "ef" not in saved  # correction is error feedback's one key

    # a resumed run compares the resolved settings: auto again is the same run ...
    assert main(["train", "--no-progress", "--resume", str(out), "steps=4", "correction=auto"]) == 0
    assert "correction=auto for muon under 2bw" in capsys.readouterr().out
    assert main(["train", "--no-progress", "--resume", str(out), "steps=5"]) == 0
    assert "correction=auto" not in capsys.readouterr().out  # nothing asked for it now
    # ... and another strength is another run
    assert main(["train", "--no-progress", "--resume", str(out), "steps=6", "ef_gamma=1.0"]) == 2
    assert "cannot continue" in capsys.readouterr().err
    assert main(["report", str(out), "--out", str(tmp_path / "report")]) == 0
    assert "| muon | 2bw+EF |" in capsys.readouterr().out  # the report shows the real correction


def test_an_optimizer_never_measured_falls_back_to_ef_and_says_so():
    cfg = build_config({"optim": "sgd", "schedule": "2bw", "correction": "auto"})
    assert (cfg.correction, cfg.ef_gamma) == ("ef", 1.0)
    assert "nothing was measured for it" in choose(cfg).why
    assert "falling back to ef (ef_gamma=1.0)" in choose(cfg).why


@pytest.mark.parametrize("settings", [{"schedule": "sync"}, {"schedule": "pipedream"}])
def test_without_a_delay_auto_corrects_nothing(settings):
    cfg = build_config({"optim": "adamw", "correction": "auto", "microbatches": 1} | settings)
    assert cfg.correction == "none"
    assert "no stage has a gradient delay" in choose(cfg).why  # the reason: no delay


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"correction": "auto+predict"}, "combines with nothing; got auto\\+predict"),
        ({"correction": "auto", "ef": True}, "combines with nothing; got ef\\+auto"),
        ({"correction": "auto", "ef_gamma": 1.5}, "chooses ef_gamma=2.0 .* ef_gamma=1.5 was given"),
    ],
)
def test_auto_refuses_what_would_change_its_choice(settings, message):
    with pytest.raises(ConfigError, match=message):
        build_config({"optim": "adamw", "schedule": "2bw"} | settings)
    given_as_chosen = build_config({"schedule": "2bw", "correction": "auto", "ef_gamma": 2.0})
    assert given_as_chosen.ef_gamma == 2.0


def test_only_the_last_layer_that_sets_the_correction_asks_for_auto():
    assert asks_for_auto([{"correction": "auto"}, {"lr": 1e-3}])
    assert not asks_for_auto([{"correction": "auto"}, {"correction": "ef"}])
    assert not asks_for_auto([{"lr": 1e-3}])
