"""Mixture-of-experts models on the real pipeline (torchrun, gloo) against the single-process
engine, bit for bit: losses, final weights (balance biases included) and the routing statistics
in metrics.jsonl; exact resume with bias balancing; the export's refusal (docs/moe.md)."""

import json

import pytest

from nobubble.cli import main
from tests.helpers.pipeline import EXTENDED, MOE, assert_same_run, metrics, nobubble, run_train

pytestmark = pytest.mark.slow


def routing(run) -> list[dict]:
    return [{k: v for k, v in row.items() if k.startswith("moe_")} for row in metrics(run)]


CASES = [
    # (stages, schedule, microbatches, extra settings)
    (2, "1f1b", 2, ["optim=adamw"]),
    (2, "2bw", 2, ["optim=muon", "correction=ef"]),
    (4, "2bw", 4, ["optim=adamw", "correction=ef", "moe_capacity_factor=1.0"]),
    (4, "gpipe", 4, ["optim=muon"]),
    # bfloat16: the experts run on the grouped GEMM (docs/moe.md, "Dispatch"); float32 hand-offs,
    # so that the pipeline rounds nothing the one-process engine does not
    (
        2,
        "1f1b",
        2,
        ["optim=adamw", "dtype=bfloat16", "p2p_dtype=float32", "moe_capacity_factor=1.0"],
    ),
    pytest.param(4, "2bw", 4, ["optim=muon"], marks=EXTENDED),
    # the auxiliary loss's gradient through the split backward (W runs the router's later)
    pytest.param(3, "zb-h1", 4, ["optim=adamw", "moe_aux_coef=0.1"], marks=EXTENDED),
    pytest.param(2, "interleaved-1f1b", 4, ["optim=muon"], marks=EXTENDED),
    # the V placement: stage 3's routing in process 0's second row; the auxiliary loss's
    # gradient through dualpipev's whole B's (in F&B's) and split ones
    pytest.param(2, "dualpipev", 4, ["optim=adamw", "moe_aux_coef=0.1"], marks=EXTENDED),
]


@pytest.mark.parametrize(("stages", "schedule", "micro", "extra"), CASES)
def test_moe_pipeline_matches_the_simulation(tmp_path, stages, schedule, micro, extra):
    settings = [f"schedule={schedule}", f"stages={stages}", f"microbatches={micro}", "steps=6"]
    settings += ["eval_every=3", *MOE, *extra]
    nobubble(tmp_path / "pipeline", *settings, stages=stages)
    nobubble(tmp_path / "simulated", *settings)
    assert_same_run(tmp_path / "pipeline", tmp_path / "simulated")
    assert routing(tmp_path / "pipeline") == routing(tmp_path / "simulated")
    last = routing(tmp_path / "pipeline")[-1]
    assert sorted(last["moe_load"]) == ["1", "2", "3"]
    grouped = "dtype=bfloat16" in extra  # both widths of these shapes are multiples of 8
    for run in ("pipeline", "simulated"):
        dispatch = json.loads((tmp_path / run / "summary.json").read_text())["moe_dispatch"]
        assert (dispatch == "grouped GEMM") == grouped, dispatch


def test_a_pipeline_moe_run_resumes_exactly_with_its_balance_biases(tmp_path):
    """The balance bias is versioned with the weights: a 2bw pipeline cut at step 3 and resumed
    holds both versions of it and continues as the uninterrupted run."""
    common = ["schedule=2bw", "stages=2", "microbatches=2", "optim=adamw", "correction=ef", *MOE]
    common += ["lr_schedule=constant", "eval_every=3"]
    nobubble(tmp_path / "full", *common, "steps=6", stages=2)
    nobubble(tmp_path / "cut", *common, "steps=3", stages=2)
    done = run_train("--resume", str(tmp_path / "cut"), "steps=6", stages=2)
    assert done.returncode == 0, done.stderr
    assert_same_run(tmp_path / "full", tmp_path / "cut")
    assert routing(tmp_path / "full")[-1] == routing(tmp_path / "cut")[-1]


def test_an_moe_run_refuses_the_llama_export_and_writes_nothing(tmp_path, capsys):
    nobubble(tmp_path / "run", "steps=1", "eval_every=0", *MOE)
    code = main(["export", str(tmp_path / "run"), str(tmp_path / "hf")])
    assert code != 0 and "mixture-of-experts" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
