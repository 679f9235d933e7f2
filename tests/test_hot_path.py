"""No device sync inside an action (issue 38): the hot path queues work and never waits for it.

Each process of a real pipeline run counts, while one of its schedule's actions runs (and while
a sharded update's chain is moved on between two actions, which must wait for nothing), every
call that would make the CPU wait for a CUDA device: a tensor's value read on the host
(``item``, ``tolist``, ``numpy``, ``bool``, ``float``, ``int``), a copy to host memory (``cpu``)
and every ``synchronize`` of torch.cuda. On the CPU these calls cost nothing, but each is a sync
on CUDA; counting them shows the runtime's hot path as it would run there.

Not counted: the staging of gloo's messages through host memory
(:meth:`~nobubble.pipeline.comm.Messenger`'s ``_outgoing`` and ``_delivered``: gloo, and the NCCL
emulator that runs on it, send from host memory; NCCL sends from the GPU and never calls them for
stage data) and the reads of a host copy whose event has completed (:mod:`nobubble.pipeline.host`).
An MoE layer dispatches its experts by a grouped GEMM and reads nothing; its fallback, the loop
that reads the expert loads on the host (float32 here), is run too, to show that it is the only
read then (:func:`nobubble.model.moe.grouped_dispatch`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers.launcher import run_nobubble
from tests.helpers.pipeline import SMALL, env

COUNTS_DIR = "NOBUBBLE_TEST_SYNC_COUNTS"  # where each rank writes what it counted
SYNCING = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__")
# the calls that cross to host memory by design (see the module's docstring)
STAGING = {"Messenger._outgoing", "Messenger._delivered", "HostCopy.read"}
# torch's optimizers keep their step counts in host memory (capturable=False) and read them there
HOST_STEPS = os.sep.join(("torch", "optim", ""))
MOE_LOOP = "moe.py:_looped tolist"  # the fallback dispatch's read of the loads
SRC = os.sep + "nobubble" + os.sep


class SyncCounter:
    """Counts the syncing calls made on this thread while :attr:`depth` > 0, by the nobubble
    function that made them (``file:function``)."""

    def __init__(self) -> None:
        self.depth = 0
        self.thread = threading.get_ident()
        self.sites: Counter[str] = Counter()

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def wrap(self, call: Callable) -> Callable:
        counter = self

        def counted(*args, **kwargs):
            if counter.depth and threading.get_ident() == counter.thread:
                counter.record(call.__name__)
            return call(*args, **kwargs)

        return counted

    def record(self, what: str) -> None:
        """Count a call, by the innermost nobubble frame that made it (none: not counted)."""
        frame = sys._getframe(2)
        if HOST_STEPS in frame.f_code.co_filename:
            return
        while frame is not None and SRC not in frame.f_code.co_filename:
            frame = frame.f_back
        if frame is None or frame.f_code.co_qualname in STAGING:
            return
        site = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"
        self.sites[f"{site} {what}"] += 1


def install_counter() -> None:
    """In a pipeline process: count syncing calls inside every action and every chain's
    ``advance``; after every training segment write the counts to ``$COUNTS_DIR/RANK.json``."""
    from nobubble.pipeline import runtime, updates

    counter = SyncCounter()
    for name in SYNCING:
        setattr(torch.Tensor, name, counter.wrap(getattr(torch.Tensor, name)))
    torch.cuda.synchronize = counter.wrap(torch.cuda.synchronize)
    for cls in (torch.cuda.Stream, torch.cuda.Event):
        cls.synchronize = counter.wrap(cls.synchronize)

    labelled = runtime.action_label

    @contextlib.contextmanager
    def action_label(action):
        with counter.counting(), labelled(action):
            yield

    runtime.action_label = action_label
    advance = updates.Updates.advance

    def counted_advance(self) -> None:
        with counter.counting():
            advance(self)

    updates.Updates.advance = counted_advance
    run_steps = runtime.PipelineEngine.run_steps

    def run_and_write(self, *args, **kwargs):
        run_steps(self, *args, **kwargs)
        path = Path(os.environ[COUNTS_DIR], f"{os.environ['RANK']}.json")
        path.write_text(json.dumps(dict(counter.sites)))

    runtime.PipelineEngine.run_steps = run_and_write


def counted_run(tmp_path: Path, processes: int, *settings: str) -> Counter[str]:
    """Train a few steps under the NCCL emulator with every process counting; the counts of
    all of them."""
    counts = tmp_path / "counts"
    counts.mkdir()
    argv = ["train", "--no-progress", "--out", str(tmp_path / "run"), *SMALL]
    argv += ["steps=3", "eval_every=2", "emulate_nccl=true", "optim=adamw", *settings]
    result = run_nobubble(argv, processes, 300, env() | {COUNTS_DIR: str(counts)}, install_counter)
    assert result.returncode == 0, result.stderr
    total: Counter[str] = Counter()
    for path in sorted(counts.glob("*.json")):
        total.update(json.loads(path.read_text()))
    assert len(list(counts.glob("*.json"))) == processes
    return total


MOE = ["moe_experts=4", "moe_top_k=2", "moe_d_ff=32", "moe_layers=[1, 2]", "moe_bias_rate=0.01"]
CASES = [
    # (processes, settings)
    pytest.param(2, ["schedule=1f1b", "stages=2", "microbatches=4"], id="1f1b"),
    pytest.param(2, ["schedule=2bw", "stages=2", "microbatches=4", "correction=ef"], id="2bw"),
    pytest.param(2, ["schedule=zb-h2", "stages=2", "microbatches=4"], id="zb-h2"),
    pytest.param(
        2,
        ["schedule=interleaved-1f1b", "stages=2", "microbatches=4", "tie_embeddings=true"],
        id="interleaved",
    ),
    pytest.param(2, ["schedule=2bw", "stages=1", "microbatches=2", "dp=2", "zero=1"], id="zero1"),
    pytest.param(
        4, ["schedule=2bw", "stages=2", "microbatches=2", "dp=2", "zero=2"], id="zero2-pp2"
    ),
    # grouped GEMM: bfloat16 and widths multiples of 8, on a CPU or an H100-class GPU
    pytest.param(
        2, ["schedule=1f1b", "stages=2", "microbatches=2", *MOE, "dtype=bfloat16"], id="moe"
    ),
    pytest.param(
        2, ["schedule=1f1b", "stages=2", "microbatches=2", *MOE, "dtype=float32"], id="moe-loop"
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("processes", "settings"), CASES)
def test_no_action_waits_for_the_device(tmp_path, processes, settings):
    counts = counted_run(tmp_path, processes, *settings)
    if "dtype=float32" in settings:  # the MoE loop: one read per MoE layer and forward
        assert counts.pop(MOE_LOOP) == 2 * 2 * 3  # layers, microbatches, steps
    assert counts == {}, f"calls that would sync a CUDA device inside actions: {dict(counts)}"


def test_the_counter_counts_only_inside_and_names_the_caller():
    """The instrument itself: a read inside ``counting`` is counted by its nobubble caller, one
    outside is not."""
    from nobubble.stage_update import combined_norm

    counter = SyncCounter()
    item = counter.wrap(torch.Tensor.item)
    value = torch.tensor(2.0)
    item(value)
    with counter.counting():
        combined_norm(item(value) for _ in range(1))  # called from a nobubble generator
        item(value)  # from here: no nobubble frame
    assert counter.sites == Counter({"stage_update.py:<genexpr> item": 1})
