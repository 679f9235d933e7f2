"""``nobubble report`` on hand-made run folders: numbers checked against hand computations."""

import json
import math
import re
import shutil
import statistics
from pathlib import Path

import pytest

from nobubble.cli import main
from nobubble.config import ConfigError, NobubbleWarning
from nobubble.reporting import cli as report
from nobubble.reporting.groups import compare, group_runs
from nobubble.reporting.plots import final_limits, plot_curves
from nobubble.reporting.runs import EvalPoint, ReportError, discover
from nobubble.reporting.table import STALENESS_MEASURES, settings_label
from nobubble.reporting.target import target_rows, time_to_reach
from nobubble.staleness import (
    APPLIED_COSINE,
    APPLIED_ERROR,
    COSINE,
    SYNC_STEP_COSINE,
    SYNC_STEP_ERROR,
)
from tests.helpers.commands import call
from tests.helpers.pipeline import SMALL
from tests.helpers.runs import make_run

PNG = b"\x89PNG\r\n\x1a\n"


ADAMW = {"sync": [2.00, 2.02, 2.01], "2bw": [2.40, 2.46, 2.43], "2bw+EF": [2.10, 2.12, 2.08]}
MUON = {"sync": [1.90, 1.95], "2bw": [1.91, 1.93], "2bw+EF": [1.92, 1.90]}


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    for optim, table in (("adamw", ADAMW), ("muon", MUON)):
        for setup, losses in table.items():
            schedule = setup.removesuffix("+EF")
            correction = "ef" if setup.endswith("+EF") else "none"
            for seed, loss in enumerate(losses):
                make_run(
                    root, loss, optim=optim, schedule=schedule, correction=correction, seed=seed
                )
    make_run(root, 2.6, optim="adamw", schedule="pipedream", stages=4)
    make_run(root, 9.9, finished=False, optim="lion")
    return root


def mean_std(values):
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def sem(values):
    return statistics.stdev(values) / math.sqrt(len(values))


def test_table_numbers_match_hand_computations(runs_dir, tmp_path):
    assert call(report, str(runs_dir), "--out", str(tmp_path / "out")) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    quality = text.split("## Delay gap during training")[0]
    rows = {
        tuple(cell.strip() for cell in line.split("|")[1:3]): line
        for line in quality.splitlines()
        if line.startswith("| adamw") or line.startswith("| muon")
    }
    sync, delayed, ef = ADAMW["sync"], ADAMW["2bw"], ADAMW["2bw+EF"]
    assert mean_std(sync) in rows["adamw", "sync"] and "baseline" in rows["adamw", "sync"]
    assert mean_std([x * 1.5 for x in sync]) in rows["adamw", "sync"]  # bits per byte
    gap = statistics.fmean(delayed) - statistics.fmean(sync)
    gap_se = math.hypot(sem(delayed), sem(sync))
    assert f"| {gap:+.4f} ± {gap_se:.4f} |" in rows["adamw", "2bw"]
    ef_gap = statistics.fmean(ef) - statistics.fmean(sync)
    assert f"| {100 * (gap - ef_gap) / gap:.0f}% |" in rows["adamw", "2bw+EF"]
    # muon's gap is within seed noise, so EF's share of it is not reported
    assert "| — (no clear gap) |" in rows["muon", "2bw+EF"]
    # a single pipedream seed: a mean without std, its gap to the same sync baseline
    pipedream_gap = 2.6 - statistics.fmean(sync)
    assert (
        f"| 1 | 2.6000 | 3.9000 | {pipedream_gap:+.4f} ± {sem(sync):.4f} |"
        in (rows["adamw", "pipedream"])
    )
    assert "stages=4" in rows["adamw", "pipedream"]
    assert "skipped" in text and "lion" in text  # the unfinished run is listed as skipped
    for png in ("val_loss_vs_step.png", "val_loss_vs_time.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == PNG


def test_where_filters_and_final_loss_plot(runs_dir, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--where", "optim=adamw", "--where", "ef=false", "--vs", "stages", "--out", str(out)]
    assert call(report, str(runs_dir), *args) == 0
    printed = capsys.readouterr().out
    assert "muon" not in printed and "2bw+EF" not in printed
    assert "| adamw | pipedream |" in printed
    assert (out / "final_loss_vs_stages.png").read_bytes()[:8] == PNG


def test_time_to_target(runs_dir, tmp_path):
    args = ["--where", "optim=adamw", "--time-to-target", "--out", str(tmp_path)]
    assert call(report, str(runs_dir), *args) == 0
    text = (tmp_path / "report.md").read_text()
    target = statistics.fmean(ADAMW["sync"])
    # The sync baseline takes its full 100 s; 2bw+EF never gets below the target.
    assert f"| adamw | sync | stages=1 | {target:.4f} | 100.0 ± 0.0 | 3/3 | 1.00× |" in text
    assert f"| adamw | 2bw+EF | stages=1 | {target:.4f} | not reached | 0/3 | — |" in text
    # The reverse: each sync run falls linearly from final + 1 at 50 s to final at 100 s, so it
    # reaches 2bw+EF's mean final loss L at 50 + 50 * (final + 1 - L) seconds.
    reverse = text.split("### The reverse")[1]
    ef_loss = statistics.fmean(ADAMW["2bw+EF"])
    times = [50 + 50 * (final + 1 - ef_loss) for final in ADAMW["sync"]]
    row = next(line for line in reverse.splitlines() if line.startswith("| adamw | 2bw+EF |"))
    time_cell = f"{statistics.fmean(times):.1f} ± {statistics.stdev(times):.1f}"
    assert f"| {ef_loss:.4f} | 100.0 ± 0.0 | {time_cell} | 3/3 |" in row
    assert row.endswith(f"| {statistics.fmean(times) / 100:.2f}× |")


def test_time_to_reach_interpolates_between_evaluations():
    evals = [EvalPoint(0, 5.0, 7.0, 0.0), EvalPoint(10, 3.0, 4.0, 20.0), EvalPoint(20, 2.0, 3, 50)]
    assert time_to_reach(evals, 5.0) == 0.0
    assert time_to_reach(evals, 4.0) == pytest.approx(10.0)
    assert time_to_reach(evals, 2.5) == pytest.approx(35.0)
    assert time_to_reach(evals, 1.9) is None


def test_every_correction_is_compared_with_its_plain_delayed_run(tmp_path):
    """The gap closed by a correction, whatever its name or strength, against the same run
    without one; a sync run with a correction is not a baseline."""
    make_run(tmp_path, 2.0, schedule="sync")
    make_run(tmp_path, 2.1, schedule="sync", correction="nesterov")
    make_run(tmp_path, 2.4, schedule="2bw")
    make_run(tmp_path, 2.1, schedule="2bw", correction="nesterov", nesterov_gamma=0.5)
    make_run(tmp_path, 2.3, schedule="2bw", correction="dc", dc_lambda=1.0)
    make_run(tmp_path, 2.2, schedule="2bw", correction="ef+predict")
    runs, _ = discover([tmp_path])
    rows = {row.group.setup: row for row in compare(group_runs(runs))}
    assert rows["sync"].group.is_baseline and not rows["sync+nesterov"].group.is_baseline
    assert rows["sync+nesterov"].baseline is rows["sync"].group
    assert rows["2bw"].closed is None
    assert rows["2bw+nesterov"].closed == pytest.approx(0.3 / 0.4)
    assert rows["2bw+dc"].closed == pytest.approx(0.1 / 0.4)
    assert rows["2bw+EF+predict"].closed == pytest.approx(0.2 / 0.4)


def test_a_dense_run_beside_moe_runs_is_labelled_dense(tmp_path):
    make_run(tmp_path, 2.0, optim="adamw", moe_experts=8, moe_top_k=2, lr=1e-3)
    make_run(tmp_path, 2.1, optim="adamw", lr=3e-3)
    runs, _ = discover([tmp_path])
    keys = ["moe_experts", "moe_top_k", "lr"]
    labels = sorted(settings_label(g, keys) for g in group_runs(runs))
    assert labels == ["dense lr=0.003", "moe_experts=8 moe_top_k=2 lr=0.001"]


def test_faster_run_speed_up(tmp_path):
    make_run(tmp_path, 2.0, schedule="1f1b", stages=2, microbatches=2)
    fast = make_run(tmp_path, 1.5, schedule="2bw", stages=2, microbatches=2, correction="ef")
    runs, _ = discover([tmp_path])
    rows = compare(group_runs(runs))
    assert rows[1].closed is None and not rows[1].closed_unclear  # no 2bw run without EF
    baseline, fast_row = target_rows(rows)
    assert baseline.group.setup == "1f1b" and baseline.time.mean == 100.0
    # 2bw+EF falls from 2.5 at 50 s to 1.5 at 100 s: it reaches 2.0 halfway, at 75 s
    assert fast_row.group.runs[0].path == fast
    assert fast_row.time.mean == pytest.approx(75.0) and fast_row.speedup == pytest.approx(4 / 3)


def test_folders_that_are_not_runs(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match=r"is not a run folder .* and holds no run folders"):
        call(report, str(tmp_path / "empty"))
    make_run(tmp_path / "a", 2.0, seed=0)
    make_run(tmp_path / "b", 2.0, seed=0)
    runs, warnings = discover([tmp_path])
    assert len(runs) == 1 and "same settings and seed as" in warnings[0]
    with pytest.raises(ReportError, match="no finished runs matching optim=muon"):
        call(report, str(tmp_path), "--where", "optim=muon")


def test_gap_during_training(runs_dir, tmp_path):
    """The gap at each quarter point is the mean of the delayed curve minus the baseline's."""
    assert call(report, str(runs_dir), "--where", "optim=adamw", "--out", str(tmp_path)) == 0
    text = (tmp_path / "report.md").read_text()
    section = text.split("## Delay gap during training")[1]
    row = next(line for line in section.splitlines() if line.startswith("| adamw | 2bw |"))
    gap = statistics.fmean(ADAMW["2bw"]) - statistics.fmean(ADAMW["sync"])
    # evaluations at steps 0, 50, 100: a quarter and a half of training both pick step 50
    # (step 0, before any update, never counts); every curve is `final + 1` there
    assert row.endswith(f"| {gap:+.4f} (50) | {gap:+.4f} (50) | {gap:+.4f} (100) |")
    assert "| adamw | sync |" not in section  # a baseline has no gap to itself


# -- diverged runs: stopped by the non-finite policy, or ended with a non-finite loss -----------

DIVERGE = ["schedule=2bw", "optim=sgd", "momentum=0", "lr=1e6", "grad_clip=0", "warmup_steps=0"]


@pytest.fixture(scope="module")
def diverged_run(tmp_path_factory) -> Path:
    """A run the non-finite policy stopped, as training leaves it (a real run of a few seconds)."""
    out = tmp_path_factory.mktemp("diverged") / "run"
    argv = ["train", "--no-progress", "--out", str(out), *SMALL, *DIVERGE, "steps=20"]
    with pytest.warns(NobubbleWarning, match="non-finite loss or gradient"):
        assert main(argv) == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "non-finite" and "steps in a row" in summary["reason"]
    assert summary["steps"] == len(metrics_steps(out)) and "final_val_loss" not in summary
    return out


def metrics_steps(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for line in lines if "train_loss" in (r := json.loads(line))]


def like(root: Path, run: Path, final: float, **changes) -> Path:
    """A finished run with ``run``'s settings but ``changes``."""
    config = {**json.loads((run / "config.json").read_text()), **changes}
    settings = {k: v for k, v in config.items() if k != "out"}
    return make_run(root, final, name_as="-".join(map(str, changes.values())), **settings)


def test_a_run_the_nonfinite_policy_stopped_is_reported_as_diverged(diverged_run, tmp_path):
    root = tmp_path / "runs"
    shutil.copytree(diverged_run, root / "diverged")
    like(root / "baseline", diverged_run, 2.0, schedule="sync")
    assert call(report, str(root), "--out", str(tmp_path / "out")) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    assert "2 runs (1 diverged) in 2 groups" in text and "## Skipped" not in text
    rows = {line.split("|")[2].strip(): line for line in text.splitlines() if "| sgd |" in line}
    assert "| 1 | 2.0000 | 3.0000 | baseline |" in rows["sync"]
    assert "| 1 | diverged (1 of 1 seeds) | — | diverged |" in rows["2bw"]


NAN_LINES = [
    {"step": 0, "val_loss": 5.0, "val_bpb": 7.5, "train_time_s": 0.0},
    {"step": 1, "train_loss": 9.0, "grad_norm": 1e9},
    {"step": 2, "train_loss": math.nan, "grad_norm": math.nan, "skipped_stages": [0]},
]


def make_stopped(root: Path, stopped: str | None, **settings) -> Path:
    """A run folder stopped at step 2 whose last metrics line is NaN, with a summary saying
    ``stopped`` (None: no summary, as a hard kill leaves it)."""
    folder = make_run(root, 0.0, finished=False, **settings)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in NAN_LINES))
    if stopped:
        summary = {"stopped": stopped, "steps": 2, "reason": f"why it was {stopped}"}
        (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def make_diverged(root: Path, **settings) -> Path:
    """A run folder as the non-finite policy leaves it."""
    return make_stopped(root, "non-finite", **settings)


@pytest.mark.parametrize("stopped", [None, "signal", "error"])
def test_why_a_run_stopped_comes_from_its_summary_not_its_last_metrics_line(tmp_path, stopped):
    """A run whose last line is NaN but that the non-finite policy did not stop (killed, or
    stopped by a signal or an error) is unfinished, not diverged."""
    root = tmp_path / "runs"
    make_run(root, 2.0, schedule="sync")
    folder = make_stopped(root, stopped, schedule="2bw")
    runs, warnings = discover([root])
    assert [run.settings["schedule"] for run in runs] == ["sync"]
    if stopped is None:
        assert warnings == [f"skipped {folder}: unfinished (no summary.json)"]
    else:
        assert warnings == [
            f"skipped {folder}: stopped at step 2 (why it was {stopped}); continue it with "
            f"nobubble train --resume {folder}"
        ]


def test_a_finite_but_diverged_run_is_drawn_off_the_scale_of_the_others(tmp_path):
    """A run whose loss rose to 6.9e6 (finite) would flatten every other curve: the axis keeps
    to the runs below the highest starting loss, and its line is labelled with its peak."""
    root = tmp_path / "runs"
    for seed, loss in enumerate((2.0, 2.1)):
        make_run(root, loss, schedule="sync", seed=seed)
        make_run(root, loss + 0.2, schedule="2bw", seed=seed)
    make_run(root, 6.9e6, schedule="2bw", lr=1.0)
    groups = group_runs(discover([root])[0])
    fig = plot_curves(groups, "step", tmp_path / "curves.png")
    low, high = fig.axes[0].get_ylim()
    assert 1.5 < low < 2.0 and 3.3 < high < 3.5  # the others' range after a fifth of training
    labels = [text.get_text() for ax in fig.axes for text in ax.get_legend().get_texts()]
    assert [label for label in labels if "off the scale" in label] == [
        "2bw lr=1.0 (off the scale: up to 6.9e+06)"
    ]
    assert final_limits(groups)[1] < 2.5  # the final losses but 6.9e6
    assert call(report, str(root), "--vs", "lr", "--out", str(tmp_path / "out")) == 0
    assert (tmp_path / "out" / "final_loss_vs_lr.png").read_bytes()[:8] == PNG


def test_diverged_seeds_count_as_an_infinite_loss(tmp_path):
    root = tmp_path / "runs"
    for seed, loss in enumerate(ADAMW["sync"]):
        make_run(root, loss, optim="adamw", schedule="sync", seed=seed)
        make_run(root, loss + 0.1, optim="adamw", schedule="2bw", correction="ef", seed=seed)
        make_run(root, loss, optim="muon", schedule="2bw", seed=seed)
    for seed in (0, 1):
        make_run(root, 2.5, optim="adamw", schedule="2bw", seed=seed)
    make_diverged(root, optim="adamw", schedule="2bw", seed=2)
    make_run(root, math.nan, optim="muon", schedule="sync")  # trained to the end, to NaN
    make_run(root, 9.0, finished=False, optim="lion")  # merely unfinished
    out = tmp_path / "out"
    assert call(report, str(root), "--time-to-target", "--vs", "schedule", "--out", str(out)) == 0
    text = (out / "report.md").read_text()
    assert "13 runs (2 diverged) in 5 groups" in text
    assert "skipped" in text and "lion" in text
    rows = {tuple(line.split("|")[1:3]): line for line in text.split("## Delay")[0].splitlines()}
    assert "| 3 | diverged (1 of 3 seeds) | — | diverged |  |" in rows[" adamw ", " 2bw "]
    assert rows[" adamw ", " 2bw+EF "].endswith("|  |")  # no EF share of an infinite gap
    assert "| 1 | diverged (1 of 1 seeds) | — | baseline |" in rows[" muon ", " sync "]
    assert (
        "| 3 | 2.0100 ± 0.0100 | 3.0150 ± 0.0150 | baseline diverged |" in (rows[" muon ", " 2bw "])
    )
    gaps = text.split("## Delay gap during training")[1].split("## Time to target")[0]
    assert "| adamw | 2bw+EF |" in gaps and "| adamw | 2bw |" not in gaps and "muon" not in gaps
    target = text.split("## Time to target")[1]
    assert "| muon |" not in target  # a diverged baseline sets no target
    reverse = target.split("### The reverse")[1]
    assert "| adamw | 2bw |" not in reverse  # nor does a diverged group's final loss
    for png in ("val_loss_vs_step.png", "val_loss_vs_time.png", "final_loss_vs_schedule.png"):
        assert (out / png).read_bytes()[:8] == PNG


def test_an_out_folder_that_cannot_be_made_is_refused_before_any_work(runs_dir, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("a file")
    with pytest.raises(ConfigError, match=re.escape(f"--out {taken}: {taken} is not a folder")):
        call(report, str(runs_dir), "--out", str(taken))


@pytest.mark.parametrize("scaling", [[], ["--scaling"]])
def test_an_out_that_cannot_be_written_is_refused_before_reading_a_run(
    tmp_path, capsys, unwritable, monkeypatch, scaling
):
    """Under a regular file, in a folder that takes no files (``unwritable``: see
    conftest.lock_writes for how read-only is simulated), in /proc: one line, nothing made."""
    for module in ("cli", "scaling_report"):
        monkeypatch.setattr(f"nobubble.reporting.{module}.discover", None)  # never reached
    (tmp_path / "file").write_text("keep")
    outs = [tmp_path / "file" / "report", unwritable / "report"]
    outs += [Path("/proc/nobubble-report")] if Path("/proc/self").is_dir() else []
    for out in outs:
        assert main(["report", *scaling, str(tmp_path), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"nobubble: error: --out {out}: ") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "read-only"]
    assert list(unwritable.iterdir()) == []


def test_runs_of_earlier_versions_group_with_new_ones_whatever_chunks_they_saved(tmp_path):
    """Earlier versions saved chunks null (the schedule's default); now it is resolved before it
    is saved. The report reads both as the schedule's chunks, so they are one group of seeds."""
    root = tmp_path / "runs"
    make_run(root, 2.0, schedule="interleaved-1f1b", stages=2, microbatches=2, seed=0)
    make_run(root, 2.2, schedule="interleaved-1f1b", stages=2, microbatches=2, seed=1, chunks=2)
    runs, _ = discover([root])
    (group,) = group_runs(runs)
    assert len(group.runs) == 2 and group.settings["chunks"] == 2


def test_each_correction_against_its_control_without_a_delay(tmp_path, capsys):
    """sync 2.0; sync+EF (the control) 2.05: EF costs 0.05 without a delay; 2bw 2.4 (the delay
    costs 0.4); 2bw+EF 2.15: the delay costs 0.10 beside EF's control, 75% of 0.4 removed (the
    gap closed column, 2.4 against 2.15, says 63%)."""
    make_run(tmp_path, 2.0, schedule="sync")
    make_run(tmp_path, 2.05, schedule="sync", correction="ef", ef_gamma=1.5)  # spelled apart
    make_run(tmp_path, 2.4, schedule="2bw")
    make_run(tmp_path, 2.15, schedule="2bw", correction="ef", ef_gamma=1.5)
    make_run(tmp_path, 2.3, schedule="2bw", correction="ef")  # no control at γ = 1: no row
    assert call(report, str(tmp_path), "--out", str(tmp_path / "out")) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    table = text.split("## Corrections against their controls without a delay")[1]
    rows = [line for line in table.split("\n\n")[1].splitlines() if line.startswith("| adamw")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert cells[1:] == ["2bw+EF", "sync+EF", "+0.0500", "+0.1500", "+0.1000", "+0.4000", "75%"]
    assert "| 63% |" in text.split("## Corrections")[0]  # the gap closed mixes the two


def test_delayed_groups_against_the_references_at_the_default_settings(tmp_path):
    """At beta1 0.9 (the reference): sync 2.0, 2bw 2.4. At beta1 0.8: sync 1.9, 2bw 2.3 and
    2bw+EF 2.1. Against sync at its own beta1 2bw+EF closes 50%; against the references, 2.1 is
    +0.1 above sync at 0.9, 75% of the 0.4 gap closed, and plain 2bw at 0.8 closes 25%. A group
    at the reference values, and one whose reference sync is missing (lr 1e-2), get no row."""
    make_run(tmp_path, 2.0, schedule="sync")
    make_run(tmp_path, 2.4, schedule="2bw")
    make_run(tmp_path, 2.2, schedule="2bw", correction="ef")
    make_run(tmp_path, 1.9, schedule="sync", beta1=0.8)
    make_run(tmp_path, 2.3, schedule="2bw", beta1=0.8)
    make_run(tmp_path, 2.1, schedule="2bw", correction="ef", ef_gamma=2.0, beta1=0.8)
    make_run(tmp_path, 2.3, schedule="2bw", beta1=0.8, lr=1e-2)
    out = tmp_path / "out"
    assert call(report, str(tmp_path), "--out", str(out), "--reference", "beta1=0.9") == 0
    text = (out / "report.md").read_text()
    assert "| 50% |" in text.split("## Against")[0]
    table = text.split("## Against the references at beta1=0.9")[1].split("\n\n")[1]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()[2:]]
    assert [row[1:3] for row in rows] == [["2bw", "ef_gamma=1.0"], ["2bw+EF", "ef_gamma=2.0"]]
    assert [row[4:] for row in rows] == [
        ["2.3000", "2.0000", "+0.3000", "+0.4000", "25%"],
        ["2.1000", "2.0000", "+0.1000", "+0.4000", "75%"],
    ]
    none = tmp_path / "none"
    assert call(report, str(tmp_path), "--out", str(none), "--reference", "beta1=0.5") == 0
    assert "No delayed group differs" in (none / "report.md").read_text()
    with pytest.raises(ReportError, match="one value per setting"):
        call(report, str(tmp_path), "--reference", "beta1=0.9,0.8")
    with pytest.raises(ConfigError, match="unknown config key 'beta9'"):
        call(report, str(tmp_path), "--reference", "beta9=0.9")


def correlations(staleness: str) -> dict[str, tuple[int, float]]:
    """The report's rank correlations of a staleness measure with the gap: measure -> (groups
    counted, Spearman's rho as printed)."""
    found = {}
    for line in staleness.splitlines():
        measures = [name for name in STALENESS_MEASURES if f" {name} " in line]
        if "Spearman" in line and measures:
            count = int(re.search(r"(\d+) groups", line)[1])
            found[measures[0]] = (count, float(line.rstrip(".").split()[-1]))
    return found


def test_staleness_beside_the_gap_and_their_rank_correlation(tmp_path):
    """Mean drift of a group: over each run's evaluations after the first, of the mean over the
    stages with a delay (None: the last stage of pipedream)."""
    make_run(tmp_path, 2.0, schedule="sync")
    plain = make_run(tmp_path, 2.4, schedule="2bw", drift=([0.02, 0.04], [0.01, 0.01]))
    ef = make_run(tmp_path, 2.2, schedule="2bw", correction="ef", drift=([0.01], [0.01]))
    make_run(tmp_path, 2.6, schedule="pipedream", stages=3, drift=([0.05, 0.03, None], [0.04]))
    folder = make_run(tmp_path, 2.3, schedule="2bw", correction="predict", drift=([0.02], [0.02]))
    for run, cosines in ((folder, [0.8, 0.6]), (plain, [0.9]), (ef, [0.4, 0.6])):
        with (run / "metrics.jsonl").open("a") as metrics:  # cosine lines, as staleness_every
            metrics.write(json.dumps({"step": 60, "train_loss": 2.5, COSINE: cosines}) + "\n")
    assert call(report, str(tmp_path), "--out", str(tmp_path / "out")) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    staleness = text.split("## Staleness")[1]
    rows = {
        line.split("|")[2].strip(): [c.strip() for c in line.split("|")[1:-1]]
        for line in staleness.splitlines()
        if line.startswith("| adamw")
    }
    assert "sync" not in rows  # nothing drifts without a delay
    assert rows["2bw"][4:12] == ["0.0200", "0.0100", "0.9000", "—", "—", "—", "—", "+0.4000"]
    assert rows["pipedream"][4:6] == ["0.0400", "0.0400"]
    assert rows["2bw+predict"][6] == "0.7000"
    # drift 0.01, 0.02, 0.02, 0.04 against gaps 0.2, 0.3, 0.4, 0.6: ranks 1, 2.5, 2.5, 4
    # cosine 0.5, 0.7, 0.9 against gaps 0.2, 0.3, 0.4
    assert correlations(staleness) == {"mean weight drift": (4, 0.95), "gradient cosine": (3, 1.0)}


def test_the_applied_step_error_beside_the_gap_and_its_rank_correlation(tmp_path):
    """A group's applied-step error and cosine: over each run's measurements of the mean over
    the model stages; sync's (zero) is shown beside its baseline, and correlated with no gap."""
    lines = {
        make_run(tmp_path, 2.0, schedule="sync"): [([0.0, 0.0], [1.0, 1.0])],
        make_run(tmp_path, 2.4, schedule="2bw"): [([0.3, 0.5], [0.9, 0.8]), ([0.2], [0.9])],
        make_run(tmp_path, 2.2, schedule="2bw", correction="ef"): [([0.2], [0.95])],
        make_run(tmp_path, 2.3, schedule="2bw", correction="predict"): [([0.1], [0.7])],
    }
    for run, measured in lines.items():
        with (run / "metrics.jsonl").open("a") as metrics:  # as applied_error_every writes them
            for step, (errors, cosines) in enumerate(measured, 1):
                line = {"step": step, APPLIED_ERROR: errors, APPLIED_COSINE: cosines}
                # against the synchronous step: half the error, for every run
                line |= {SYNC_STEP_ERROR: [e / 2 for e in errors], SYNC_STEP_COSINE: cosines}
                metrics.write(json.dumps(line) + "\n")
    assert call(report, str(tmp_path), "--out", str(tmp_path / "out")) == 0
    staleness = (tmp_path / "out" / "report.md").read_text().split("## Staleness")[1]
    header = next(line for line in staleness.splitlines() if line.startswith("| optim"))
    assert (
        "| applied-step error | applied-step cosine | sync-step error | sync-step cosine "
        "| gap vs sync |" in header
    )
    cells = {
        line.split("|")[2].strip(): [c.strip() for c in line.split("|")[1:-1]]
        for line in staleness.splitlines()
        if line.startswith("| adamw")
    }
    rows = {setup: c[-5:-3] + c[-1:] for setup, c in cells.items()}
    assert cells["2bw+EF"][-3:-1] == ["0.1000", "0.9500"]  # the sync-step columns
    assert rows == {
        "sync": ["0.0000", "1.0000", "baseline"],
        "2bw": ["0.3000", "0.8750", "+0.4000"],  # error (0.4 + 0.2) / 2, cosine (0.85 + 0.9) / 2
        "2bw+EF": ["0.2000", "0.9500", "+0.2000"],
        "2bw+predict": ["0.1000", "0.7000", "+0.3000"],
    }
    # error 0.1, 0.2, 0.3 against gaps 0.3, 0.2, 0.4; cosine 0.7, 0.95, 0.875
    got = correlations(staleness)
    assert (got["applied-step error"], got["applied-step cosine"]) == ((3, 0.5), (3, -0.5))


def test_settings_that_do_nothing_in_a_run_do_not_keep_its_seeds_apart(tmp_path):
    """zero=1 at dp=1 and a momentum AdamW does not have change nothing
    (nobubble.settings_read): such runs pool with the others' seeds; at dp=2, where zero is read,
    it still tells runs apart."""
    root = tmp_path / "runs"
    make_run(root, 2.0, seed=0)
    make_run(root, 2.2, seed=1, zero=1)
    make_run(root, 2.4, seed=2, momentum=0.5)
    make_run(root, 2.0, seed=0, dp=2)
    make_run(root, 2.1, seed=0, dp=2, zero=1)
    runs, _ = discover([root])
    groups = group_runs(runs)
    seeds = sorted(sorted(r.settings["seed"] for r in g.runs) for g in groups)
    assert seeds == [[0], [0], [0, 1, 2]]
    pooled = next(g for g in groups if len(g.runs) == 3)
    assert (pooled.settings["zero"], pooled.settings["dp"]) == (0, 1)


def test_a_config_json_that_no_longer_builds_is_named_in_one_line(tmp_path, capsys):
    run = make_run(tmp_path / "runs", 2.0)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "preset": "no-such-preset"}))
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(run / "config.json") in err and "no-such-preset" in err and err.count("\n") == 1
