"""Multi-node runs: two torchrun launchers on one host, joined by a c10d rendezvous.

Each launcher plays a node: its own working directory and HOME, one process each, ``--nnodes 2``.
They share one folder only, the one holding the run folder (``--out``), as nodes share
a file system for checkpoints; data named by a relative path is a separate copy in each node's
working directory. The run must equal the one-launcher run bit for bit, and the rank that is not
the leader must get the tokenizer from the leader over torch.distributed, never from a file the
leader wrote (checked with strace where it is available).

c10d numbers the nodes itself (``--node-rank`` is ignored, with a warning), in the order of their
addresses (torch 2.13: host address, then the launcher's pid): each launcher gets its own
``--local-addr`` (127.0.0.1, 127.0.0.2: both this host) so that node 0 holds rank 0, the leader.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers.pipeline import SMALL, assert_same_run, env, nobubble

pytestmark = pytest.mark.slow

NODES = 2
RUN = ["--no-progress", *SMALL, "stages=2", "schedule=2bw", "microbatches=2", "steps=3"]
BPE = ["data=corpus.txt", "tokenizer=bpe", "bpe_vocab_size=300"]
TEXT = "\n\n".join(
    f"Scene {i}. " + "To be or not to be, that is the question. " * 6 for i in range(300)
)
STRACE = ["strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=%file"]  # only file calls stop


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _strace_works() -> bool:
    if shutil.which("strace") is None:
        return False
    return subprocess.run([*STRACE, "-o", "/dev/null", "true"], capture_output=True).returncode == 0


def node_command(node: int, port: int, rdzv_id: str, *args: str) -> list[str]:
    """``nobubble train ARGS`` as node ``node`` of a two-node torchrun job, one process a node."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}"]
    torchrun += ["--nproc-per-node=1", f"--node-rank={node}", "--rdzv-backend=c10d"]
    torchrun += [f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}"]
    torchrun += [f"--local-addr=127.0.0.{node + 1}"]
    return [*torchrun, "-m", "nobubble", "train", *args]


def launch_nodes(
    root: Path, out: Path, *args: str, traces: bool = False, check: bool = True
) -> list[dict]:
    """Start both launchers at once (node N in ``root/nodeN``, with its own HOME), wait for
    both; return per node its ``output``, ``returncode`` and ``trace`` (the strace log of its
    file system calls, or None)."""
    port, rdzv_id = _free_port(), uuid.uuid4().hex[:8]
    nodes, procs = [], []
    for node in range(NODES):
        cwd = root / f"node{node}"
        (cwd / "home").mkdir(parents=True, exist_ok=True)
        command = node_command(node, port, rdzv_id, "--out", str(out), *args)
        trace = cwd / "strace.log" if traces else None
        if trace is not None:
            command = [*STRACE, "-o", str(trace), *command]
        node_env = {**env(), "HOME": str(cwd / "home")}
        output = subprocess.PIPE
        procs.append(
            subprocess.Popen(
                command, cwd=cwd, env=node_env, text=True, stdout=output, stderr=subprocess.STDOUT
            )
        )
        nodes.append({"trace": trace})
    try:
        for node, proc in zip(nodes, procs, strict=True):
            node["output"] = proc.communicate(timeout=300)[0]
            node["returncode"] = proc.returncode
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = "\n".join(f"--- node {n}:\n{node['output']}" for n, node in enumerate(nodes))
    if check:
        assert all(node["returncode"] == 0 for node in nodes), f"a launcher failed:\n{outputs}"
        folder = out if out.is_absolute() else root / "node0" / out  # as the leader resolves it
        assert f"run folder: {folder}" in nodes[0]["output"], f"node 0 did not lead:\n{outputs}"
    return nodes


def traced_paths(trace: Path) -> list[str]:
    """Every string in a strace log of file system calls: the paths they named (and the
    arguments of the commands they ran)."""
    return re.findall(r'"((?:[^"\\]|\\.)*)"', trace.read_text())


def test_two_launchers_equal_one_launcher(tmp_path):
    """With a relative --out: it names the folder in the leader's working directory, and node 1
    (another working directory) must write its checkpoint shard there too."""
    launch_nodes(tmp_path, Path("multinode"), *RUN)
    nobubble(tmp_path / "shared" / "standalone", *RUN[1:], stages=2)
    assert_same_run(tmp_path / "node0" / "multinode", tmp_path / "shared" / "standalone")
    assert not (tmp_path / "node1" / "multinode").exists()


def test_the_leader_sends_its_bpe_tokenizer_and_no_other_rank_reads_its_files(tmp_path):
    """tokenizer=bpe: the leader trains it; the last stage, on the other node, builds its data
    from its own copy of the text with the tokenizer it receives, and touches nothing of the run
    folder but its checkpoint shard."""
    for node in range(NODES):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "corpus.txt").write_text(TEXT)
    out = tmp_path / "shared" / "multinode"
    traced = _strace_works()
    nodes = launch_nodes(tmp_path, out, *RUN, *BPE, traces=traced)
    reference = tmp_path / "shared" / "simulated"
    (tmp_path / "shared" / "corpus.txt").write_text(TEXT)
    data = f"data={tmp_path / 'shared' / 'corpus.txt'}"
    nobubble(reference, *RUN[1:], data, *BPE[1:])  # one process: the exact simulation
    assert_same_run(out, reference)  # the last stage's val_bpb counts bytes with the tokenizer
    assert (out / "tokenizer.json").read_text() == (reference / "tokenizer.json").read_text()
    if not traced:
        pytest.skip("strace is not available: the file accesses of the non-leader are unchecked")
    paths = traced_paths(nodes[1]["trace"])
    assert "corpus.txt" in paths  # it read its own copy of the data
    shared = str(tmp_path / "shared")
    touched = [p for p in paths if p.startswith(shared) or "tokenizer.json" in p]
    allowed = (str(out), str(out / "checkpoints"))
    stray = [p for p in touched if p not in allowed and not p.startswith(f"{out}/checkpoints/")]
    assert not stray, f"the non-leader touched files of the leader's run: {stray}"


def test_data_missing_on_a_node_is_one_clear_error_on_every_node(tmp_path):
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "corpus.txt").write_text(TEXT)  # node 1 lacks it
    out = tmp_path / "shared" / "multinode"
    nodes = launch_nodes(tmp_path, out, *RUN, *BPE, check=False)
    for node in nodes:
        assert node["returncode"] != 0
        assert "rank 1 (stage 1) on host" in node["output"]
        assert "data path 'corpus.txt' does not exist" in node["output"]
        assert "the same files at the same path" in node["output"]
    shared = tmp_path / "shared"
    assert not shared.exists() or list(shared.iterdir()) == []  # the leader's setup is undone
