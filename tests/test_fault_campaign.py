"""The fault campaign (nobubble.faults): the draw, the comparison with a twin, the counts, the
faults done to files; and one short campaign end to end under torchrun."""

import dataclasses
import json

import pytest
import torch

from nobubble.faults.campaign import main
from nobubble.faults.compare import metrics_lost, weights_lost, what_was_lost
from nobubble.faults.draw import (
    CHECKPOINT_EVERY,
    CHECKPOINT_FILES,
    DAMAGED_CHECKPOINT,
    FULL_DISK,
    KINDS,
    RANK_KINDS,
    SIGKILL_RANK,
    SIGSTOP_RANK,
    SIGTERM,
    STEPS,
    draw_trials,
)
from nobubble.faults.inject import (
    damage,
    fill,
    small_disk,
    small_disks_here,
    stop_writes,
    stop_writes_below,
    takes_writes,
)
from nobubble.faults.summary import (
    EXACT,
    FAILED,
    LOST,
    MISSED,
    UNAVAILABLE,
    Record,
    failed,
    markdown,
    summarize,
)
from tests.helpers.commands import line_with


def test_the_draw_is_reproducible_from_the_seed_and_a_run_does_not_depend_on_how_many():
    assert draw_trials(20, 7) == draw_trials(20, 7)
    assert draw_trials(20, 7) != draw_trials(20, 8)
    assert draw_trials(5, 7) == draw_trials(20, 7)[:5]


def test_every_drawn_run_is_a_layout_to_run_and_a_fault_inside_it():
    trials = draw_trials(400, 0)
    layouts = {trial.layout for trial in trials}
    assert len(layouts) == 12  # 2 schedules x (dp=1; dp=2 x zero 0, 1) x the emulator on, off
    assert all(layout.zero == 0 for layout in layouts if layout.dp == 1)
    assert {trial.fault.kind for trial in trials} == set(KINDS)
    for trial in trials:
        fault = trial.fault
        assert fault.checkpoints_needed * CHECKPOINT_EVERY < fault.at_step
        assert fault.at_step <= STEPS - CHECKPOINT_EVERY
        assert (fault.rank is not None) == (fault.kind in RANK_KINDS)
        if fault.rank is not None:
            assert 0 <= fault.rank < trial.layout.world
        assert (fault.target in CHECKPOINT_FILES) == (fault.kind == DAMAGED_CHECKPOINT)
    assert {t.fault.rank for t in trials if t.layout.dp == 2 and t.fault.rank is not None} == {
        0,
        1,
        2,
        3,
    }


def test_the_kinds_asked_for_are_the_only_ones_drawn():
    kinds = {trial.fault.kind for trial in draw_trials(50, 3, (SIGTERM, SIGSTOP_RANK))}
    assert kinds == {SIGTERM, SIGSTOP_RANK}


TWIN = [
    {"step": 0, "val_loss": 5.0, "train_time_s": 0.0},
    {"step": 1, "train_loss": 4.5, "grad_norm": 1.0, "tokens_per_s": 100.0},
    {"step": 2, "train_loss": 4.0, "grad_norm": 0.9, "val_loss": 4.2, "tokens_per_s": 90.0},
]


def test_a_run_whose_values_match_is_exact_whatever_its_times():
    rows = [{**row, "tokens_per_s": 1.0} if "tokens_per_s" in row else row for row in TWIN]
    assert metrics_lost(rows, TWIN) == []


def test_the_comparison_flags_a_missing_line_a_missing_value_a_repeat_and_a_difference():
    without_step_1 = [TWIN[0], TWIN[2]]
    assert metrics_lost(without_step_1, TWIN) == ["no metrics line for step 1"]
    no_val_loss = [TWIN[0], TWIN[1], {k: v for k, v in TWIN[2].items() if k != "val_loss"}]
    assert metrics_lost(no_val_loss, TWIN) == ["val_loss missing at step 2"]
    assert metrics_lost([*TWIN, TWIN[1]], TWIN) == ["two metrics lines for step 1"]
    off = [TWIN[0], {**TWIN[1], "train_loss": 4.5000001}, TWIN[2]]
    assert metrics_lost(off, TWIN) == ["train_loss differs at step 1: 4.5000001 vs the twin's 4.5"]
    assert metrics_lost([*TWIN, {"step": 3, "train_loss": 1.0}], TWIN) == [
        "metrics lines the twin does not have, for step 3"
    ]


def test_the_comparison_flags_a_weight_that_differs_is_missing_or_has_another_shape():
    twin = {"a": torch.zeros(3), "b": torch.ones(2), "c": torch.ones(2)}
    assert weights_lost({k: v.clone() for k, v in twin.items()}, twin) == []
    ours = {"a": torch.tensor([0.0, 0.5, 0.0]), "c": torch.ones(3)}
    assert weights_lost(ours, twin) == [
        "weight b missing",
        "weight a differs from the twin's by up to 0.5",
        "weight c has shape (3,), the twin's (2,)",
    ]


def test_a_run_that_did_not_finish_and_kept_no_checkpoint_is_said_to_have_lost_both(tmp_path):
    run, twin = tmp_path / "run", tmp_path / "twin"
    for folder, rows in ((run, TWIN[:2]), (twin, TWIN)):
        folder.mkdir()
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text() + '{"step": 2, "tr')
    (run / "summary.json").write_text(json.dumps({"stopped": "error"}))
    assert what_was_lost(run, twin) == [
        "did not finish (error)",
        "1 damaged line(s) in metrics.jsonl",
        "no metrics line for step 2",
        f"no final weights: {run} has no checkpoint",
    ]


def record(index: int, kind: str, outcome: str, **fields) -> Record:
    (trial,) = draw_trials(1, index, (kind,))
    return Record(dataclasses.replace(trial, index=index), outcome, **fields)


HEADER = {
    "command": "python experiments/fault_campaign.py --runs 6 --out x",
    "code": {"nobubble": "abc1234", "torch": "2.13.0"},
    "machine": {"cpu": "a CPU", "cpus": 2, "gpu": None},
    "p2p_timeout_s": 20,
}


def test_the_summary_counts_each_outcome_by_kind_and_names_what_was_lost():
    records = [
        record(0, SIGTERM, EXACT, launches=[{"launch": "faulted", "traceback": True}]),
        record(1, SIGKILL_RANK, EXACT, detect_s=0.4, down_s=2.0),
        record(2, SIGKILL_RANK, LOST, detect_s=1.5, down_s=3.0, lost=["weight w differs"]),
        record(3, SIGSTOP_RANK, EXACT, detect_s=21.0, down_s=25.0),
        record(4, FULL_DISK, UNAVAILABLE, note="cannot mount a tmpfs"),
        record(5, SIGTERM, MISSED, note="the run ended (exit 0) before step 70"),
    ]
    summary = summarize(records, HEADER)
    assert summary["totals"] == {
        "drawn": 6,
        "injected": 4,
        EXACT: 3,
        LOST: 1,
        MISSED: 1,
        UNAVAILABLE: 1,
        FAILED: 0,
    }
    assert summary["by_kind"][SIGKILL_RANK] == {
        "drawn": 2,
        "injected": 2,
        EXACT: 1,
        LOST: 1,
        MISSED: 0,
        UNAVAILABLE: 0,
        FAILED: 0,
    }
    assert summary["longest_detect_s"] == {SIGKILL_RANK: 1.5, SIGSTOP_RANK: 21.0}
    assert summary["not_exact"] == [
        {"name": records[2].trial.name, "outcome": LOST, "lost": ["weight w differs"], "note": ""}
    ]
    assert summary["unavailable"] == {FULL_DISK: "cannot mount a tmpfs"}
    assert summary["tracebacks"] == [records[0].trial.name]  # reported, not counted as lost
    assert failed(summary)
    assert json.loads(json.dumps(summary)) == summary  # campaign.json holds it as it is
    page = markdown(summary)
    assert line_with(page, "3 of 4", "exactly")  # resumed exactly, of the faulted runs
    assert "| sigkill_rank | 2 | 2 | 1 | 1 | 0 | 0 | 0 |" in page
    assert line_with(page, f"**{records[2].trial.name}**", LOST, "weight w differs")
    assert line_with(page, f"- {FULL_DISK}:", "cannot mount a tmpfs")
    assert line_with(page, "traceback", records[0].trial.name)
    assert "abc1234" in page and HEADER["command"] in page


def test_runs_that_were_not_injected_do_not_fail_the_campaign_but_one_not_judged_does():
    quiet = [record(0, SIGTERM, EXACT), record(1, FULL_DISK, UNAVAILABLE, note="no mount")]
    assert not failed(summarize(quiet, HEADER))
    unjudged = [*quiet, record(2, SIGTERM, FAILED, note="its twin failed")]
    assert failed(summarize(unjudged, HEADER))


def test_stopping_writes_below_a_folder_stops_every_write_there_until_undone(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    undo = stop_writes_below(run)
    if undo is None:
        pytest.skip("nothing stops a write here")
    for path in (run, run / "checkpoints", run / "metrics.jsonl"):
        assert not takes_writes(path), path
    undo()
    for path in (run, run / "checkpoints", run / "metrics.jsonl"):
        assert takes_writes(path), path


def test_a_file_open_for_writing_stops_taking_writes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with path.open("ab", buffering=0) as log:
        undo = stop_writes(path)
        if undo is None:
            pytest.skip("nothing stops a write here")
        try:
            with pytest.raises(OSError):
                log.write(b"x\n")
        finally:
            undo()
        log.write(b"y\n")
    assert path.read_bytes() == b"y\n"


def test_a_damaged_file_has_one_byte_flipped_or_half_its_length(tmp_path):
    data = bytes(range(200))
    flipped, cut = tmp_path / "flipped", tmp_path / "cut"
    for path, how in ((flipped, "flip"), (cut, "truncate")):
        path.write_bytes(data)
        damage(path, how)
    new = flipped.read_bytes()
    assert len(new) == len(data) and sum(a != b for a, b in zip(new, data, strict=True)) == 1
    assert cut.read_bytes() == data[:100]


def test_a_small_disk_filled_takes_no_byte_until_the_filler_goes(tmp_path):
    if small_disks_here(tmp_path / "probe"):
        pytest.skip("no tmpfs can be mounted here")
    with small_disk(tmp_path / "disk", 1) as disk:
        filler = fill(disk)
        with pytest.raises(OSError), (disk / "x").open("wb", buffering=0) as fh:
            fh.write(b"1")
        filler.unlink()
        (disk / "x").write_bytes(b"1")
    assert list((tmp_path / "disk").iterdir()) == []  # unmounted: the files were on the disk


def test_an_out_that_holds_files_is_refused_before_any_run(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as stop:
        main(["--runs", "1", "--out", str(tmp_path)])
    assert stop.value.code == 2
    assert "holds files already" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.slow
def test_one_short_campaign_run_is_faulted_resumed_and_exact(tmp_path, capsys):
    """A run of two processes (dp=1) stopped by SIGTERM to torchrun, resumed, compared."""
    seed = next(s for s in range(100) if draw_trials(1, s, (SIGTERM,))[0].layout.dp == 1)
    out = tmp_path / "campaign"
    assert main(["--runs", "1", "--seed", str(seed), "--kinds", SIGTERM, "--out", str(out)]) == 0
    summary = json.loads((out / "campaign.json").read_text())
    assert summary["totals"]["injected"] == summary["totals"][EXACT] == 1
    (run,) = summary["runs"]
    assert [launch["stopped"] for launch in run["launches"]] == ["signal", "finished"]
    assert run["injected_at"] >= run["trial"]["fault"]["at_step"]
    assert (out / "campaign.md").read_text() in capsys.readouterr().out
