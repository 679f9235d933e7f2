"""One rule for stopping (nobubble.children): a command that started processes passes SIGTERM and
Ctrl-C on to them, waits a bounded time for them to checkpoint and exit, kills what is left of
their trees, and exits 128 + the signal with one line; no process outlives it. The rule on
made-up children first, then for each command that starts processes: sweep, bench and the GPU
check's steps."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nobubble.children import Identity, alive, descendants, identity, stopping
from nobubble.cli import main
from nobubble.interrupt import Interrupted
from tests.helpers.runs import steps_logged, wait_until

REPO = Path(__file__).resolve().parents[1]
# A child that records each signal it gets and exits on it (the shell runs a trap between
# commands, so it sleeps in short naps).
TAKES_SIGNALS = """
trap 'echo TERM >> {log}; exit 3' TERM
trap 'echo INT >> {log}; exit 4' INT
echo ready >> {log}
while :; do sleep 0.05; done
"""
# A child that ignores both, with a grandchild in a session of its own (as torchrun's workers):
# three processes once it is ready.
IGNORES_SIGNALS = """
trap '' TERM INT
setsid sleep 600 &
sleep 600
"""


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def none_alive(processes: set[Identity]) -> bool:
    return not any(map(alive, processes))


def tree(pid: int) -> set[Identity]:
    """``pid`` and every process below it, as they are now."""
    own = identity(pid)
    return descendants(pid) | ({own} if own else set())


# -- the rule ------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_passes_the_same_signal_on_and_waits_for_the_child_to_exit(tmp_path, signum):
    log = tmp_path / "child.log"
    with pytest.raises(Interrupted) as stop, stopping("cmd", "go on", grace_s=120) as children:
        child = children.start(["sh", "-c", TAKES_SIGNALS.format(log=log)])
        wait_until(lambda: lines(log) == ["ready"])
        os.kill(os.getpid(), signum)
        time.sleep(60)  # the signal's handler raises before this ends
    assert stop.value.signum == signum
    assert f"cmd: stopped by {signal.Signals(signum).name}; 1 run stopped" in str(stop.value)
    assert lines(log) == ["ready", signal.Signals(signum).name[3:]]  # once, and not killed
    assert child.returncode == {signal.SIGTERM: 3, signal.SIGINT: 4}[signum]


def test_what_outlives_the_grace_period_is_killed_in_every_session_of_the_tree():
    with pytest.raises(Interrupted), stopping("cmd", "go on", grace_s=0.5) as children:
        child = children.start(["sh", "-c", IGNORES_SIGNALS])
        wait_until(lambda: len(tree(child.pid)) >= 3)  # the shell and its two sleeps
        seen = tree(child.pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
    wait_until(lambda: none_alive(seen), timeout=60)
    assert child.returncode == -signal.SIGKILL


def test_a_second_ctrl_c_ends_the_wait_at_once():
    """As in `nobubble train`: Ctrl-C again does not wait for the checkpoint."""
    watchdog = threading.Event()

    def second_ctrl_c() -> None:
        wait_until(lambda: children.signum is not None, timeout=60)
        os.kill(os.getpid(), signal.SIGINT)
        if not done.wait(120):  # a generous bound: without the abort, the wait is an hour
            watchdog.set()
            for pid, _ in filter(alive, seen):
                os.kill(pid, signal.SIGKILL)

    done = threading.Event()
    with pytest.raises(Interrupted), stopping("cmd", "go on", grace_s=3600) as children:
        child = children.start(["sh", "-c", IGNORES_SIGNALS])
        wait_until(lambda: len(tree(child.pid)) >= 3)  # its trap is set
        seen = tree(child.pid)
        threading.Thread(target=second_ctrl_c, daemon=True).start()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(60)
    done.set()
    assert not watchdog.is_set() and child.returncode == -signal.SIGKILL


def test_no_child_outlives_a_command_that_fails(tmp_path):
    log = tmp_path / "child.log"
    with pytest.raises(RuntimeError, match="a bug"), stopping("cmd", "go on") as children:
        child = children.start(["sh", "-c", TAKES_SIGNALS.format(log=log)])
        wait_until(lambda: lines(log) == ["ready"])
        raise RuntimeError("a bug")
    assert lines(log) == ["ready", "TERM"] and child.returncode == 3


def test_the_command_line_for_scripts_passes_the_exit_status_on_and_times_out_with_124(tmp_path):
    helper = [sys.executable, "-m", "nobubble.children", "--grace", "0.5"]
    done = subprocess.run([*helper, "--", "sh", "-c", "exit 7"], capture_output=True)
    assert done.returncode == 7
    pid_file = tmp_path / "pid"
    child = f"echo $$ > {pid_file}; {IGNORES_SIGNALS}"
    done = subprocess.run(
        [*helper, "--timeout", "1", "--", "sh", "-c", child], capture_output=True, text=True
    )
    assert done.returncode == 124 and "timeout" in done.stderr
    assert identity(int(pid_file.read_text())) is None
    refused = subprocess.run([*helper, "--timeout", "-1", "--", "true"], capture_output=True)
    assert refused.returncode == 2 and b"--timeout" in refused.stderr


# -- each command that starts processes ------------------------------------------------------------

TOY = [
    "d_model=32", "n_layers=2", "n_heads=2", "n_kv_heads=1", "d_ff=64", "seq_len=32",
    "batch_size=4", "eval_every=0", "eval_batches=1", "warmup_steps=1", "threads=1",
]  # fmt: skip


def _default_interrupt() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Launched:
    """The commands a test starts, each in a session of its own, and every process seen below
    them; what is left of them when the test ends (one that failed) is killed."""

    def __init__(self) -> None:
        self.commands: list[subprocess.Popen] = []
        self.seen: set[Identity] = set()

    def start(self, argv: list[str]) -> subprocess.Popen:
        command = subprocess.Popen(
            argv,
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            # as a terminal starts a command: a suite started in the background of a
            # non-interactive shell ignores SIGINT, which its children would inherit (and bash
            # cannot trap a signal ignored when it starts)
            preexec_fn=_default_interrupt,
        )
        self.commands.append(command)
        return command

    def look(self) -> None:
        for command in self.commands:
            self.seen |= tree(command.pid)

    def end(self) -> None:
        self.look()
        for pid, _ in filter(alive, self.seen):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for command in self.commands:
            command.wait()


@pytest.fixture
def launched() -> Iterator[Launched]:
    launched = Launched()
    yield launched
    launched.end()


def stop_while_training(
    launched: Launched, command: subprocess.Popen, run: Path, signum: int, processes: int
) -> str:
    """Send ``signum`` to ``command`` once ``run`` trains and its tree has ``processes``
    processes (each seen in ``launched``); its stderr."""

    def ready() -> bool:
        launched.look()
        training = steps_logged(run) >= 1 and len(tree(command.pid)) >= processes
        return training or command.poll() is not None

    wait_until(ready)
    assert command.poll() is None, command.communicate()
    os.kill(command.pid, signum)
    return command.communicate(timeout=600)[1]


def assert_checkpointed_at_the_stop(run: Path) -> int:
    summary = json.loads((run / "summary.json").read_text())
    step = summary["steps"]
    assert summary["stopped"] == "signal"
    assert (run / "checkpoints" / f"step_{step:06d}" / "manifest.json").is_file()
    return step


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.extended)]
)
def test_a_stopped_sweep_stops_its_run_which_the_next_sweep_resumes(tmp_path, launched, signum):
    grid = tmp_path / "grid.toml"
    base = "\n".join(f"{key} = {value}" for key, value in (s.split("=") for s in TOY))
    grid.write_text(
        f'[sweep]\nname = "toy"\n\n[base]\n{base}\nsteps = 1000\n\n[grid]\nschedule = ["sync"]\n'
    )
    out, run = tmp_path / "runs", tmp_path / "runs" / "schedule=sync"
    argv = ["sweep", "--config", str(grid), "--out", str(out)]
    sweep = launched.start([sys.executable, "-m", "nobubble", *argv])
    err = stop_while_training(launched, sweep, run, signum, processes=2)  # the sweep, a train

    name = signal.Signals(signum).name
    assert sweep.returncode == 128 + signum, err
    assert f"sweep: stopped by {name}; 1 run stopped" in err.strip().splitlines()[-1]
    wait_until(lambda: none_alive(launched.seen), timeout=60)
    stopped = assert_checkpointed_at_the_stop(run)
    assert stopped < 1000

    assert main(argv) == 0
    assert f"resuming step_{stopped:06d}" in (out / "_sweep" / f"{run.name}.log").read_text()
    assert json.loads((run / "summary.json").read_text())["stopped"] == "finished"


@pytest.mark.slow
def test_a_stopped_bench_stops_its_run_and_torchruns_workers(tmp_path, launched):
    runs = tmp_path / "runs"
    argv = ["bench", "--quick", "--schedules", "1f1b", "--steps", "10000", "--runs-dir", str(runs)]
    bench = launched.start([sys.executable, "-m", "nobubble", *argv])
    err = stop_while_training(launched, bench, runs / "0-1f1b", signal.SIGTERM, processes=4)

    assert bench.returncode == 128 + signal.SIGTERM, err
    assert "bench: stopped by SIGTERM; 1 run stopped" in err.strip().splitlines()[-1]
    assert len(launched.seen) >= 4  # the bench, torchrun and its two workers
    wait_until(lambda: none_alive(launched.seen), timeout=60)
    assert_checkpointed_at_the_stop(runs / "0-1f1b")  # the workers got the signal in time


@pytest.mark.slow
def test_a_stopped_gpu_check_stops_the_step_in_flight(tmp_path, launched):
    """The GPU check's steps on the CPU: Ctrl-C to the script reaches the step's training."""
    out = tmp_path / "check"
    out.mkdir()
    script = f"""
set -euo pipefail
START=$SECONDS BUDGET_S=3600 OUT={out} SUMMARY={out}/summary.md FAILED=0 PY={sys.executable}
. scripts/gpu_check_steps.sh
step tiny "$PY" -m nobubble train --no-progress --out "$OUT/runs/tiny" {" ".join(TOY)} \\
    steps=1000000
"""
    check = launched.start(["bash", "-c", script])
    run = out / "runs" / "tiny"
    err = stop_while_training(launched, check, run, signal.SIGINT, processes=3)  # + the helper

    assert check.returncode == 128 + signal.SIGINT, err
    assert "stopped by SIGINT in step tiny" in err.strip().splitlines()[-1]
    assert "step tiny: stopped by SIGINT; 1 run stopped" in (out / "tiny.log").read_text()
    wait_until(lambda: none_alive(launched.seen), timeout=60)
    assert_checkpointed_at_the_stop(run)
