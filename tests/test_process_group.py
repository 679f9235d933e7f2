"""The pipeline's process group goes away when it is closed, so no backend thread is alive at exit.

Each case runs two fresh processes (a fresh interpreter matters: the leak depends on what is
imported while the group exists).
"""

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.pipeline_helpers import env

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")

SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from nobubble.pipeline import process_group as pg

    rank, port, how = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if how == "plain":  # what the launcher did before: init first, optimizer later
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
    else:
        pg.open_process_group("gloo", torch.device("cpu"), rank, 2, 60.0)
    keep = dist.group.WORLD if how == "leak" else None
    weight = torch.nn.Parameter(torch.ones(3))
    torch.optim.AdamW([weight]).step()  # the first optimizer imports torch._dynamo
    dist.barrier()
    gone = pg.close_process_group()
    threads = [(t / "comm").read_text().strip() for t in Path("/proc/self/task").iterdir()]
    print("gone" if gone else "held", sorted(t for t in threads if "gloo" in t), flush=True)
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


def test_closing_the_group_stops_every_backend_thread():
    for result in run_pair("nobubble"):
        assert result.returncode == 3, result.stderr
        assert result.stdout.strip() == "gone []", result.stdout + result.stderr
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
