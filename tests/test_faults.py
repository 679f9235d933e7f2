"""Faults in real processes: signals, a killed stage under torchrun, stuck peers, bad steps."""

import json
import os
import re
import signal
import subprocess

import pytest

from nobubble.faults.inject import workers
from tests.helpers.pipeline import SMALL, assert_same_run, env, nobubble, train_command
from tests.helpers.runs import LONG, steps_logged, wait_until

pytestmark = pytest.mark.slow

PIPE = ["schedule=2bw", "correction=ef", "stages=2", "microbatches=2"]


# make test sends the signal to torchrun (as a scheduler does); the one-process engine's stop
# and a signal to one rank alone (tests/test_data_parallel.py sends one) run in make test-all
ONE_SIGNAL = pytest.mark.extended
SIGNALLED = [
    pytest.param(0, "process", marks=ONE_SIGNAL),
    (2, "torchrun"),
    pytest.param(2, "last stage only", marks=ONE_SIGNAL),
]


@pytest.mark.parametrize(("stages", "target"), SIGNALLED)
def test_sigterm_saves_the_step_in_flight_and_resume_is_exact(
    tmp_path, in_background, stages, target
):
    """torchrun forwards a signal to every stage; one sent to the last stage alone (as when one
    node of a job is preempted) reaches rank 0 as that stage's stop vote."""
    settings = [*LONG, *(PIPE if stages else ["schedule=2bw", "correction=ef", "microbatches=2"])]
    proc = in_background(tmp_path / "cut", *settings, stages=stages)
    wait_until(lambda: steps_logged(tmp_path / "cut") >= 25)
    os.kill(workers(proc.pid)[1] if target == "last stage only" else proc.pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0, output
    launcher = "torchrun --nproc-per-node 2 -m nobubble" if stages else "nobubble"
    assert f"continue with: {launcher} train --resume {tmp_path / 'cut'}" in output
    # said once a launch, not once a rank; and the stop holds no process group past its close
    assert output.count("stopped at step") == 1 and "note:" not in output, output
    stopped = steps_logged(tmp_path / "cut")
    assert stopped < 150
    assert (tmp_path / "cut" / "checkpoints" / f"step_{stopped:06d}" / "manifest.json").is_file()
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert (summary["stopped"], summary["steps"]) == ("signal", stopped)

    resumed = train_command("--resume", str(tmp_path / "cut"), stages=stages)
    done = subprocess.run(resumed, capture_output=True, text=True, env=env(), timeout=300)
    assert done.returncode == 0, done.stderr
    nobubble(tmp_path / "full", *settings, stages=stages)
    assert_same_run(tmp_path / "full", tmp_path / "cut")


def test_a_killed_stage_restarts_and_finishes_with_the_same_weights(tmp_path, in_background):
    settings = [*LONG, *PIPE]
    proc = in_background(tmp_path / "cut", *settings, stages=2, torchrun_args=("--max-restarts=1",))
    wait_until(lambda: any((tmp_path / "cut" / "checkpoints").glob("step_*/manifest.json")))
    ranks = workers(proc.pid)
    assert set(ranks) == {0, 1}, ranks
    os.kill(ranks[1], signal.SIGKILL)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    assert "resuming step_" in output
    nobubble(tmp_path / "full", *settings, stages=2)
    assert_same_run(tmp_path / "full", tmp_path / "cut")


@pytest.mark.parametrize("stages", [0, 2])
def test_non_finite_gradients_abort_after_the_patience(tmp_path, stages):
    settings = ["lr=1e30", "grad_clip=0", "warmup_steps=0", "steps=20", "nonfinite_patience=3"]
    if stages:
        settings += ["stages=2", "schedule=1f1b", "microbatches=2"]
    result = nobubble(tmp_path / "r", *settings, stages=stages, check=False)
    assert result.returncode != 0
    assert "steps in a row had non-finite gradients" in result.stdout + result.stderr
    text = (tmp_path / "r" / "metrics.jsonl").read_text()
    lines = [json.loads(line) for line in text.splitlines()]
    skipped = [r["step"] for r in lines if r.get("skipped_stages")]
    assert len(skipped) >= 2  # the steps that went bad were skipped and logged
    last = re.search(r"last at step (\d+)", result.stderr).group(1)
    assert lines[-1]["step"] == int(last)  # the step that stopped the run too
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())  # the leader's
    assert (summary["stopped"], summary["steps"]) == ("non-finite", int(last))
    assert "gave up" not in result.stderr and "p2p_timeout_s" not in result.stderr  # no timeout


def test_a_world_size_that_does_not_match_the_stages_fails_before_any_work(tmp_path):
    result = nobubble(tmp_path / "r", "stages=3", stages=2, check=False)
    assert result.returncode != 0
    assert "2 processes" in result.stderr and "stages=3" in result.stderr
    assert "--nproc-per-node 3" in result.stderr  # the launch that fits
    assert not (tmp_path / "r").exists()


def _peer_that_never_sends(
    rank: int, port: int, timeout_s: float, leave: bool, waits_for: str, results
) -> None:
    """Rank 0 waits for a gradient (``waits_for="gradient"``) or for the evaluation totals'
    all-reduce with its replica (``"evaluation totals"``); rank 1 never sends or joins: it exits
    (``leave``), or it stays alive until rank 0 has given up (told through the store, not a
    sleep: a busy machine may stall rank 0 for seconds; and gloo closes the pair after the
    timeout, so no barrier)."""
    import datetime

    import torch
    import torch.distributed as dist

    from nobubble.layout import ParallelLayout
    from nobubble.pipeline.channels import Channel
    from nobubble.pipeline.comm import Messenger, PeerFailure
    from nobubble.pipeline.links import Links
    from nobubble.pipeline.replicas import ReplicaReduction

    limit = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=limit)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=limit)
    if rank == 0 and waits_for == "evaluation totals":
        replicas = ReplicaReduction(dist.group.WORLD, 2, timeout_s, "stage 1 of replica 0")
        try:
            replicas.sum_now(torch.zeros(4), "the evaluation totals of the other replicas")
        except PeerFailure as exc:
            results.put(str(exc))
    elif rank == 0:
        messenger = Messenger(ParallelLayout(pp=2, rank=rank), timeout_s, Links())
        try:
            messenger.recv(
                (2,),
                torch.float32,
                torch.device("cpu"),
                1,
                Channel.GRADIENT,
                7,
                "the gradient of microbatch 7 (step 3)",
            )
        except PeerFailure as exc:
            results.put(str(exc))
    if rank == 0 and not leave:
        store.set("given up", "1")
        store.wait(["seen"])  # rank 0 hosts the store: it stays until rank 1 has read it
    elif rank == 1 and not leave:
        store.wait(["given up"])
        store.set("seen", "1")
    dist.destroy_process_group()  # rank 1 with ``leave``: at once, closing its connections


def peer_failure_message(timeout_s: float, leave: bool, waits_for: str = "gradient") -> str:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    args = (port, timeout_s, leave, waits_for, results)
    mp.start_processes(_peer_that_never_sends, args=args, nprocs=2, start_method="spawn")
    return results.get()


def test_a_stage_that_waits_too_long_names_the_peer_and_the_message():
    message = peer_failure_message(timeout_s=1.0, leave=False)
    expected = "stage 0 gave up waiting for the gradient of microbatch 7 (step 3) from stage 1"
    assert expected in message
    assert "p2p_timeout_s" in message


def test_a_peer_that_exits_is_reported_as_gone_not_as_a_timeout():
    """A stage that aborted (non-finite loss, bad data) must not make its peers blame a timeout."""
    message = peer_failure_message(timeout_s=600.0, leave=True)
    expected = "stage 0 stopped waiting for the gradient of microbatch 7 (step 3) from stage 1"
    assert expected in message
    assert "stage 1 exited or crashed" in message
    assert "gave up" not in message and "p2p_timeout_s" not in message


def test_a_replica_that_never_joins_the_evaluation_all_reduce_is_a_timeout_naming_it():
    message = peer_failure_message(timeout_s=1.0, leave=False, waits_for="evaluation totals")
    assert message.startswith(
        "stage 1 of replica 0 stopped waiting for the evaluation totals of the other replicas: "
        "one of them exited, crashed or is stuck"
    )
    assert "raise p2p_timeout_s if it is only slow" in message


def marked_action(output: str, name: str) -> tuple[str, str]:
    """(the action the failure names, the text at its mark in its row) from the picture of the
    schedule a failure of ``name`` (``stage 0``) shows."""
    lines = output.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith(f"where {name} stopped: "))
    action = lines[head].split(": ", 1)[1].split(" ", 1)[0]
    assert lines[head + 1].startswith("F/B/I/W<microbatch>v<weight version>; . idle;")
    mark = next(i for i in range(head + 2, len(lines)) if set(lines[i].strip()) == {"^"})
    row = lines[mark - 1]
    assert row.startswith(f"s{name.split()[1]} ")
    return action, row[lines[mark].index("^") :]


def expected_mark(action: str) -> str:
    """What the picture draws where it marks ``action`` (as str(Action) writes it)."""
    if action.startswith("STEP"):
        return "|"
    kind, microbatch, version = re.match(r"([A-Z_]+?)(\d+)v(\d+)@", action).groups()
    kind = {"RECV_ACT": "F", "RECV_GRAD": "B"}.get(kind, kind)  # the compute the receive feeds
    return f"{kind}{microbatch}v{version}"


def test_a_stage_that_stops_answering_shows_where_the_leader_was_in_the_schedule(
    tmp_path, in_background
):
    """The last stage stops (SIGSTOP) mid-run: the leader gives up on it after p2p_timeout_s
    with the error it always gave (a peer failure, one line of the command's error), and below
    it the schedule around the action it was at, that action marked."""
    proc = in_background(tmp_path / "r", *LONG, *PIPE, "p2p_timeout_s=20", stages=2)
    wait_until(lambda: steps_logged(tmp_path / "r") >= 5)
    stuck = workers(proc.pid)[1]
    os.kill(stuck, signal.SIGSTOP)
    wait_until(lambda: 0 not in workers(proc.pid))  # the leader gave up and exited
    os.kill(stuck, signal.SIGKILL)  # else torchrun waits for it to take its SIGTERM
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "nobubble: error: stage 0 gave up waiting for " in output, output
    assert "stage 1 is stuck or died" in output and "p2p_timeout_s" in output  # who; the setting
    action, marked = marked_action(output, "stage 0")
    if action.startswith("SEND"):  # marked at the end of the compute it sends the result of
        assert marked
    else:
        assert marked.startswith(expected_mark(action)), (action, output)
    assert "Traceback" not in output.split("nobubble: error: stage 0")[1].split("\ns1 ")[0]


def _engine_that_fails(_: int, port: int, results) -> None:
    """A one-process pipeline whose first forward raises (its batch is not token ids); then one
    whose ``on_step`` raises: (type, message, notes) of each error."""
    import torch

    from nobubble.config import parse_overrides
    from nobubble.configure import build_config
    from nobubble.layout import ParallelLayout
    from nobubble.model.resolve import model_config
    from nobubble.pipeline import process_group
    from nobubble.pipeline.runtime import PipelineEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    process_group.open_process_group("gloo", torch.device("cpu"), 0, 1, 120.0, 120.0)
    cfg = build_config(parse_overrides(SMALL), {"schedule": "1f1b", "microbatches": 2})
    mc = model_config(cfg, 64)

    def engine() -> PipelineEngine:
        return PipelineEngine(cfg, mc, torch.device("cpu"), 1, ParallelLayout(pp=1, rank=0))

    def caught(*args) -> tuple[str, str, list[str]]:
        try:
            engine().run_steps(4, *args)
        except Exception as error:
            return type(error).__name__, str(error), getattr(error, "__notes__", [])
        raise AssertionError("no error")

    tokens = torch.zeros(cfg.batch_size, cfg.seq_len + 1, dtype=torch.long)

    def stop(stats) -> None:
        raise ValueError("the caller's own")

    results.put(caught(lambda: tokens.float(), lambda stats: None))
    results.put(caught(lambda: tokens, stop))
    process_group.close_process_group()


def test_an_action_that_raises_keeps_its_error_with_the_schedule_as_a_note():
    """An error inside an action (here a forward given no token ids) keeps its type and
    message; its traceback shows where in the schedule it happened. ``on_step``'s own error is
    not the pipeline's: it passes untouched."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_engine_that_fails, args=(port, results), nprocs=1, start_method="spawn")
    kind, message, notes = results.get()
    assert kind == "RuntimeError" and "Long" in message and "where" not in message
    (note,) = notes
    assert note.startswith("where stage 0 stopped: F0v0@s0 (step 1), marked ^ in the schedule")
    assert note.splitlines()[2].startswith("s0 F0v0") and note.splitlines()[3] == "   ^^^^^"
    assert results.get() == ("ValueError", "the caller's own", [])


def test_tied_embeddings_under_pipedream_are_refused_up_front(tmp_path):
    settings = ["stages=2", "tie_embeddings=true", "schedule=pipedream", "microbatches=1"]
    result = nobubble(tmp_path / "r", *settings, stages=2, check=False)
    assert result.returncode != 0
    assert "different versions of it; set tie_embeddings=false" in result.stderr
    assert not (tmp_path / "r").exists()


def _peak_left_out_after_training(_: int, port: int, results) -> None:
    """A one-process pipeline trains 2 steps, then more memory than its whole peak so far is
    touched and freed (what a checkpoint's gather can cost): (the stage report's peak, the
    process's peak), MB."""
    import torch

    from nobubble.config import parse_overrides
    from nobubble.configure import build_config
    from nobubble.engine import peak_memory_mb
    from nobubble.layout import ParallelLayout
    from nobubble.model.resolve import model_config
    from nobubble.pipeline import process_group
    from nobubble.pipeline.runtime import PipelineEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    process_group.open_process_group("gloo", torch.device("cpu"), 0, 1, 120.0, 120.0)
    cfg = build_config(parse_overrides(SMALL), {"schedule": "1f1b", "microbatches": 2})
    engine = PipelineEngine(
        cfg, model_config(cfg, 64), torch.device("cpu"), 1, ParallelLayout(pp=1, rank=0)
    )
    tokens = torch.randint(0, 64, (cfg.batch_size, cfg.seq_len + 1))
    engine.run_steps(2, lambda: tokens, lambda stats: None)
    # more than the whole peak so far, every page written: the process's peak must rise past it
    after_training = torch.ones(int(engine.train_peak_mb + 300) * 2**18)  # float32: MB * 2**18
    del after_training
    (report,) = engine.stage_reports(digests=False)
    results.put((report["peak_mem_mb"], peak_memory_mb(torch.device("cpu"))))
    process_group.close_process_group()


def test_a_stage_reports_the_peak_of_its_training_not_of_what_came_after():
    """The stage report's peak memory is the high-water mark at the end of the latest training
    segment: the final checkpoint, saved after it (under zero, replica 0 gathers the whole
    state), does not count as training's (the bench's memory pass reads it)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _peak_left_out_after_training, args=(port, results), nprocs=1, start_method="spawn"
    )
    reported, process = results.get()
    assert 0 < reported < process - 300, (reported, process)
