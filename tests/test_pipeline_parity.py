"""The real pipeline (torchrun, gloo, one process per stage) against the single-process engine.

Tolerance: none. Both backends run the same float32 operations per stage in the same order
(threads=1 on both sides), so losses and final weights must be bitwise equal; an off-by-one weight
version changes the losses in the third decimal.
"""

import pytest

from tests.helpers.pipeline import EXTENDED, assert_same_run, losses, nobubble

pytestmark = pytest.mark.slow

# Three cases run in make test as MoE models (tests/test_moe_pipeline.py: the same schedule,
# optimizer and shape, with a dense block 0 and MoE blocks 1-3), so their dense runs are extended.
CASES = [
    # (stages, schedule, microbatches, extra settings)
    pytest.param(2, "1f1b", 2, ["optim=adamw"], marks=EXTENDED),
    pytest.param(2, "2bw", 2, ["optim=adamw"], marks=EXTENDED),  # the ef case's path, less EF
    (2, "2bw", 2, ["optim=adamw", "correction=ef"]),
    pytest.param(2, "2bw", 4, ["optim=muon", "correction=ef"], marks=EXTENDED),
    # Newton–Schulz in bfloat16 here and float32 in the interleaved case below, whatever the
    # CPU (auto's choice depends on it); the other Muon cases take auto
    (2, "pipedream", 1, ["optim=muon", "muon_ns_dtype=bfloat16"]),
    (3, "zb-h1", 4, ["optim=adamw"]),  # ranks 1 and 2 keep W's pending, run them later
    # M = 2P: rank 0 runs the next step's forwards while rank 1 still runs its kept-back W's;
    # per-edge routes (NCCL's: a group per stage edge and channel, nobubble.pipeline.links)
    (2, "zb-h2", 4, ["optim=adamw", "p2p_routes=per-edge"]),
    # two model stages per process (0, 2 and 1, 3): per-stage clipping over 4 stages, tied
    # copies on stages 0 and 3 (processes 0 and 1); per-edge routes with edges both ways
    # between the two processes (1 -> 2 wraps around)
    (
        2,
        "interleaved-1f1b",
        4,
        ["optim=muon", "muon_ns_dtype=float32", "tie_embeddings=true", "p2p_routes=per-edge"],
    ),
    pytest.param(4, "gpipe", 4, ["optim=muon"], marks=EXTENDED),
    pytest.param(4, "2bw", 4, ["optim=muon"], marks=EXTENDED),
    pytest.param(4, "2bw", 4, ["optim=adamw", "correction=ef"], marks=EXTENDED),
    (4, "pipedream", 1, ["optim=adamw", "correction=ef"]),
    # the other delay corrections (docs/corrections.md); dc's λ large enough to move float32
    (2, "2bw", 2, ["optim=adamw", "correction=nesterov"]),
    (2, "2bw", 2, ["optim=adamw", "correction=dc", "dc_lambda=1000"]),
    pytest.param(  # the adaptive variant: the same wrapper, one more buffer slot
        2, "2bw", 2, ["optim=adamw", "correction=dc", "dc_mean_square_decay=0.9"], marks=EXTENDED
    ),
    (3, "pipedream", 1, ["optim=adamw", "correction=spike"]),
    # weight prediction (docs/corrections.md): 2bw, and pipedream's per-stage delays
    (2, "2bw", 2, ["optim=adamw", "correction=predict"]),
    (3, "pipedream", 1, ["optim=adamw", "correction=predict"]),
    # the V placement (stages 0, 3 on process 0 and 1, 2 on process 1): the turn at the bottom
    # (1 -> 2) handed over in memory, the head's loss and statistics on process 0; zb-v's split
    # backward, dualpipev's overlapped F&B and its whole B's on split stages
    (2, "zb-v", 4, ["optim=adamw"]),
    (2, "dualpipev", 4, ["optim=muon", "muon_ns_dtype=float32"]),
    pytest.param(3, "zb-v", 6, ["optim=adamw", "n_layers=6", "batch_size=12"], marks=EXTENDED),
    pytest.param(3, "dualpipev", 8, ["optim=adamw", "n_layers=6"], marks=EXTENDED),
]


# SOAP (the most state) in `make test`; the rest in `make test-all`: every optimizer's update is
# per parameter, and the simulator tests (test_checkpoint_names.py) move each one's state across
# stage splits exactly.
OTHER_OPTIMIZERS = [
    pytest.param(optim, marks=EXTENDED) if optim != "soap" else optim
    for optim in ["lion", "adan", "soap", "mars", "signum", "nadamw", "sgd"]
]


@pytest.mark.parametrize(("stages", "schedule", "micro", "extra"), CASES)
def test_pipeline_matches_the_simulation(tmp_path, stages, schedule, micro, extra):
    settings = [f"schedule={schedule}", f"stages={stages}", f"microbatches={micro}", "steps=6"]
    settings += ["eval_every=3", *extra]  # evaluations cut the pipeline run into segments
    nobubble(tmp_path / "pipeline", *settings, stages=stages)
    nobubble(tmp_path / "simulated", *settings)
    assert_same_run(tmp_path / "pipeline", tmp_path / "simulated")


@pytest.mark.parametrize("optim", OTHER_OPTIMIZERS)
def test_every_optimizer_runs_the_real_pipeline_exactly(tmp_path, optim):
    settings = ["schedule=2bw", "stages=2", "microbatches=2", "steps=4", "eval_every=0"]
    settings += [f"optim={optim}", "correction=ef"]
    nobubble(tmp_path / "pipeline", *settings, stages=2)
    nobubble(tmp_path / "simulated", *settings)
    assert_same_run(tmp_path / "pipeline", tmp_path / "simulated")


@pytest.mark.parametrize(
    ("schedule", "extra"),
    [("gpipe", []), ("zb-h1", []), ("zb-h2", []), ("interleaved-1f1b", ["chunks=3"])],
)
def test_sync_pipelines_equal_plain_gradient_accumulation(tmp_path, schedule, extra):
    """Without clipping (the only per-stage rule) a synchronous pipeline is the plain model;
    zb-h1's and zb-h2's split backward (I now, W later, in another order; zb-h2's next step
    overlapping this one's W's) and interleaved-1f1b's three model stages per process included."""
    common = ["microbatches=4", "steps=5", "grad_clip=0", "optim=adamw"]
    nobubble(tmp_path / "pipeline", f"schedule={schedule}", "stages=2", *extra, *common, stages=2)
    nobubble(tmp_path / "plain", "schedule=sync", "stages=1", *common)
    assert_same_run(tmp_path / "pipeline", tmp_path / "plain")


def test_delayed_runs_really_differ_from_sync(tmp_path):
    """Guards the parity tests against a delay that silently does nothing: in the simulator,
    which the cases above show the pipeline equals bitwise (so the pipeline's 2bw differs from
    its sync schedules too), at a fraction of two torchrun launches."""
    common = ["stages=2", "microbatches=2", "steps=5", "eval_every=0"]
    nobubble(tmp_path / "sync", "schedule=1f1b", *common)
    nobubble(tmp_path / "2bw", "schedule=2bw", *common)
    sync_train, _ = losses(tmp_path / "sync")
    delayed_train, _ = losses(tmp_path / "2bw")
    assert sync_train[0] == delayed_train[0]
    assert all(a != b for a, b in zip(sync_train[1:], delayed_train[1:], strict=True))


def test_bfloat16_hand_offs_stay_within_tolerance_and_float32_ones_are_exact(tmp_path):
    """Under bfloat16 autocast activations and gradients travel in bfloat16 (p2p_dtype=auto):
    half the bytes, the residual stream rounded once per stage edge, so the run follows the
    one-process engine within a tolerance but not bitwise; with p2p_dtype=float32 the pipeline
    equals the engine bitwise again, as in float32."""
    settings = ["schedule=1f1b", "stages=2", "microbatches=2", "steps=6", "eval_every=3"]
    settings += ["dtype=bfloat16", "optim=adamw"]
    nobubble(tmp_path / "wire", *settings, stages=2)
    nobubble(tmp_path / "exact", *settings, "p2p_dtype=float32", stages=2)
    nobubble(tmp_path / "simulated", *settings)
    assert_same_run(tmp_path / "exact", tmp_path / "simulated")
    wire, reference = losses(tmp_path / "wire"), losses(tmp_path / "simulated")
    assert wire != reference  # the hand-offs really were rounded
    for got, want in zip([*wire[0], *wire[1]], [*reference[0], *reference[1]], strict=True):
        assert got == pytest.approx(want, rel=1e-2)
