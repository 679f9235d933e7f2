"""The CPU side of scripts/gpu_check.sh (`nobubble gpu-check`): which runs a machine with N GPUs
gets, how a run compares with its reference, and the table and JSON made from run folders. The
script itself needs a GPU; its runs here are the same rows on a small model on the CPU, where
every row must equal its reference bit for bit (the claim the plan's references rest on)."""

import json

import pytest
import torch

from nobubble.cli import main
from nobubble.gpu_check.parity import Outcome, compare, parity, verdict
from nobubble.gpu_check.plan import plan, skipped
from nobubble.gpu_check.runs import BITWISE, CLOSE, EMULATED, REPEATS, TRAINING, CheckRun
from nobubble.schedules.registry import PIPELINE_SCHEDULES, schedule_spec
from tests.helpers.pipeline import EXTENDED, nobubble


def by_name(gpus: int) -> dict[str, CheckRun]:
    return {run.name: run for run in plan(gpus)}


def gpu_check(*argv: str) -> int:
    """``nobubble gpu-check ARGV``, as the script runs it."""
    return main(["gpu-check", *argv])


def test_the_steps_are_a_subcommand_of_nobubble(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["gpu-check", "--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert usage.startswith("usage: nobubble gpu-check ")
    assert "{plan,row,audit,compare,table}" in usage


def test_no_gpu_no_run():
    assert plan(0) == []


def test_one_gpu_runs_every_schedule_with_its_processes_sharing_the_gpu_over_emulated_nccl():
    runs = plan(1)
    rows = [run for run in runs if run.reference and not run.name.startswith("one-process")]
    assert {run.schedule for run in rows if run.name.endswith("-gloo")} == set(PIPELINE_SCHEDULES)
    for run in rows:
        assert (run.processes, run.gpus) == (2, 1)
        assert "dist_backend=gloo" in run.settings
        assert ("emulate_nccl=true" in run.settings) is not run.name.endswith("-plain")
    assert "2bw-p2-gloo-plain" in {run.name for run in rows}  # gloo's own order and sums
    assert runs[-1].name == "2bw-p2-gloo-compiled" and runs[-1].expect == CLOSE
    assert {"compile=true", "activation_checkpointing=true"} <= set(runs[-1].settings)


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_every_reference_runs_before_the_rows_compared_with_it(gpus):
    seen = set()
    for run in plan(gpus):
        assert run.reference is None or run.reference in seen, run.name
        assert run.gpus <= gpus, run.name
        seen.add(run.name)
    assert by_name(gpus)["one-process-2bw-again"].reference == "one-process-2bw"


def test_two_gpus_add_nccl_for_every_schedule_and_share_a_gpu_once():
    runs = by_name(2)
    for schedule in PIPELINE_SCHEDULES:
        nccl = runs[f"{schedule}-p2-nccl"]
        assert (nccl.processes, nccl.gpus) == (2, 2) and "dist_backend=nccl" in nccl.settings
    assert [name for name in runs if "gloo" in name] == ["2bw-p2-gloo"]  # emulated NCCL
    assert "emulate_nccl=true" in runs["2bw-p2-gloo"].settings
    assert "1f1b-p4-nccl" not in runs and "2bw-p2-dp2-nccl" not in runs


def test_eight_gpus_add_four_stages_and_data_parallel_rows():
    runs = by_name(8)
    assert runs["1f1b-p4-nccl"].gpus == 4 and runs["1f1b-p4-nccl"].reference == "one-process-sync"
    assert runs["2bw-p2-dp2-nccl"].gpus == 4 and runs["2bw-p2-dp2-nccl"].expect == CLOSE
    assert runs["2bw-p4-dp2-nccl"].gpus == 8 and "dp=2" in runs["2bw-p4-dp2-nccl"].settings
    assert runs["pipedream-p2-nccl"].reference == "one-process-pipedream"
    assert "tie_embeddings=false" in runs["pipedream-p2-nccl"].settings  # pipedream: untied


def test_the_references_and_shapes_follow_the_schedule_registry():
    """A schedule that flushes is compared with sync, one that does not with itself in one
    process; untied where its first and last stages' delays differ (the reference alike); one
    microbatch a step where every microbatch is a step."""
    runs = by_name(1)
    for name in PIPELINE_SCHEDULES:
        spec, run = schedule_spec(name), runs[f"{name}-p2-gloo"]
        untied = "tie_embeddings=false" in run.settings
        assert untied is not spec.pipeline_can_tie(2 * spec.default_chunks), name
        sync = "one-process-sync-untied" if untied else "one-process-sync"
        assert run.reference == (sync if spec.flushes else f"one-process-{name}")
        assert ("tie_embeddings=false" in runs[run.reference].settings) is untied, name
        assert run.setting("microbatches") == ("1" if spec.step_per_microbatch else "4"), name
    assert runs["one-process-sync"].schedule == schedule_spec("sync").same_as
    for name in ("zb-v", "dualpipev"):  # V: tied embeddings refused under torchrun
        assert runs[f"{name}-p2-gloo"].reference == "one-process-sync-untied"
    assert runs["one-process-sync-untied"].schedule == "1f1b"


def test_the_plan_the_script_reads(tmp_path, capsys):
    assert gpu_check("plan", "--gpus", "1", "--out", str(tmp_path / "check")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(plan(1))
    assert lines[0].startswith("smoke-1f1b-p2-gloo 2 1 - preset=tiny ")  # the smoke test first
    # then the references (sync, sync untied for the V schedules, 2bw, pipedream), 2bw again
    name, processes, gpus, reference, *settings = lines[6].split(" ")
    assert (name, processes, gpus, reference) == ("gpipe-p2-gloo", "2", "1", "one-process-sync")
    assert settings[0] == "preset=smollm2-360m" and settings[-2:] == [
        "dist_backend=gloo",
        "emulate_nccl=true",
    ]
    assert all("=" in setting for setting in settings)
    saved = json.loads((tmp_path / "check" / "plan.json").read_text())
    assert [run["name"] for run in saved["runs"]] == [run.name for run in plan(1)]


def outcome(losses: list[float], **weights: float) -> Outcome:
    return Outcome(losses, {name: torch.tensor([value]) for name, value in weights.items()})


def test_parity_says_how_far_a_run_is_from_its_reference():
    reference = outcome([2.0, 1.0], a=1.0, b=2.0)
    same = parity(outcome([2.0, 1.0], a=1.0, b=2.0), reference)
    assert same == {
        "losses_equal": True,
        "weights_equal": True,
        "max_loss_rel_gap": 0.0,
        "max_weight_gap": 0.0,
    }
    apart = parity(outcome([2.0, 1.001], a=1.0, b=2.5), reference)
    assert not apart["losses_equal"] and not apart["weights_equal"]
    assert apart["max_loss_rel_gap"] == pytest.approx(1e-3) and apart["max_weight_gap"] == 0.5
    other = parity(outcome([2.0], a=1.0), reference)  # fewer losses, another parameter set
    assert other["max_loss_rel_gap"] is None and other["max_weight_gap"] is None
    assert verdict(other, CLOSE, None) == "DIFFERS"


def test_verdicts_by_what_a_row_expects_and_the_gpus_repeatability():
    exact = {"losses_equal": True, "weights_equal": True}
    assert verdict({**exact, "max_loss_rel_gap": 0.0, "max_weight_gap": 0.0}, "bitwise", None) == (
        "bitwise"
    )
    near = {"losses_equal": False, "weights_equal": False, "max_weight_gap": 1e-3}
    assert verdict({**near, "max_loss_rel_gap": 1e-6}, "bitwise", None) == "DIFFERS"
    assert verdict({**near, "max_loss_rel_gap": 1e-6}, "bitwise", 1e-7) == "within noise"
    assert verdict({**near, "max_loss_rel_gap": 1e-5}, "bitwise", 1e-7) == "DIFFERS"
    assert verdict({**near, "max_loss_rel_gap": 5e-3}, CLOSE, None) == "close"
    assert verdict({**near, "max_loss_rel_gap": 5e-2}, CLOSE, None) == "DIFFERS"
    assert verdict({**near, "max_loss_rel_gap": 5e-2}, REPEATS, None) == "noise floor"
    assert verdict(None, "bitwise", None) == "failed"


def fake_run(out, name: str, tokens_per_s: float, peaks: list[float], finished: bool = True):
    """A run folder as far as the table reads it: summary.json (a pipeline's: a report per
    process)."""
    folder = out / "runs" / name
    folder.mkdir(parents=True)
    summary = {
        "stopped": "finished" if finished else "error",
        "tokens_per_s": tokens_per_s,
        "model_tflops": 99.0,
        "peak_tflops": 990.0,
        "peak_mem_mb": peaks[0],
    }
    if len(peaks) > 1:
        summary["stages"] = [{"pp_rank": i, "peak_mem_mb": p} for i, p in enumerate(peaks)]
    (folder / "summary.json").write_text(json.dumps(summary))


def fake_parity(out, name: str, **gaps) -> None:
    (out / "parity").mkdir(exist_ok=True)
    (out / "parity" / f"{name}.json").write_text(json.dumps({"run": name, **gaps}))


def test_the_table_and_its_json_from_run_folders(tmp_path, capsys):
    out = tmp_path / "check"
    gpu_check("plan", "--gpus", "1", "--out", str(out))
    fake_run(out, "one-process-sync", 1000.0, [5000.0])
    fake_run(out, "one-process-2bw", 900.0, [6000.0])
    fake_run(out, "one-process-2bw-again", 900.0, [6000.0])
    fake_run(out, "gpipe-p2-gloo", 800.0, [3000.0, 3500.0])
    fake_run(out, "1f1b-p2-gloo", 700.0, [3000.0, 3100.0])
    fake_run(out, "2bw-p2-gloo", 0.0, [10.0], finished=False)
    repeat = {"losses_equal": False, "weights_equal": False, "max_weight_gap": 1e-4}
    fake_parity(out, "one-process-2bw-again", **repeat, max_loss_rel_gap=1e-6)
    exact = {"losses_equal": True, "weights_equal": True}
    fake_parity(out, "gpipe-p2-gloo", **exact, max_loss_rel_gap=0.0, max_weight_gap=0.0)
    fake_parity(out, "1f1b-p2-gloo", **repeat, max_loss_rel_gap=3e-4)  # 300x the noise
    fake_parity(out, "2bw-p2-gloo", failed="the run did not finish")
    capsys.readouterr()

    assert gpu_check("table", str(out)) == 1  # a row differs, one failed
    printed = capsys.readouterr().out
    rows = {row["run"]: row for row in json.loads((out / "table.json").read_text())["rows"]}
    assert rows.keys() == {run.name for run in plan(1)} | {s.name for s in skipped(1)}
    assert rows["1f1b-p8-nccl"]["parity"].startswith("skipped: needs 8 GPUs")
    assert not rows["1f1b-p8-nccl"]["failed"]
    assert rows["one-process-sync"]["parity"] == "reference"
    assert not rows["one-process-sync"]["failed"]
    assert rows["one-process-pipedream"]["parity"] == "not run"  # no folder: out of time
    assert not rows["one-process-pipedream"]["failed"]
    assert rows["one-process-2bw-again"]["parity"] == "noise floor"  # no failure: a fact
    assert not rows["one-process-2bw-again"]["failed"]
    gpipe = rows["gpipe-p2-gloo"]
    assert (gpipe["parity"], gpipe["failed"]) == ("bitwise", False)
    assert gpipe["reference"] == "one-process-sync"
    assert gpipe["peak_mem_mb"] == 3500.0  # the larger of its two processes'
    assert gpipe["mfu"] == pytest.approx(0.1)  # 99 / (990 x 1 GPU): its processes share one
    assert gpipe["tokens_per_s"] == 800.0 and (gpipe["stages"], gpipe["dp"]) == (2, 1)
    assert rows["1f1b-p2-gloo"]["parity"] == "DIFFERS" and rows["1f1b-p2-gloo"]["failed"]
    assert rows["2bw-p2-gloo"]["parity"] == "failed" and rows["2bw-p2-gloo"]["failed"]
    assert rows["2bw-p2-gloo"]["mfu"] is None
    assert rows["zb-h1-p2-gloo"]["parity"] == "not run"
    assert printed.startswith("| run | transport | GPUs | parity (vs reference) |")
    gpipe_line = "| gpipe-p2-gloo | gloo, emulated NCCL, one GPU shared | 1 | bitwise (vs "
    gpipe_line += "one-process-sync) | 0.0e+00 | 800 | 10.0% | 3,500 |"
    assert gpipe_line in printed.splitlines()


def error_of(capsys, *argv: str) -> str:
    assert gpu_check(*argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("nobubble: error: ") and err.count("\n") == 1, err
    return err


def test_a_folder_without_a_plan_or_run_is_one_line(tmp_path, capsys):
    assert "plan.json is missing; write it with" in error_of(capsys, "table", str(tmp_path))
    assert "plan.json is missing" in error_of(capsys, "compare", str(tmp_path), "gpipe-p2-gloo")
    (tmp_path / "plan.json").write_text('{"gpus": 1}')
    assert "plan.json is damaged" in error_of(capsys, "table", str(tmp_path))
    gpu_check("plan", "--gpus", "1", "--out", str(tmp_path))
    assert "nope is not a run of" in error_of(capsys, "compare", str(tmp_path), "nope")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_outputs_that_cannot_be_written_are_one_line(tmp_path, capsys, lock_writes):
    """Under a regular file, or in a folder that takes no files (``lock_writes``: see conftest
    for how read-only is simulated): refused before any work, nothing written."""
    (tmp_path / "file").write_text("keep")
    err = error_of(capsys, "plan", "--gpus", "1", "--out", str(tmp_path / "file" / "check"))
    assert f"--out {tmp_path / 'file' / 'check'}: " in err
    out = tmp_path / "check"
    gpu_check("plan", "--gpus", "1", "--out", str(out))
    lock_writes(out)
    assert f"OUT {out / 'table.json'}: cannot write in {out}" in error_of(capsys, "table", str(out))
    err = error_of(capsys, "compare", str(out), "gpipe-p2-gloo")
    assert f"OUT {out / 'parity'}: cannot write in {out}" in err
    assert sorted(p.name for p in out.iterdir()) == ["plan.json"]
    assert (tmp_path / "file").read_text() == "keep"


# On the CPU the plan's rows run on a small model with tied embeddings (pipedream's rows untied,
# as the plan has them; NCCL's rows on gloo under the emulator): each equals its reference bit for
# bit, which is what lets the check compare every synchronous schedule, on any number of stages,
# with one-process 1F1B on two stages. zb-h2 (the split backward, the next step's forwards among
# the W's) and interleaved-1f1b (four model stages, tied copies on stages 0 and 3) in make test;
# the others repeat paths it covers.
CPU_MODEL = ("tie_embeddings=true", "device=cpu", "dtype=float32")
CPU_ROWS = [
    pytest.param(run.name, marks=[] if run.schedule in ("zb-h2", "interleaved-1f1b") else EXTENDED)
    for run in plan(1)
    if run.reference and run.expect == BITWISE
] + [pytest.param("1f1b-p4-nccl", marks=EXTENDED)]


def on_the_cpu(settings: tuple[str, ...]) -> list[str]:
    nccl = "dist_backend=nccl"
    emulated = list(EMULATED) if nccl in settings else []
    return [s for s in settings if s != nccl] + emulated


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_ROWS)
def test_each_row_equals_its_reference_bit_for_bit_on_the_cpu(tmp_path, name):
    gpus = 8 if name.endswith("nccl") else 1
    gpu_check("plan", "--gpus", str(gpus), "--out", str(tmp_path))
    runs = by_name(gpus)
    for run in (runs[runs[name].reference], runs[name]):
        settings = [*CPU_MODEL, *TRAINING, *on_the_cpu(run.settings)]
        nobubble(tmp_path / "runs" / run.name, *settings, stages=run.processes)
    result = compare(tmp_path, name)
    assert verdict(result, runs[name].expect, None) == "bitwise", result
    assert json.loads((tmp_path / "parity" / f"{name}.json").read_text()) == result
