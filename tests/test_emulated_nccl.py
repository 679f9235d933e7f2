"""The NCCL emulator (``emulate_nccl=true``, nobubble.pipeline.emulated_nccl): gloo run as NCCL
would run it.

- Every schedule runs under it and computes bitwise what the plain gloo run computes: losses and
  final weights (P = 2 and 4, data parallelism with replicated and sharded state, tied
  embeddings, MoE; the V placement's zb-v and dualpipev). `make test` runs a few
  cases that between them cross every path (per-edge routes in both directions, the tied and the
  data-parallel all-reduces, the split backward, MoE's statistics); the rest are `extended`.
- The negative control: with every message on one group (``p2p_routes=shared``), 1F1B on two
  stages hangs as it would on NCCL, and the error says what each rank waited for. If the emulator
  ever stopped emulating, this run would pass and the test would fail.
- Two ranks that post their messages on a group in different orders get an error naming both
  messages (NCCL would pair them silently).
"""

import datetime
import os
import re
import socket

import pytest
import torch.multiprocessing as mp

from tests.helpers.pipeline import EXTENDED, MOE, assert_same_run, nobubble

pytestmark = pytest.mark.slow

EMULATED = ["emulate_nccl=true"]  # its routes: auto = per-edge, as on NCCL

# Every data-parallel case runs with each: replicated state, and sharded (issue 26), whose chain
# of collectives (reduction, norm, all-gather) posts through the transport too. zero=2 crosses
# every collective of the chain (all-to-all, the norm's all-reduce, the all-gather); zero=1's
# all-reduce and all-gather are a subset of it and of the replicated case's.
REPLICA_MODES = [
    pytest.param([], id="replicated"),
    pytest.param(["zero=1"], id="zero1", marks=EXTENDED),
    pytest.param(["zero=2"], id="zero2"),
]

CASES = [
    # (stages, schedule, microbatches, extra settings); in make test: 1f1b (the schedule the
    # negative control hangs), zb-h2 (the split backward's W's behind the next step's forwards),
    # interleaved with tied copies (edges both ways between two processes, the tied all-reduce)
    (2, "1f1b", 4, ["optim=adamw"]),
    (2, "zb-h2", 4, ["optim=adamw"]),
    (2, "interleaved-1f1b", 4, ["optim=adamw", "tie_embeddings=true"]),
    pytest.param(2, "gpipe", 4, ["optim=adamw"], marks=EXTENDED),
    pytest.param(2, "2bw", 4, ["optim=adamw", "correction=ef"], marks=EXTENDED),
    pytest.param(2, "pipedream", 1, ["optim=adamw"], marks=EXTENDED),
    pytest.param(2, "zb-h1", 4, ["optim=adamw"], marks=EXTENDED),
    (4, "2bw", 8, ["optim=adamw", "tie_embeddings=true"]),
    pytest.param(4, "gpipe", 8, ["optim=adamw"], marks=EXTENDED),
    pytest.param(4, "1f1b", 8, ["optim=adamw"], marks=EXTENDED),
    pytest.param(4, "pipedream", 1, ["optim=adamw"], marks=EXTENDED),
    pytest.param(4, "zb-h1", 8, ["optim=adamw"], marks=EXTENDED),
    pytest.param(4, "zb-h2", 8, ["optim=adamw"], marks=EXTENDED),
    pytest.param(4, "interleaved-1f1b", 8, ["optim=adamw", "n_layers=8"], marks=EXTENDED),
    pytest.param(4, "1f1b", 4, ["optim=adamw", *MOE], marks=EXTENDED),
    # the V placement: two edges between each pair of neighbouring processes (down and back
    # up), the turn handed over in memory; dualpipev's overlapped F&B posts both halves'
    # receives before it and both sends after it
    (2, "dualpipev", 4, ["optim=adamw"]),
    pytest.param(2, "zb-v", 4, ["optim=adamw"], marks=EXTENDED),
    pytest.param(4, "zb-v", 8, ["optim=adamw", "n_layers=8"], marks=EXTENDED),
    pytest.param(4, "dualpipev", 8, ["optim=adamw", "n_layers=8"], marks=EXTENDED),
]

DP_CASES = [
    # (stages, schedule, microbatches, extra settings); dp = 2
    (2, "2bw", 2, ["optim=adamw", *MOE]),  # the replicas' all-reduce carries the routing sums
    pytest.param(2, "interleaved-1f1b", 2, ["optim=adamw", "tie_embeddings=true"], marks=EXTENDED),
    pytest.param(1, "sync", 2, ["optim=adamw"], marks=EXTENDED),  # replicas only: no edge
    pytest.param(2, "dualpipev", 4, ["optim=adamw"], marks=EXTENDED),  # a replica of each stage
]


def settings(stages: int, schedule: str, micro: int, extra: list[str]) -> list[str]:
    common = [f"schedule={schedule}", f"stages={stages}", f"microbatches={micro}", "steps=4"]
    return [*common, "eval_every=2", *extra]  # an evaluation mid-run: two segments


@pytest.mark.parametrize(("stages", "schedule", "micro", "extra"), CASES)
def test_every_schedule_runs_bitwise_as_on_gloo_under_the_emulator(
    tmp_path, stages, schedule, micro, extra
):
    run = settings(stages, schedule, micro, extra)
    emulated = nobubble(tmp_path / "emulated", *run, *EMULATED, stages=stages)
    nobubble(tmp_path / "gloo", *run, stages=stages)
    assert_same_run(tmp_path / "emulated", tmp_path / "gloo")
    # the emulator's threads and groups end with the run
    assert "without interpreter teardown" not in emulated.stderr


@pytest.mark.parametrize("mode", REPLICA_MODES)
@pytest.mark.parametrize(("stages", "schedule", "micro", "extra"), DP_CASES)
def test_replicas_run_bitwise_as_on_gloo_under_the_emulator(
    tmp_path, stages, schedule, micro, extra, mode
):
    run = [*settings(stages, schedule, micro, extra), "dp=2", *mode]
    nobubble(tmp_path / "emulated", *run, *EMULATED, stages=2 * stages)
    nobubble(tmp_path / "gloo", *run, stages=2 * stages)
    assert_same_run(tmp_path / "emulated", tmp_path / "gloo")


def waits_of(report: str) -> dict[int, str]:
    """What each rank waits for in an emulated NCCL hang report (its ``rank N: waits for X``
    lines), by rank."""
    return {
        int(rank): what for rank, what in re.findall(r"^rank (\d+): waits for (.*)$", report, re.M)
    }


def test_one_group_for_every_message_hangs_1f1b_as_nccl_would_and_says_where(tmp_path):
    """Stage 0 posts the receive of gradient 0 before it sends activation 1, stage 1 the
    receive of activation 1 before it sends gradient 0: on one group, run in posting order,
    each waits for the other. The run fails after p2p_timeout_s with what each rank waited for
    and the routes that avoid it; plain gloo (tags, any order) runs the same settings."""
    run = settings(2, "1f1b", 4, ["optim=adamw", "p2p_routes=shared", "p2p_timeout_s=20"])
    result = nobubble(tmp_path / "hung", *run, *EMULATED, stages=2, check=False)
    assert result.returncode != 0
    error = result.stderr
    assert "emulated NCCL" in error and "20s" in error  # p2p_timeout_s
    # both ranks' queues in one report: each holds a receive from the other at its head
    waits = waits_of(error)
    assert {"receive", "gradient", "mb0", "stage", "1"} <= set(waits[0].split())
    assert {"receive", "activation"} <= set(waits[1].split())
    assert re.search(r"\(ranks 0, 1\): receive gradient mb0 from stage 1 \(running", error)
    assert "p2p_routes=per-edge" in error  # the fix
    nobubble(tmp_path / "gloo", *run, stages=2)  # the same settings on plain gloo: no hang


@pytest.mark.parametrize(
    ("stages", "schedule", "micro", "extra"),
    [
        (2, "1f1b", 4, []),
        pytest.param(4, "2bw", 8, [], marks=EXTENDED),
        pytest.param(2, "gpipe", 4, [], marks=EXTENDED),
        pytest.param(2, "zb-h1", 4, [], marks=EXTENDED),
        pytest.param(2, "interleaved-1f1b", 4, [], marks=EXTENDED),
    ],
)
def test_without_the_warmup_the_lazy_connections_hang_step_0_and_name_the_first_posts(
    tmp_path, stages, schedule, micro, extra
):
    """NCCL connects a pair on its first send/receive there and blocks the poster until the
    peer posts its own first. Stage 0 posts its first gradient receive (ahead of need) before it
    sends activation 0, stage 1 blocks in its first activation receive: each waits in a first
    post for the other. With ``p2p_warmup=false`` the emulator must reproduce that hang at step
    0 (if it stopped modelling lazy connections, this run would pass and the test fail); with
    the warm-up the same run is the schedule matrix's (above)."""
    run = settings(stages, schedule, micro, ["optim=adamw", "p2p_timeout_s=15", *extra])
    result = nobubble(
        tmp_path / "hung", *run, *EMULATED, "p2p_warmup=false", stages=stages, check=False
    )
    assert result.returncode != 0
    error = result.stderr
    assert "was not done after 15s" in error and "Traceback" not in error
    # a rank blocked in a first post (a receive posted ahead), and what its peer waits for
    waits = waits_of(error)
    assert {"connection", "'receive"} <= set(waits[0].split())
    assert 1 in waits
    assert (
        not (tmp_path / "hung" / "metrics.jsonl").exists()
        or "train_loss" not in (tmp_path / "hung" / "metrics.jsonl").read_text()
    )  # step 0 never finished


def _post_in_either_order(rank: int, port: int, results) -> None:
    """Rank 0 sends two messages with different tags; rank 1 receives them by tag, in the other
    order: gloo matches tags, NCCL (and the emulator) the order."""
    import torch
    import torch.distributed as dist

    from nobubble.pipeline.emulated_nccl import EmulatedNccl
    from nobubble.pipeline.transport import MismatchedMessages

    limit = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=limit)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=limit)
    emulator = EmulatedNccl(rank, 2, store, 120.0)
    if rank == 0:
        for tag, what in ((1, "send activation mb0"), (2, "send gradient mb0")):
            emulator.send(torch.full((3,), float(tag)), 1, None, tag, what)
        store.wait(["checked"])  # the sends wait for receives that never come: leave
    else:
        second = emulator.recv(torch.empty(3), 0, None, 2, "receive gradient mb0")
        try:
            second.wait()
            results.put("paired by tag")
        except MismatchedMessages as exc:
            results.put(str(exc))
        store.set("checked", "1")
    os._exit(0)  # a queue still waits in gloo for what will not come


def test_messages_pair_by_order_not_by_tag_and_a_mismatch_names_both():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_post_in_either_order, args=(port, results), nprocs=2, start_method="spawn")
    message = results.get()
    assert message.startswith(
        "NCCL would pair 'receive gradient mb0' with rank 0's 'send activation mb0' (its send "
        "number 1 to this rank on the default group (ranks 0, 1))"
    )
