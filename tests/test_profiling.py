"""``profile_steps=A:B``: a torch.profiler trace of exactly those steps, labelled by action."""

import contextlib
import json
import re
from pathlib import Path

import pytest
import torch

from nobubble.cli import main
from nobubble.config import ConfigError, TrainConfig, profile_range
from nobubble.profiling import StepProfiler, action_label, free_path, label, steps_to_trace
from nobubble.schedules import Action, ActionKind
from tests.helpers.commands import line_with
from tests.helpers.pipeline import SMALL, assert_same_run, nobubble

# Two microbatches a step: step n (from 1) runs microbatches 2n-2 and 2n-1.
SETTINGS = [*SMALL, "schedule=2bw", "stages=2", "microbatches=2", "eval_every=0"]


def labels(trace: Path) -> list[str]:
    """The names of the ranges nobubble put on a trace, in time order."""
    events = json.loads(trace.read_text())["traceEvents"]
    ours = [e for e in events if e.get("cat") == "user_annotation"]
    return [e["name"] for e in sorted(ours, key=lambda e: e["ts"])]


def compute(names: list[str], kind: str) -> list[str]:
    return [n for n in names if n.startswith(f"{kind} mb")]


def test_labels_are_a_shared_no_op_unless_a_trace_records(tmp_path):
    action = Action(ActionKind.F, stage=0, microbatch=5, version=1, step=2)
    null = label("F mb5 v1")
    assert isinstance(null, contextlib.nullcontext)
    assert action_label(action) is null  # nothing is built, nothing reaches torch's profiler
    profiler = StepProfiler(range(1, 2), tmp_path, torch.device("cpu"))
    profiler.before_step(0)
    try:
        assert isinstance(label("x"), torch.profiler.record_function)
        assert isinstance(action_label(action), torch.profiler.record_function)
        back = Action(ActionKind.B, 3, 4, 1, 2)
        pair = action_label(Action(ActionKind.FB, 0, 5, 1, 2, paired=back))
        assert pair.name == "F mb5 v1 & B mb4 v1"  # an overlapped F&B names both halves
        receive = Action(ActionKind.RECV_ACT, 1, 5, 1, 2, peer=0)
        assert action_label(receive) is null  # its wait is labelled where the data is used
    finally:
        profiler.close()
    assert label("x") is null


def test_a_range_past_the_last_step_is_refused_before_anything_runs():
    assert profile_range(TrainConfig(steps=10, profile_steps="9:10")) == range(9, 11)
    with pytest.raises(ConfigError, match=r"reaches past the run's last step \(steps=10\)"):
        profile_range(TrainConfig(steps=10, profile_steps="9:11"))


def test_a_resumed_session_traces_only_the_steps_it_trains():
    assert steps_to_trace(range(3, 6), done=0) == range(3, 6)
    assert steps_to_trace(range(3, 6), done=3) == range(4, 6)
    assert not steps_to_trace(range(3, 6), done=5)
    assert not steps_to_trace(None, done=0)


def test_a_trace_never_replaces_a_file(tmp_path):
    (tmp_path / "trace-steps2-3.json").write_text("{}")
    (tmp_path / "trace-steps2-3-2.json").write_text("{}")
    assert free_path(tmp_path, "trace-steps2-3") == tmp_path / "trace-steps2-3-3.json"


def test_one_process_traces_exactly_the_steps_asked_for_also_after_a_resume(tmp_path, capsys):
    run = tmp_path / "run"
    main(["train", "--no-progress", "--out", str(run), *SETTINGS, "steps=2", "profile_steps=1:2"])
    first = labels(run / "profile" / "trace-steps1-2.json")
    assert compute(first, "F") == ["F mb0 v0", "F mb1 v0", "F mb2 v0", "F mb3 v0"]
    assert compute(first, "B") == ["B mb0 v0", "B mb1 v0", "B mb2 v0", "B mb3 v0"]
    assert [n for n in first if n.startswith("STEP")] == ["STEP v1", "STEP v2"]
    assert "evaluate" not in first  # the final evaluation comes after step 2's update

    # resumed after step 2: step 3 warms the profiler up (discarded), step 4 is recorded
    main(["train", "--no-progress", "--resume", str(run), "steps=4", "profile_steps=4:4"])
    names = labels(run / "profile" / "trace-steps4-4.json")
    assert compute(names, "F") == ["F mb6 v2", "F mb7 v2"]  # 2bw: step n computes with version n-2
    assert [n for n in names if n.startswith("STEP")] == ["STEP v4"]

    # resumed after step 4 and asked for 4..5: step 4 is in the trace of the last session
    main(["train", "--no-progress", "--resume", str(run), "steps=5", "profile_steps=4:5"])
    assert line_with(capsys.readouterr().err, "steps 4..4", "before the checkpoint")
    names = labels(run / "profile" / "trace-steps5-5.json")
    assert compute(names, "F") == ["F mb8 v3", "F mb9 v3"]
    assert sorted(p.name for p in (run / "profile").iterdir()) == [
        "trace-steps1-2.json",
        "trace-steps4-4.json",
        "trace-steps5-5.json",
    ]


@pytest.mark.slow
def test_every_pipeline_stage_traces_its_actions_and_waits(tmp_path):
    """A 2-stage 2bw pipeline, step 3 of 3 (step 2 warms up): stage 1 runs exactly step 3's
    forwards and backwards; stage 0 starts with its first action of step 3, before the last
    backward of step 2 (the steps overlap under 2bw).

    The same run (with EF and activation checkpointing) is the pipeline's activation
    checkpointing test: it must equal the plain simulation bit for bit, profiled or not."""
    run, plain = tmp_path / "run", tmp_path / "plain"
    settings = [*SETTINGS[len(SMALL) :], "correction=ef", "steps=3"]
    nobubble(run, *settings, "activation_checkpointing=true", "profile_steps=3:3", stages=2)
    main(["train", "--no-progress", "--out", str(plain), *SMALL, *settings])
    assert_same_run(run, plain)
    folder = run / "profile"
    assert sorted(p.name for p in folder.iterdir()) == [
        "trace-steps3-3-stage0-replica0.json",
        "trace-steps3-3-stage1-replica0.json",
        "trace-steps3-3.json",  # both stages on one timeline
    ]
    merged = json.loads((folder / "trace-steps3-3.json").read_text())["traceEvents"]
    processes = [e for e in merged if e.get("ph") == "M" and e["name"] == "process_name"]
    assert [e["args"]["name"] for e in processes] == ["stage 0 replica 0", "stage 1 replica 0"]
    first = labels(folder / "trace-steps3-3-stage0-replica0.json")
    last = labels(folder / "trace-steps3-3-stage1-replica0.json")
    assert compute(last, "F") == ["F mb4 v1", "F mb5 v1"]
    assert compute(last, "B") == ["B mb4 v1", "B mb5 v1"]
    assert compute(first, "F") == ["F mb4 v1", "F mb5 v1"]
    assert compute(first, "B") == ["B mb3 v0", "B mb4 v1", "B mb5 v1"]
    # each STEP action, then (since the update follows where the version is needed) its update
    assert [n for n in first if re.fullmatch(r"STEP v\d+", n)] == ["STEP v2", "STEP v3"]
    assert [n for n in last if re.fullmatch(r"STEP v\d+", n)] == ["STEP v3"]
    assert any(re.fullmatch(r"STEP v\d+ update", n) for n in first)
    assert "SEND_ACT mb4 -> s1" in first and "SEND_GRAD mb4 -> s0" in last
    assert "wait activation mb4 from stage 0" in last
    assert "wait gradient mb4 from stage 1" in first
    assert "wait stats step 3 from stage 1" in first
    assert "wait control step 3 from stage 0" in last  # the go-ahead for the step
