"""The pipeline's process group: its backend and device (``dist_backend``, ``emulate_nccl``), and
its teardown: the group goes away when it is closed, so no backend thread (nor the NCCL
emulator's) is alive at exit.

Each teardown case runs two fresh processes (a fresh interpreter matters: the leak depends on
what is imported while the group exists).
"""

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nobubble.config import ConfigError, TrainConfig
from nobubble.pipeline import process_group
from tests.helpers.pipeline import env, nobubble

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")

SCRIPT = textwrap.dedent(
    """
    import os, sys, threading
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from nobubble.pipeline import process_group as pg
    from nobubble.pipeline.transport import active

    rank, port, how = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if how == "plain":  # what the launcher did before: init first, optimizer later
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
    else:
        emulated = how in ("emulated", "aborted")
        pg.open_process_group("gloo", torch.device("cpu"), rank, 2, 600.0, 60.0, emulated)
    keep = dist.group.WORLD if how == "leak" else None
    weight = torch.nn.Parameter(torch.ones(3))
    torch.optim.AdamW([weight]).step()  # the first optimizer imports torch._dynamo
    if how == "emulated":  # a message each way and an all-reduce through the emulator's queue
        total = torch.ones(2)
        ops = [active().send, active().recv] if rank == 0 else [active().recv, active().send]
        for op in ops:  # one order on each rank, or both would wait for the other's receive
            op(total, 1 - rank, None, 0, op.__name__).wait()
        launch = lambda: dist.all_reduce(total, async_op=True)
        active().collective(None, launch, "all-reduce", total.device).wait()
        assert total.tolist() == [2.0, 2.0]
    if how == "aborted":  # rank 1 receives a message, then posts a receive that never comes
        message = torch.ones(2)
        if rank == 0:
            active().send(message, 1, None, 0, "send").wait()
        else:
            active().recv(message, 0, None, 0, "receive").wait()
            active().recv(message, 0, None, 1, "receive")  # nothing sends it
        dist.barrier()
        pg.abort_process_group()
        print("aborted", flush=True)
        sys.exit(pg.exit_code(3))
    dist.barrier()
    gone = pg.close_process_group()
    threads = [(t / "comm").read_text().strip() for t in Path("/proc/self/task").iterdir()]
    threads += [t.name for t in threading.enumerate()]
    mine = sorted(t for t in threads if "gloo" in t or "emulated" in t)
    print("gone" if gone else "held", mine, flush=True)
    sys.exit(pg.exit_code(3))
    """
)


def run_pair(how: str) -> list[subprocess.CompletedProcess]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    command = [sys.executable, "-c", SCRIPT]
    procs = [
        subprocess.Popen(
            [*command, str(rank), port, how],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
        )
        for rank in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


@pytest.mark.parametrize("how", ["nobubble", "emulated"])
def test_closing_the_group_stops_every_backend_thread(how):
    for result in run_pair(how):
        assert result.returncode == 3, result.stderr
        assert result.stdout.strip() == "gone []", result.stdout + result.stderr
        assert "note:" not in result.stderr


def test_an_abort_waits_for_nothing_posted_and_ends_the_process_with_its_code():
    """A receive that never comes would hold the emulator's graceful close, as NCCL's, for the
    group timeout (600 s, past the pair's limit of 300 s); the abort leaves it pending."""
    for result in run_pair("aborted"):
        assert result.returncode == 3, result.stderr
        assert result.stdout.strip() == "aborted", result.stdout + result.stderr
        assert "note:" not in result.stderr


def test_without_the_early_import_the_backend_outlives_destroy():
    """The torch behaviour the early import works around (torch 2.13, the pinned version)."""
    results = run_pair("plain")
    if all(r.stdout.startswith("gone") for r in results) and not torch.__version__.startswith(
        "2.13."
    ):
        pytest.skip(f"torch {torch.__version__} frees the backend on destroy by itself")
    for result in results:
        assert result.stdout.startswith("held ['gloo_tcp_loop', 'pt_gloo_runloop'"), result.stdout


def test_a_group_held_elsewhere_ends_the_process_with_its_code_and_no_teardown():
    for result in run_pair("leak"):
        assert result.stdout.startswith("held"), result.stdout + result.stderr
        assert result.returncode == 3, result.stderr
        assert "exiting without interpreter teardown" in result.stderr


# -- the backend and the device of a rank ------------------------------------------------------


@pytest.fixture
def gpus(monkeypatch):
    """A machine with two GPUs (as far as the choice of a rank's device is concerned)."""
    chosen = []
    monkeypatch.setattr(process_group, "resolve_device", lambda name: torch.device(name))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def rank_device(monkeypatch, local_rank: int, **settings) -> tuple[torch.device, str]:
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    return process_group.device_and_backend(TrainConfig(**settings))


def test_nccl_takes_a_gpu_per_process_and_refuses_a_process_without_one(gpus, monkeypatch):
    assert rank_device(monkeypatch, 1, device="cuda") == (torch.device("cuda", 1), "nccl")
    with pytest.raises(ConfigError, match=r"rank 2 has none \(2 visible\).*dist_backend=gloo"):
        rank_device(monkeypatch, 2, device="cuda")


def test_gloo_lets_processes_share_gpus(gpus, monkeypatch):
    for local_rank, index in [(0, 0), (1, 1), (2, 0), (3, 1)]:
        device = rank_device(monkeypatch, local_rank, device="cuda", dist_backend="gloo")
        assert device == (torch.device("cuda", index), "gloo")
    assert gpus == [0, 1, 0, 1]
    emulated = rank_device(monkeypatch, 3, device="cuda", dist_backend="gloo", emulate_nccl=True)
    assert emulated == (torch.device("cuda", 1), "gloo")


def test_the_emulator_on_nccl_itself_is_refused_with_the_fix(gpus, monkeypatch):
    with pytest.raises(ConfigError) as refused:
        rank_device(monkeypatch, 0, device="cuda", emulate_nccl=True)
    assert str(refused.value) == (
        "emulate_nccl=true runs gloo as NCCL would, and this run's backend is nccl (device=cuda "
        "picks it): set dist_backend=gloo to emulate it with this GPU's tensors (processes may "
        "then share a GPU), or drop emulate_nccl to run NCCL itself"
    )
    with pytest.raises(ConfigError, match=r"backend is nccl \(dist_backend=nccl\)"):
        rank_device(monkeypatch, 0, device="cuda", dist_backend="nccl", emulate_nccl=True)


def test_nccl_on_the_cpu_is_refused_before_the_run_folder_exists(tmp_path):
    result = nobubble(tmp_path / "r", "stages=2", "dist_backend=nccl", stages=2, check=False)
    assert result.returncode == 2
    error = result.stderr
    assert "dist_backend=nccl" in error and "cpu" in error  # the setting and the device
    assert "device=cuda" in error and "dist_backend=auto" in error  # the two fixes
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "r").exists()
