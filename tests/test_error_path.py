"""A rank that raises mid-run, under the NCCL emulator: every rank ends within the peer-failure
timeout, each with its error and the schedule picture printed once.

NCCL's ``destroy_process_group()`` waits for every operation posted; the receives a stage posts
ahead never complete once a peer has failed, so a rank that closed its groups gracefully on an
error would sit there until the watchdog's timeout (``group_timeout_s``, set long here), and its
error would be printed only after it. The emulator's graceful close waits the same way: if the
error path ever waited again, these runs would take ``group_timeout_s`` and the test would fail.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.pipeline import SMALL, env

pytestmark = pytest.mark.slow

P2P_TIMEOUT_S = 20
GROUP_TIMEOUT_S = 600  # what the old exit path waits for
MARGIN_S = 60  # a busy 2-core machine: wide
INJECTED = "injected at "

# One rank of a torchrun launch; on rank FAILING, torch.nn.functional.NAME raises at its AT-th
# call (mid-run: inside an action, so the error carries the picture of the schedule).
RANK = textwrap.dedent(
    f"""
    import itertools, os, sys, time
    import torch.nn.functional as F
    from nobubble.cli import main

    failing, name, at, *argv = sys.argv[1:]
    if os.environ["RANK"] == failing:
        function, calls = getattr(F, name), itertools.count(1)

        def failing(*args, **kwargs):
            if next(calls) == int(at):
                print(f"{INJECTED}{{time.time()}}", file=sys.stderr, flush=True)
                raise RuntimeError("injected failure")
            return function(*args, **kwargs)

        setattr(F, name, failing)
    raise SystemExit(main(argv))
    """
)


def launch(out: Path, failing: int, name: str, at: int, *settings: str) -> list[subprocess.Popen]:
    """Two ranks of a 1F1B pipeline under the emulator, each as torchrun would start it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    world = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    argv = ["train", "--no-progress", "--out", str(out), *SMALL, *settings]
    return [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(failing), name, str(at), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env() | world | {"MASTER_PORT": port, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(2)
    ]


def finish(procs: list[subprocess.Popen], timeout_s: float) -> list[tuple[int, str, float]]:
    """(exit status, standard error, when it ended) of each process; those still running after
    ``timeout_s`` are killed and fail the test."""
    deadline = time.monotonic() + timeout_s
    ended: dict[int, float] = {}
    while len(ended) < len(procs) and time.monotonic() < deadline:
        ended |= {
            i: time.time() for i, p in enumerate(procs) if i not in ended and p.poll() is not None
        }
        time.sleep(0.2)
    hung = [i for i, p in enumerate(procs) if p.poll() is None]
    for p in procs:
        if p.poll() is None:
            p.kill()
    results = [(p.returncode, p.communicate()[1], ended.get(i, 0.0)) for i, p in enumerate(procs)]
    assert not hung, f"ranks {hung} still running after {timeout_s}s:\n" + "\n".join(
        err for _, err, _ in results
    )
    return results


def test_a_rank_that_raises_ends_every_rank_with_its_error_within_the_peer_timeout(tmp_path):
    """Stage 1's loss raises at its 10th microbatch (step 3 of 50): it prints its traceback with
    the picture of the schedule, aborts its groups and exits 1; stage 0, whose peer is gone,
    gives up on it, prints its one-line error with its own picture and exits 2. Neither waits for
    the receives it posted ahead, and neither says it twice."""
    settings = ["schedule=1f1b", "stages=2", "microbatches=4", "steps=50", "emulate_nccl=true"]
    settings += [f"p2p_timeout_s={P2P_TIMEOUT_S}", f"group_timeout_s={GROUP_TIMEOUT_S}"]
    procs = launch(tmp_path / "run", 1, "cross_entropy", 10, *settings)
    (code0, err0, end0), (code1, err1, end1) = finish(procs, GROUP_TIMEOUT_S / 2)

    assert code1 == 1, err1
    assert err1.count("RuntimeError: injected failure") == 1, err1
    assert err1.count("where stage 1 stopped: ") == 1, err1
    assert code0 == 2, err0
    assert err0.count("nobubble: error: stage 0 ") == 1, err0
    assert err0.count("where stage 0 stopped: ") == 1, err0

    injected = float(err1.split(INJECTED)[1].split()[0])
    assert max(end0, end1) - injected < P2P_TIMEOUT_S + MARGIN_S, (err0, err1)
