"""A share set against runs of another machine or code version is left out or marked by
``nobubble report``; one whose runs all come from one machine and one code is shown as before."""

import json
from pathlib import Path

import pytest

from nobubble.reporting import cli as report
from nobubble.reporting.groups import against_references, compare, controls, group_runs
from nobubble.reporting.runs import NOT_RECORDED, discover
from nobubble.reporting.table import controls_table, quality_table, references_table
from tests.helpers.commands import call
from tests.helpers.runs import make_run

EPYC = {"cpu": "AMD EPYC", "cpus": 2, "cpu_capability": "AVX2", "gpu": None}
XEON = {"cpu": "Intel(R) Xeon(R) Processor", "cpus": 2, "cpu_capability": "AVX512", "gpu": None}
OLD, NEW = {"nobubble": "1111111", "torch": "2.13.0"}, {"nobubble": "2222222", "torch": "2.13.0"}


def made_on(run: Path, where: dict | None, code: dict | None = OLD) -> Path:
    """Record in ``run``'s summary.json the machine and code that made it (None: not recorded,
    as in the summary of an older version)."""
    summary = json.loads((run / "summary.json").read_text())
    recorded = {"machine": where, "code": code}
    summary |= {key: value for key, value in recorded.items() if value is not None}
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def study(root: Path, ef_machine: dict | None, ef_code: dict | None = OLD) -> Path:
    """sync 2.0 and 2bw 2.4 on the EPYC at OLD; 2bw+EF 2.1 (75% of the gap closed), made on
    ``ef_machine`` by ``ef_code``."""
    made_on(make_run(root, 2.0, schedule="sync"), EPYC)
    made_on(make_run(root, 2.4, schedule="2bw"), EPYC)
    made_on(make_run(root, 2.1, schedule="2bw", correction="ef"), ef_machine, ef_code)
    return root


def ef_row(root: Path):
    runs, _ = discover([root])
    return next(r for r in compare(group_runs(runs)) if r.group.corrections)


def ef_cell(table: str) -> str:
    """The *gap closed* cell of the 2bw+EF row of a quality table."""
    row = next(line for line in table.splitlines() if "| 2bw+EF |" in line)
    return row.split("|")[-2].strip()


def test_a_share_on_one_machine_and_code_is_shown_unmarked(tmp_path):
    row = ef_row(study(tmp_path, EPYC))
    assert row.closed == pytest.approx(0.75) and row.closed_origins is None
    table = quality_table([row])
    assert ef_cell(table) == "75%" and "†" not in table


def test_a_share_against_another_machine_s_references_is_left_out(tmp_path):
    row = ef_row(study(tmp_path, XEON))
    origins = row.closed_origins
    assert origins is not None and origins.machines_differ and not origins.code_differs
    assert len(origins.machines) == len(origins.reference_machines) == 1
    assert origins.machines != origins.reference_machines
    cell = ef_cell(quality_table([row]))
    assert "75%" not in cell and "†1" in cell
    note = quality_table([row]).split("\n\n", 1)[1]
    assert "AMD EPYC" in note and "Intel(R) Xeon(R) Processor" in note
    assert "--allow-mixed-references" in note


def test_allowing_mixed_references_shows_the_share_marked(tmp_path):
    row = ef_row(study(tmp_path, XEON))
    cell = ef_cell(quality_table([row], allow_mixed=True))
    assert cell.startswith("75%") and "†1" in cell


def test_a_share_by_another_code_version_is_shown_and_marked(tmp_path):
    row = ef_row(study(tmp_path, EPYC, NEW))
    origins = row.closed_origins
    assert origins is not None and origins.code_differs and not origins.machines_differ
    table = quality_table([row])
    assert ef_cell(table).startswith("75%") and "†1" in ef_cell(table)
    assert "2222222" in table and "1111111" in table


def test_a_machine_recorded_beside_one_not_recorded_counts_as_another(tmp_path):
    """An older run records no machine: a share that sets it beside a run that records one may
    pool two machines; one whose runs all record none cannot tell, and is shown."""
    mixed = ef_row(study(tmp_path / "mixed", None))
    assert mixed.closed_origins is not None and mixed.closed_origins.machines_differ
    assert NOT_RECORDED in mixed.closed_origins.machines
    assert "75%" not in ef_cell(quality_table([mixed]))
    old = tmp_path / "old"
    for final, settings in ((2.0, {}), (2.4, {}), (2.1, {"correction": "ef"})):
        make_run(old, final, schedule="sync" if final == 2.0 else "2bw", **settings)
    assert ef_cell(quality_table([ef_row(old)])) == "75%"


def test_each_run_of_the_group_and_of_its_references_counts(tmp_path):
    """A second seed of sync made on another machine mixes the share as much as the group's."""
    study(tmp_path, EPYC)
    made_on(make_run(tmp_path, 2.0, schedule="sync", seed=1), XEON)
    made_on(make_run(tmp_path, 2.4, schedule="2bw", seed=1), EPYC)
    made_on(make_run(tmp_path, 2.1, schedule="2bw", correction="ef", seed=1), EPYC)
    origins = ef_row(tmp_path).closed_origins
    assert origins is not None and origins.machines == ("AMD EPYC (2 CPUs AVX2)",)
    assert len(origins.reference_machines) == 2


def test_controls_and_references_tables_check_their_runs_too(tmp_path):
    """The control (sync+EF) and the references at beta1 0.9 come from the Xeon, the groups
    from the EPYC: both shares are left out, and shown with the flag."""
    made_on(make_run(tmp_path, 2.0, schedule="sync"), XEON)
    made_on(make_run(tmp_path, 2.4, schedule="2bw"), XEON)
    made_on(make_run(tmp_path, 2.05, schedule="sync", correction="ef"), XEON)
    made_on(make_run(tmp_path, 2.15, schedule="2bw", correction="ef"), EPYC)
    made_on(make_run(tmp_path, 1.9, schedule="sync", beta1=0.8), EPYC)
    made_on(make_run(tmp_path, 2.1, schedule="2bw", correction="ef", beta1=0.8), EPYC)
    runs, _ = discover([tmp_path])
    rows = compare(group_runs(runs))
    found = controls(rows)
    referenced = against_references(rows, {"beta1": 0.9})
    assert found and all(c.removed_origins.machines_differ for c in found)
    assert referenced and all(r.closed_origins.machines_differ for r in referenced)
    for table in (controls_table(found), references_table(referenced)):
        rows = table.split("\n\n")[0].splitlines()[2:]
        shares = [row.split("|")[-2].strip() for row in rows]
        assert shares and all(cell.startswith("— (other machine") for cell in shares)
    for table in (controls_table(found, True), references_table(referenced, True)):
        assert "75% †1" in table


def test_the_report_leaves_a_mixed_share_out_unless_told(tmp_path):
    study(tmp_path / "runs", XEON)
    assert call(report, str(tmp_path / "runs"), "--out", str(tmp_path / "strict")) == 0
    strict = (tmp_path / "strict" / "report.md").read_text()
    assert "75%" not in strict and "other machine" in strict
    mixed = tmp_path / "mixed"
    assert (
        call(report, str(tmp_path / "runs"), "--out", str(mixed), "--allow-mixed-references") == 0
    )
    assert ef_cell((mixed / "report.md").read_text()).startswith("75% †1")
