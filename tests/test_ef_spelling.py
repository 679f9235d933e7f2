"""``correction`` is error feedback's one key; the old ``ef=true`` of earlier versions is read as
``correction=ef`` where settings enter (nobubble.config.correction.fold_ef): with a warning
naming the new spelling when a user gives it, silently from a saved run folder."""

from __future__ import annotations

import ast
import json
import shutil
import warnings
from pathlib import Path

import pytest

from nobubble.config import (
    FIELDS,
    ConfigError,
    OldSpellingWarning,
    from_saved,
    load_toml,
    parse_overrides,
)
from nobubble.configure import build_config
from nobubble.reporting import cli as report
from nobubble.runfolder.reading import saved_config
from nobubble.sweeping.grid import load_sweep
from tests.helpers.commands import call
from tests.helpers.runs import make_run, train

SRC = Path(__file__).parents[1] / "src" / "nobubble"
V2_RUN = Path(__file__).parent / "data" / "v2_run"  # written with ef=true, correction=none


def test_ef_is_no_setting_and_nothing_reads_an_ef_attribute():
    assert "ef" not in FIELDS and "ef_gamma" in FIELDS  # the strength stays correction=ef's
    found = [
        f"{path.relative_to(SRC)}:{node.lineno}"
        for path in sorted(SRC.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.Attribute) and node.attr == "ef")
        or (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr")
            and any(isinstance(a, ast.Constant) and a.value == "ef" for a in node.args[1:2])
        )
    ]
    assert found == []  # x.ef, getattr(x, "ef"): correction=ef is read through `correction`


def old_spelling_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, OldSpellingWarning)]


@pytest.mark.parametrize(
    ("layer", "correction"),
    [
        ({"ef": True}, "ef"),
        ({"ef": "true"}, "ef"),
        ({"ef": True, "correction": "predict"}, "ef+predict"),
        ({"ef": True, "correction": "ef"}, "ef"),
        ({"ef": False}, "none"),
        ({"ef": False, "correction": "nesterov"}, "nesterov"),
    ],
)
def test_a_layer_s_old_ef_is_read_as_correction_with_a_warning_naming_it(layer, correction):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = build_config({"schedule": "2bw", "microbatches": 2, **layer})
    assert cfg.correction == correction
    (said,) = old_spelling_warnings(caught)
    fix = f"correction={correction}" if layer["ef"] in (True, "true") else "correction=ef"
    assert f"ef={str(layer['ef']).lower()}" in said and fix in said


def test_key_value_words_a_toml_file_and_a_sweep_table_read_the_old_ef(tmp_path):
    with pytest.warns(OldSpellingWarning, match="correction=ef\\+predict"):
        assert parse_overrides(["correction=predict", "ef=true"]) == {"correction": "ef+predict"}
    toml = tmp_path / "c.toml"
    toml.write_text('[correction]\nef = true\nef_gamma = 1.5\n[parallel]\nschedule = "2bw"\n')
    with pytest.warns(OldSpellingWarning, match="correction=ef"):
        assert load_toml(toml) == {"correction": "ef", "ef_gamma": 1.5, "schedule": "2bw"}
    sweep = tmp_path / "s.toml"
    sweep.write_text('[grid]\nsetup = { "2bw+ef" = { schedule = "2bw", ef = true } }\n')
    with pytest.warns(OldSpellingWarning, match="correction=ef"):
        (point,) = load_sweep(sweep).phases[0].points()
    assert point.settings == {"schedule": "2bw", "correction": "ef"}


def test_a_bad_old_ef_value_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="ef must be true or false, got 'maybe'"):
        parse_overrides(["ef=maybe"])


def test_a_saved_config_with_the_old_ef_reads_silently_as_correction_ef():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = saved_config(V2_RUN)
        assert from_saved({"ef": True, "correction": "predict"})["correction"] == "ef+predict"
        assert from_saved({"ef": False})["correction"] == "none"
    assert old_spelling_warnings(caught) == []
    assert json.loads((V2_RUN / "config.json").read_text())["ef"] is True
    assert saved["correction"] == "ef" and "ef" not in saved


def test_the_report_reads_an_old_run_folder_and_where_ef_still_filters(tmp_path, capsys):
    runs = tmp_path / "runs"
    shutil.copytree(V2_RUN, runs / "v2")  # 2bw, ef=true in its config.json
    make_run(runs, 2.0, schedule="2bw", correction="predict")
    make_run(runs, 2.1, schedule="2bw", correction="ef+predict")
    setups = {}
    for where in ("ef=true", "ef=false"):
        out = tmp_path / where
        assert call(report, str(runs), "--where", where, "--out", str(out)) == 0
        quality = (out / "report.md").read_text().split("## Final validation loss")[1]
        table = quality.split("\n## ")[0].strip().split("\n\n")[0].splitlines()[2:]
        setups[where] = {line.split("|")[2].strip() for line in table}
    assert setups == {"ef=true": {"2bw+EF", "2bw+EF+predict"}, "ef=false": {"2bw+predict"}}
    capsys.readouterr()


def test_the_old_ef_flag_is_read_as_correction_ef(tmp_path):
    with pytest.warns(OldSpellingWarning, match="correction=ef"):
        assert train(tmp_path / "run", "--ef", "steps=1", "eval_every=0") == 0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["correction"] == "ef" and "ef" not in saved
