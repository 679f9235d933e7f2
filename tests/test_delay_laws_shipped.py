"""The laws ``nobubble plan --optim`` reads by default: shipped with the package, complete for the
optimizers the ladder measured, and (slow) the fit of the committed run records, so that the
planner's answers can be reproduced from docs/results/scaling/runs.tar.xz."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from nobubble.delay_law import load_laws
from nobubble.planning.target import CORRECTIONS, QUANTITY, SHIPPED_LAWS, read_laws

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs/results/scaling/runs.tar.xz"


def test_the_laws_are_package_data_and_the_planner_s_default():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["nobubble"]
    assert SHIPPED_LAWS.name in package_data
    assert SHIPPED_LAWS.is_file()
    assert read_laws(None) == load_laws(SHIPPED_LAWS)


def test_every_measured_optimizer_has_each_delayed_setup_s_penalty():
    laws = load_laws(SHIPPED_LAWS)
    for optim in ("adamw", "muon"):
        setups = {law.setup for law in laws if law.quantity == QUANTITY and law.optim == optim}
        assert setups == {"2bw" + c for c in CORRECTIONS}, optim
    for law in laws:  # fitted, with a bootstrap band, over a measured range
        assert law.points >= 4 and len(law.samples) > 100
        assert law.tokens_range[0] < law.tokens_range[1]


@pytest.mark.slow
def test_the_shipped_laws_are_the_fit_of_the_committed_records(tmp_path):
    runs, docs, laws = tmp_path / "runs", tmp_path / "docs", tmp_path / "laws.json"
    subprocess.run([ROOT / "experiments/run_records.sh", "unpack", RECORDS, runs], check=True)
    nobubble = Path(sys.executable).with_name("nobubble")
    env = {**os.environ, "NOBUBBLE": str(nobubble)}
    script = ROOT / "experiments/scaling_fit.sh"
    subprocess.run([script, runs, docs, laws], check=True, env=env, capture_output=True)
    fitted, shipped = (json.loads(p.read_text()) for p in (laws, SHIPPED_LAWS))
    # the same laws; floats to 1e-9 (a least-squares solve may differ in its last bits by CPU)
    assert [_fields(law) for law in fitted] == [_fields(law) for law in shipped]
    assert _numbers(fitted) == pytest.approx(_numbers(shipped), rel=1e-9)


def _fields(law: dict) -> tuple:
    return law["quantity"], law["optim"], law["setup"], law["points"], law["not_measured"]


def _numbers(value) -> list[float]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    return [value] if isinstance(value, int | float) and not isinstance(value, bool) else []
