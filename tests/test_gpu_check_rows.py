"""The GPU check's rows beyond parity (the smoke test, zero, P = 8, throughput, the audit of
synchronizations, what a machine skips) and how a row runs: within its own timeout, and past it
with the stacks of every process dumped before it is killed (on the CPU, with gloo: a real
pipeline made to hang)."""

import dataclasses
import json
import subprocess
import sys
import warnings

import pytest

from nobubble.cli import main
from nobubble.gpu_check.audit import AUDIT_STEP, audit_verdict, audited
from nobubble.gpu_check.plan import plan, row, skipped, write_plan
from nobubble.gpu_check.row import command, row_environment
from nobubble.gpu_check.runs import AUDIT, BITWISE, CLOSE, SMOKE, THROUGHPUT, TIMEOUTS, CheckRun
from nobubble.schedules import Action, ActionKind
from tests.helpers.commands import line_with
from tests.helpers.pipeline import env


def by_name(gpus: int) -> dict[str, CheckRun]:
    return {run.name: run for run in plan(gpus)}


@pytest.mark.parametrize(("gpus", "stages"), [(1, 2), (2, 2), (4, 4), (8, 8), (16, 8)])
def test_the_smoke_test_comes_first_and_puts_a_stage_on_every_gpu(gpus, stages):
    first = plan(gpus)[0]
    assert first.kind == SMOKE and first.reference is None
    assert (first.processes, first.setting("stages"), first.setting("steps")) == (
        stages,
        str(stages),
        "",  # one step: the base's
    )
    assert "steps=1" in first.base and "preset=tiny" in first.base
    assert first.schedule == "1f1b" and first.timeout_s == TIMEOUTS[SMOKE]
    assert ("dist_backend=nccl" in first.settings) is (gpus >= 2)


def test_rows_that_need_more_gpus_are_skipped_with_why():
    assert {s.name for s in skipped(1)} == {s.name for s in skipped(2)}
    why = {s.name: s.why for s in skipped(2)}
    assert why["1f1b-p2-dp2-zero1-nccl"] == (
        "needs 4 GPUs, a GPU per process on NCCL; this machine has 2"
    )
    assert {"1f1b-p2-dp2-zero2-nccl", "1f1b-p8-nccl", "2bw-p4-dp2-nccl"} <= why.keys()
    assert {s.name for s in skipped(4)} == {"2bw-p4-dp2-nccl", "1f1b-p8-nccl"}
    assert skipped(8) == []
    for gpus in (1, 2, 4, 8):  # a run is planned or skipped, never both
        assert not by_name(gpus).keys() & {s.name for s in skipped(gpus)}


def test_zero_rows_shard_over_two_replicas_and_eight_gpus_make_eight_stages():
    runs = by_name(4)
    for zero in (1, 2):
        run = runs[f"1f1b-p2-dp2-zero{zero}-nccl"]
        assert {f"zero={zero}", "dp=2", "stages=2", "dist_backend=nccl"} <= set(run.settings)
        assert (run.processes, run.gpus, run.expect) == (4, 4, CLOSE)
        assert run.reference == "one-process-sync"
    p8 = by_name(8)["1f1b-p8-nccl"]
    assert (p8.processes, p8.gpus, p8.expect) == (8, 8, BITWISE)


@pytest.mark.parametrize("gpus", [1, 2])
def test_one_throughput_row_long_enough_to_mean_something(gpus):
    (run,) = [run for run in plan(gpus) if run.kind == THROUGHPUT]
    base = dict(s.split("=", 1) for s in run.base)
    assert int(base["steps"]) >= 30 and int(base["seq_len"]) >= 1024
    assert base["preset"] == "smollm2-135m" and run.reference is None
    assert run.gpus == min(gpus, 2) and run.processes == (2 if gpus >= 2 else 0)


def test_each_run_has_a_timeout_of_its_own():
    runs = plan(8)
    assert all(0 < run.timeout_s <= max(TIMEOUTS.values()) for run in runs)
    assert by_name(8)["2bw-p2-nccl-compiled"].timeout_s > by_name(8)["2bw-p2-nccl"].timeout_s


def test_how_a_run_is_started(tmp_path):
    runs = by_name(2)
    reference = command(runs["one-process-sync"], tmp_path, "py")
    assert reference[:4] == ["py", "-m", "nobubble", "train"]
    assert reference[reference.index("--out") + 1] == str(tmp_path / "runs" / "one-process-sync")
    pipeline = command(runs["1f1b-p2-nccl"], tmp_path, "py")
    assert pipeline[:5] == [
        "py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
    ]
    assert pipeline[5:8] == ["-m", "nobubble", "train"] and pipeline[-1] == "dist_backend=nccl"
    audits = [run for run in runs.values() if run.kind == AUDIT]
    folders = set()
    for audit in audits:  # each audit row writes what it found into a folder of its own
        audit_command = command(audit, tmp_path, "py")
        start = audit_command.index("gpu-check")
        assert audit_command[start - 2 : start + 4] == [
            "-m",
            "nobubble",
            "gpu-check",
            "audit",
            str(tmp_path / "audit" / audit.name),
            "--",
        ]
        assert audit_command[start + 4] == "train"
        folders.add(audit_command[start + 2])
    assert len(folders) == len(audits) == 2


def test_an_moe_model_is_audited_with_routed_blocks_on_both_stages():
    """The grouped dispatch must read nothing on the host: the audit's MoE row routes blocks
    on each of its two stages (SmolLM2-360M's 32 blocks, cut in half)."""
    (moe,) = [run for run in by_name(2).values() if run.kind == AUDIT and "moe" in run.name]
    layers = json.loads(moe.setting("moe_layers"))
    assert int(moe.setting("moe_experts")) > int(moe.setting("moe_top_k")) >= 1
    assert moe.setting("stages") == "2" and moe.setting("dtype", "bfloat16") == "bfloat16"
    assert any(layer < 16 for layer in layers) and any(layer >= 16 for layer in layers)


def test_a_run_gets_the_first_gpus_and_the_fault_handler():
    run = by_name(4)["1f1b-p4-nccl"]
    assert row_environment(run, {"CUDA_VISIBLE_DEVICES": "3,5,6,7,1"})["CUDA_VISIBLE_DEVICES"] == (
        "3,5,6,7"
    )
    environment = row_environment(run, {})
    assert environment["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert environment["PYTHONFAULTHANDLER"] == "1"


# -- the audit ------------------------------------------------------------------------------------


def action(kind: ActionKind, step: int, stage: int = 0) -> Action:
    return Action(kind, stage=stage, microbatch=step * 4, version=step, step=step)


def test_the_audit_names_each_sync_by_action_and_line():
    """Only the actions of the audited step run in the debug mode; a warning that is not a
    sync is not one."""
    modes, found = [], []

    def execute(segment, act):
        if act.kind is ActionKind.F:
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)

    run = audited(execute, found, modes.append)
    run(None, action(ActionKind.F, AUDIT_STEP - 1))  # another step: not audited
    run(None, action(ActionKind.F, AUDIT_STEP, stage=1))
    run(None, action(ActionKind.B, AUDIT_STEP))
    assert modes == ["warn", "default", "warn", "default"]
    assert [a["action"] for a in found] == ["F4v1@s1", "B4v1@s0"]  # str(Action)
    (where,) = found[0]["syncs"]
    assert where.startswith(__file__) and found[1]["syncs"] == []


def test_the_audits_verdict(tmp_path):
    assert audit_verdict(tmp_path) == "failed"  # nothing audited: the run never got there
    clean = {"rank": 0, "actions": [{"action": "F4v1@s0", "syncs": []}]}
    (tmp_path / "rank_0.json").write_text(json.dumps(clean))
    assert audit_verdict(tmp_path) == "no sync in actions"
    synced = {"rank": 1, "actions": [{"action": "B4v1@s1", "syncs": ["comm.py:90"]}]}
    (tmp_path / "rank_1.json").write_text(json.dumps(synced))
    assert audit_verdict(tmp_path) == "SYNCS"


# -- a run that hangs --------------------------------------------------------------------------

CPU_BASE = ("d_model=32", "n_layers=4", "n_heads=4", "n_kv_heads=2", "d_ff=64", "seq_len=32")
CPU_BASE += ("batch_size=8", "eval_batches=1", "threads=1", "device=cpu", "dtype=float32")
CPU_BASE += ("steps=2", "p2p_timeout_s=600")  # the emulated connection waits that long
HUNG_S = 60.0


@pytest.mark.slow
def test_a_run_that_hangs_is_stopped_at_its_timeout_with_every_ranks_stacks(tmp_path):
    """Without the warm-up, 1F1B hangs at step 0 under the NCCL emulator, each rank in a first
    post that waits for the other's (tests/test_emulated_nccl.py): past the run's timeout each
    rank writes where it waits, then every process is stopped."""
    hung = dataclasses.replace(
        row("1f1b", 2, "emulated", extra=("p2p_warmup=false",)),
        name="hung",
        base=CPU_BASE,
        timeout_s=HUNG_S,
    )
    write_plan(tmp_path, 1, [hung], [])
    log = tmp_path / "hung.log"
    with log.open("w") as output:
        result = subprocess.run(
            [sys.executable, "-m", "nobubble", "gpu-check", "row", str(tmp_path), "hung"],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env(),
            timeout=HUNG_S + 120,
        )
    text = log.read_text()
    assert result.returncode == 124, text[-3000:]
    assert line_with(text, "gpu-check: hung:", f" {HUNG_S:g} s")  # the row, the timeout passed
    stacks = text.split("the Python stacks of ")[1:]
    assert sorted(s.split(" ")[1] for s in stacks) == ["0", "1"]  # rank 0, rank 1
    for stack in stacks:  # the fault handler's dump, down to the pipeline's wait
        assert "most recent call first" in stack and "nobubble/pipeline/" in stack, stack
    recorded = json.loads((tmp_path / "timeouts" / "hung.json").read_text())
    assert recorded["timeout_s"] == HUNG_S and len(recorded["stacks_of"]) == 2
    assert main(["gpu-check", "table", str(tmp_path)]) == 1  # timed out: a failure of the check
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["rows"][0]["parity"] == "timed out"
