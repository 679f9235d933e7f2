"""Grid files, run planning and ``best:`` values, without training anything."""

import functools
import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest

from nobubble.config import ConfigError, load_toml
from nobubble.configure import build_config
from nobubble.runfolder.folder import run_name
from nobubble.sweeping import cli as sweep
from nobubble.sweeping.best import Pending
from nobubble.sweeping.grid import SweepError, load_sweep
from nobubble.sweeping.launch import command, write_config_file
from nobubble.sweeping.plan import plan_phase
from nobubble.sweeping.planned import PlannedRun, Status, finished_loss
from tests.helpers.commands import call

PHASED = """
[sweep]
name = "study"
out = "OUT"

[base]
steps = 10
lr = 0.003

[[phase]]
name = "lr_sweep"
set = { schedule = "sync" }
[phase.grid]
optim = ["adamw", "muon"]
lr = [0.001, 0.01]
seed = [0, 1]

[[phase]]
name = "main"
set = { lr = "best:lr_sweep" }
[phase.grid]
optim = ["adamw", "muon"]
[phase.grid.setup]
sync = { schedule = "sync" }
2bw = { schedule = "2bw" }
"2bw+ef" = { schedule = "2bw", correction = "ef" }

[[phase]]
name = "pipeline"
launcher = "torchrun"
set = { stages = 2, microbatches = 2, schedule = "1f1b" }
"""


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """Grids without [sweep] out write to runs/<name> under the working directory."""
    monkeypatch.chdir(tmp_path)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(text.replace("OUT", str(tmp_path / "runs")))
    return path


def plan(sweep_spec, name, planned, loss_of=lambda run: None):
    phase = sweep_spec.phase(name)
    return plan_phase(sweep_spec, phase, planned, loss_of, threads=lambda processes: 1).runs


def finish(run: PlannedRun, loss: float) -> None:
    """Make ``run``'s folder look like a finished training run."""
    run.path.mkdir(parents=True)
    (run.path / "config.json").write_text(json.dumps(run.config.to_dict()))
    (run.path / "summary.json").write_text(json.dumps({"final_val_loss": loss}))


def test_phases_variants_names_and_precedence(tmp_path):
    spec = load_sweep(write(tmp_path, PHASED))
    assert spec.name == "study" and spec.out == tmp_path / "runs"
    assert [p.name for p in spec.phases] == ["lr_sweep", "main", "pipeline"]
    runs = plan(spec, "lr_sweep", {})
    assert [r.name for r in runs][:3] == [
        "optim=adamw,lr=0.001,seed=0",
        "optim=adamw,lr=0.001,seed=1",
        "optim=adamw,lr=0.01,seed=0",
    ]
    first = runs[0]
    assert first.path == tmp_path / "runs" / "lr_sweep" / first.name
    assert (first.config.steps, first.config.lr, first.config.schedule) == (10, 0.001, "sync")
    assert (first.config.out, first.config.progress) == (str(first.path), False)
    (pipeline,) = plan(spec, "pipeline", {})
    assert pipeline.name == "run" and pipeline.processes == 2
    assert pipeline.config.lr == 0.003  # [base]
    main = spec.phase("main").points()
    assert [p.name for p in main][:3] == [
        "optim=adamw,setup=sync",
        "optim=adamw,setup=2bw",
        "optim=adamw,setup=2bw+ef",
    ]
    assert main[2].settings["correction"] == "ef" and main[2].settings["schedule"] == "2bw"


def test_best_takes_the_lowest_mean_loss_over_seeds(tmp_path):
    spec = load_sweep(write(tmp_path, PHASED))
    planned = {"lr_sweep": plan(spec, "lr_sweep", {})}
    with pytest.raises(Pending, match=r"4 unfinished runs that decide lr for \{'optim': 'adamw'\}"):
        plan(spec, "main", planned)
    losses = {  # (optim, lr) -> loss per seed; adamw: seed 0 alone would pick 0.001
        ("adamw", 0.001): [2.0, 2.6],
        ("adamw", 0.01): [2.1, 2.35],
        ("muon", 0.001): [3.0, 3.0],
        ("muon", 0.01): [math.nan, 1.0],  # a diverged seed makes the whole lr lose
    }
    for run in planned["lr_sweep"]:
        finish(run, losses[run.config.optim, run.config.lr][run.config.seed])
    main = plan(spec, "main", planned, finished_loss)
    chosen = {(r.config.optim, r.config.schedule, r.config.correction): r.config.lr for r in main}
    assert chosen == {
        ("adamw", "sync", "none"): 0.01,
        ("adamw", "2bw", "none"): 0.01,
        ("adamw", "2bw", "ef"): 0.01,
        ("muon", "sync", "none"): 0.001,
        ("muon", "2bw", "none"): 0.001,
        ("muon", "2bw", "ef"): 0.001,
    }


def test_best_counts_runs_that_failed_in_this_sweep_as_diverged(tmp_path):
    spec = load_sweep(write(tmp_path, PHASED))
    planned = {"lr_sweep": plan(spec, "lr_sweep", {})}
    for run in planned["lr_sweep"]:
        if run.config.optim == "adamw":
            finish(run, 2.0)
    failed = {r.path for r in planned["lr_sweep"] if r.config.optim == "muon"}
    with pytest.raises(SweepError, match="every lr of phase 'lr_sweep' failed or diverged"):
        plan(spec, "main", planned, functools.partial(finished_loss, failed=failed))


def test_dry_run_shows_phases_waiting_for_best_values(tmp_path, capsys):
    path = write(tmp_path, PHASED)
    assert call(sweep, "--config", str(path), "--dry-run") == 0
    out = capsys.readouterr().out
    assert "phase main: 6 runs, waiting for lr = best:lr_sweep" in out
    assert "  wait  optim=muon,setup=2bw+ef" in out
    assert out.strip().endswith("9 to run, 0 complete, 6 waiting for earlier phases")


def test_a_phase_cannot_start_before_the_phase_it_takes_best_values_from(tmp_path):
    path = write(tmp_path, PHASED)
    with pytest.raises(SweepError, match=r"Run that phase to the end first .* --phase lr_sweep"):
        call(sweep, "--config", str(path), "--phase", "main")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[bse]\nlr = 1", r"unknown key 'bse' \(did you mean 'base'\?\)"),
        ("[base]\nlrr = 1", r"unknown config key 'lrr' \(did you mean 'lr'\?\)"),
        ("[base]\nout = 'x'", r"set \[sweep\] out instead"),
        ("[grid]\nlr = []", "empty list"),
        ("[grid]\nlr = [1e-3, 1e-3]", "lists a value twice"),
        ("[grid]\nlr = 'x'", "a list of values or a table of named variants"),
        ("[grid]\nsteps = ['many']", "steps must be a whole number"),
        ("[set]\nlr = 1e-3\n[grid]\nlr = [1e-3]", "lr is both in set and in the grid"),
        ("[[phase]]\nname = 'a b'", "needs a name of letters"),
        ("[[phase]]\nname = 'a'\nlauncher = 'mpirun'", "launcher must be one of"),
        ("[[phase]]\nname = 'a'\nset = { lr = 'best:b' }", "must name an earlier phase"),
        (
            "[[phase]]\nname = 'a'\ngrid = { seed = [0] }\n"
            "[[phase]]\nname = 'b'\nset = { lr = 'best:a' }",
            "phase 'a' does not vary lr",
        ),
    ],
)
def test_grid_file_errors_say_what_is_wrong(tmp_path, text, message):
    with pytest.raises(SweepError, match=message):
        load_sweep(write(tmp_path, text))


def test_invalid_combinations_name_the_run(tmp_path):
    spec = load_sweep(write(tmp_path, "[grid]\nbatch_size = [4, 6]\nmicrobatches = [4]"))
    with pytest.raises(SweepError, match="batch_size=6,microbatches=4: batch_size 6 is not"):
        plan(spec, "", {})


def test_folder_states(tmp_path):
    spec = load_sweep(write(tmp_path, "[grid]\nseed = [0]"))
    (run,) = plan(spec, "", {})
    assert run.path == Path("runs/grid/seed=0")
    assert run.status() is Status.NEW
    run.path.mkdir(parents=True)
    assert run.status() is Status.NEW  # an empty folder
    (run.path / "notes.txt").write_text("mine")
    assert run.status() is Status.CONFLICT and "no config.json" in run.conflict()
    (run.path / "config.json").write_text(json.dumps({**run.config.to_dict(), "threads": 7}))
    assert run.status() is Status.PARTIAL  # threads, out and progress do not change results
    (run.path / "summary.json").write_text("{}")
    assert run.status() is Status.COMPLETE


def test_a_run_saved_before_the_partition_key_is_complete_for_a_grid_that_pins_blocks(tmp_path):
    """Such a run was split by partition=blocks, the default then: a grid that pins blocks finds
    it complete, one left at today's default (flops) finds another run in its folder (of two
    stages: one stage has nothing to split, and partition does nothing)."""
    for partition, status in (("blocks", Status.COMPLETE), ("flops", Status.CONFLICT)):
        base = f'[base]\npartition = "{partition}"\nstages = 2\n[grid]\nseed = [0]'
        spec = load_sweep(write(tmp_path, base))
        (run,) = plan(spec, "", {})
        finish(run, 2.0)
        saved = run.config.to_dict()
        del saved["partition"]
        (run.path / "config.json").write_text(json.dumps(saved))
        assert run.status() is status
        if status is Status.CONFLICT:
            assert "partition: folder has 'blocks', grid plans 'flops'" in run.conflict()
        shutil.rmtree(run.path)


def test_a_run_split_by_flops_is_complete_with_the_split_it_saved(tmp_path):
    """partition=flops (the default) resolves into stage_layers once the run knows its
    vocabulary: the folder holds the split, the grid plans the rule, and they are one run; an
    explicit split in the grid is compared as given."""
    spec = load_sweep(write(tmp_path, "[base]\nstages = 2\n[grid]\nseed = [0]"))
    (run,) = plan(spec, "", {})
    assert run.config.partition == "flops" and run.config.stage_layers is None
    finish(run, 2.0)
    (run.path / "config.json").write_text(
        json.dumps({**run.config.to_dict(), "stage_layers": [3, 1]})
    )
    assert run.status() is Status.COMPLETE
    spec = load_sweep(
        write(tmp_path, "[base]\nstages = 2\nstage_layers = [2, 2]\n[grid]\nseed = [0]")
    )
    (pinned,) = plan(spec, "", {})
    assert pinned.status() is Status.CONFLICT and "stage_layers" in pinned.conflict()


def test_config_file_and_command(tmp_path):
    spec = load_sweep(write(tmp_path, PHASED))
    (run,) = plan(spec, "pipeline", {})
    config_file = tmp_path / "run.toml"
    write_config_file(run, config_file)
    assert build_config(load_toml(config_file)) == run.config
    assert command(run, config_file) == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "nobubble",
        "train",
        "--config",
        str(config_file),
        "--auto-resume",
    ]


UNION = """
[[phase]]
name = "lr"
[[phase.grid]]
optim = ["adamw"]
lr = [1e-3, 3e-3, 1e-2]
[[phase.grid]]
optim = ["lion"]
lr = [1e-4, 3e-4, 1e-3]

[[phase]]
name = "main"
set = { lr = "best:lr" }
grid = { optim = ["adamw", "lion"] }
"""


def test_grid_tables_make_a_union_and_choices_are_reported(tmp_path):
    spec = load_sweep(write(tmp_path, UNION))
    runs = plan(spec, "lr", {})
    assert [r.name for r in runs] == [
        "optim=adamw,lr=0.001",
        "optim=adamw,lr=0.003",
        "optim=adamw,lr=0.01",
        "optim=lion,lr=0.0001",
        "optim=lion,lr=0.0003",
        "optim=lion,lr=0.001",
    ]
    for run, loss in zip(runs, [3.0, 2.0, 2.5, 3.0, 2.9, 2.8], strict=True):
        finish(run, loss)
    main = plan_phase(spec, spec.phase("main"), {"lr": runs}, finished_loss, lambda p: 1)
    assert [r.config.lr for r in main.runs] == [0.003, 0.001]
    adamw, lion = (c.describe() for c in main.choices)
    assert (
        adamw == "lr = best of lr for optim=adamw: 0.003 (mean final val loss 2.0000 over 1 runs)"
    )
    assert lion.startswith("lr = best of lr for optim=lion: 0.001 (mean final val loss 2.8000")
    assert lion.endswith("warning: at the edge of the values tried, a better one may lie beyond")


def test_grids_of_a_phase_must_not_repeat_a_run(tmp_path):
    text = "[[phase]]\nname = 'a'\n[[phase.grid]]\nseed = [0, 1]\n[[phase.grid]]\nseed = [1]"
    with pytest.raises(SweepError, match="its grids give these runs twice: seed=1"):
        load_sweep(write(tmp_path, text))


def test_bad_combinations_in_later_phases_stop_the_sweep_before_it_starts(tmp_path):
    text = PHASED.replace(
        'set = { lr = "best:lr_sweep" }', 'set = { lr = "best:lr_sweep", ef_gamma = -1 }'
    )
    with pytest.raises(SweepError, match="main/optim=adamw,setup=sync: ef_gamma must be >= 0"):
        call(sweep, "--config", str(write(tmp_path, text)), "--dry-run")
    assert not (tmp_path / "runs").exists()


# -- every run of the grid is checked before any starts ----------------------------------------

SMALL_BASE = "[base]\nd_model = 32\nn_layers = 4\nn_heads = 4\nn_kv_heads = 2\nd_ff = 64\n"


@pytest.fixture
def launches(monkeypatch) -> list:
    """Records the runs the sweep hands over for training (and trains none)."""
    started: list = []
    monkeypatch.setattr(sweep, "run_all", lambda runs, *rest: started.extend(runs) or [])
    return started


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("stages = [9]", "stages=9: cannot split 4 blocks over 9 stages"),  # the model's shape
        ("n_heads = [3]", "n_heads=3: d_model (32) must be divisible by n_heads (3)"),
        ("lr = [nan]", "lr=nan: lr must be positive (> 0) and finite, got nan"),
        (
            'tie_embeddings = [true]\nstages = [2]\nschedule = ["pipedream"]',
            "tie_embeddings=true,stages=2,schedule=pipedream: the head is tied",
        ),
    ],
)
def test_a_bad_value_in_the_17th_run_stops_the_sweep_before_any_run(
    tmp_path, launches, bad, message
):
    seeds = ", ".join(map(str, range(16)))
    grid = write(tmp_path, f"{SMALL_BASE}[[grid]]\nseed = [{seeds}]\n[[grid]]\n{bad}\n")
    with pytest.raises(SweepError, match=re.escape(message)):
        call(sweep, "--config", str(grid))
    assert launches == [] and not (tmp_path / "runs").exists()


TWO_PHASES = """
[[phase]]
name = "a"
set = { batch_size = 6 }
[phase.grid]
optim = ["adamw"]
microbatches = [1, 3]

[[phase]]
name = "b"
set = { batch_size = 8, microbatches = "best:a" }
[phase.grid]
optim = OPTIMS
"""


def test_best_values_are_checked_with_every_value_they_may_take(tmp_path, launches):
    grid = write(tmp_path, SMALL_BASE + TWO_PHASES.replace("OPTIMS", '["adamw"]'))
    with pytest.raises(SweepError) as caught:
        call(sweep, "--config", str(grid))
    message = str(caught.value)
    assert "b/optim=adamw" in message and "microbatches = 3 (from best:a)" in message
    assert "batch_size 8 is not divisible by microbatches 3" in message
    assert launches == []


def test_best_values_that_no_run_can_give_stop_the_sweep_before_it_starts(tmp_path, launches):
    grid = write(tmp_path, SMALL_BASE + TWO_PHASES.replace("OPTIMS", '["muon"]'))
    with pytest.raises(SweepError, match=re.escape("phase 'a' has no run with {'optim': 'muon'}")):
        call(sweep, "--config", str(grid))
    assert launches == []


def test_phases_left_out_with_phase_are_checked_too(tmp_path, launches):
    text = SMALL_BASE + "[[phase]]\nname = 'a'\ngrid = { seed = [0] }\n"
    text += "[[phase]]\nname = 'b'\ngrid = { eps = [0.0] }\n"
    with pytest.raises(SweepError, match=re.escape("b/eps=0.0: eps must be positive")):
        call(sweep, "--config", str(write(tmp_path, text)), "--phase", "a")
    assert launches == []


# -- a run the non-finite policy stopped is done: it counts as an infinite loss ----------------


def diverge(run: PlannedRun) -> None:
    """Make ``run``'s folder look like a run the non-finite policy stopped."""
    run.path.mkdir(parents=True)
    (run.path / "config.json").write_text(json.dumps(run.config.to_dict()))
    lines = [{"step": 0, "val_loss": 5.0}, {"step": 1, "train_loss": math.nan}]
    (run.path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = {"stopped": "non-finite", "steps": 1, "reason": "1 steps in a row ..."}
    (run.path / "summary.json").write_text(json.dumps(summary))


def test_a_run_that_diverged_in_an_earlier_session_is_done(tmp_path, launches, capsys):
    path = write(tmp_path, PHASED)
    spec = load_sweep(path)
    lr_sweep = plan(spec, "lr_sweep", {})
    for run in lr_sweep:
        if run.config.optim == "muon" and run.config.lr == 0.01:
            diverge(run)
        else:
            finish(run, 2.0 + run.config.lr)
    diverged = next(r for r in lr_sweep if r.path.name == "optim=muon,lr=0.01,seed=0")
    assert diverged.status() is Status.DIVERGED and finished_loss(diverged) == math.inf
    assert call(sweep, "--config", str(path), "--phase", "lr_sweep", "--dry-run") == 0
    out = capsys.readouterr().out
    assert "lr_sweep: 8 runs, 8 complete (2 diverged), 0 to run" in out
    assert "  diverged optim=muon,lr=0.01,seed=0" in out
    assert call(sweep, "--config", str(path), "--phase", "main") == 0  # not waiting for lr_sweep
    assert {r.config.lr for r in launches if r.config.optim == "muon"} == {0.001}
    assert (tmp_path / "runs" / "lr_sweep" / diverged.name).is_dir()  # never deleted


def test_an_output_root_that_cannot_hold_runs_stops_the_sweep_before_it_starts(tmp_path, launches):
    taken = tmp_path / "taken"
    taken.write_text("a file")
    grid = str(write(tmp_path, "[grid]\nseed = [0]"))
    with pytest.raises(ConfigError, match=re.escape(f"{taken} is not a folder")):
        call(sweep, "--config", grid, "--out", str(taken / "sweep"))
    assert launches == []
    assert (
        call(sweep, "--config", grid, "--out", str(taken / "sweep"), "--dry-run") == 0
    )  # writes nothing


def test_an_output_root_that_takes_no_files_stops_the_sweep_before_it_starts(
    tmp_path, launches, unwritable
):
    """``unwritable``: see conftest.lock_writes for how read-only is simulated."""
    grid = write(tmp_path, f"[sweep]\nout = '{unwritable / 'sweep'}'\n[grid]\nseed = [0]")
    given = f"{grid} [sweep] out {unwritable / 'sweep'}: cannot write in {unwritable}"
    with pytest.raises(ConfigError, match=re.escape(given)):
        call(sweep, "--config", str(grid))
    with pytest.raises(ConfigError, match=re.escape(f"--out {unwritable / 'x'}: cannot write")):
        call(sweep, "--config", str(grid), "--out", str(unwritable / "x"))
    assert launches == [] and list(unwritable.iterdir()) == []


def test_a_grid_varies_the_delay_correction(tmp_path):
    text = "[set]\nschedule = '2bw'\n[grid]\ncorrection = ['none', 'ef', 'nesterov', 'spike']"
    spec = load_sweep(write(tmp_path, text + "\noptim = ['adamw', 'muon']"))
    with pytest.raises(SweepError, match="correction=spike,optim=muon: correction spike: "):
        plan(spec, "", {})
    spec = load_sweep(write(tmp_path, text))
    runs = plan(spec, "", {})
    assert [run_name(r.config).split("-p1")[0] for r in runs] == [
        "tiny-adamw-2bw",
        "tiny-adamw-2bw-ef",
        "tiny-adamw-2bw-nesterov",
        "tiny-adamw-2bw-spike",
    ]
