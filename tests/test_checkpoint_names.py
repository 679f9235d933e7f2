"""Checkpoints keyed by parameter name: optimizer state moves between partitions of the model
(the simulator's one optimizer, any pipeline split), exactly; what cannot move is refused."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from nobubble.checkpoint.files import (
    CheckpointError,
    CheckpointReader,
    publish,
    read_meta,
    sha256,
    staging_dir,
    write_shard,
)
from nobubble.checkpoint.named_state import (
    NamedState,
    NamedStateError,
    load_named_state,
    named_state,
)
from nobubble.configure import build_config
from nobubble.model.layers import build_model
from nobubble.model.partition import partition, stage_parameter_names
from nobubble.model.resolve import model_config
from nobubble.one_process import OneProcessEngine
from nobubble.optim.registry import OPTIMIZERS
from nobubble.runfolder.resume import WHY_NOT
from nobubble.stage_update import build_stage_optimizer
from tests.helpers.pipeline import (
    EXTENDED,
    assert_same_run,
    nobubble,
    snapshot,
)
from tests.helpers.runs import CONSTANT, assert_close_runs, launch, resume, train

MODEL = {"d_model": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64, "seq_len": 32}
SPLITS = {"whole": 1, "2 stages": 2, "3 stages": 3}


def _cfg(optim: str, ef: bool):
    return build_config({**MODEL, "optim": optim, "correction": "ef" if ef else "none", "lr": 1e-2})


def _model(cfg):
    return build_model(model_config(cfg, tokenizer_vocab=48), seed=0)


def _optimizers(model, cfg, stages: int) -> list:
    """One optimizer per stage of a ``stages``-way split, as the pipeline builds them."""
    params = dict(model.named_parameters())
    specs = partition(cfg.n_layers, stages)
    return [
        build_stage_optimizer([(n, params[n]) for n in names], cfg, delay=1)
        for names in stage_parameter_names(list(params), specs)
    ]


def _step(model, optimizers, t: int) -> None:
    """A deterministic, parameter-dependent gradient (the same for any split), then a step."""
    for name, p in model.named_parameters():
        p.grad = torch.sin(3.0 * p.detach() + t + len(name)) + 0.1 * p.detach()
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)


def _save(model, optimizers, folder, step: int) -> None:
    """A checkpoint with one shard per optimizer, as the training loop writes it."""
    params = dict(model.named_parameters())
    for index, opt in enumerate(optimizers):
        state = named_state(opt)
        names = [n for group in opt.param_groups for n in group["param_names"]]
        weights = {f"v{step}/{n}": params[n] for n in names}
        write_shard(staging_dir(folder, step), index, weights, step, state, torch.zeros(1), {})
    publish(staging_dir(folder, step), folder / "ckpt", step, len(optimizers))


def _load(model, optimizers, folder) -> None:
    reader = CheckpointReader(folder / "ckpt")
    for opt in optimizers:
        names = [n for group in opt.param_groups for n in group["param_names"]]
        load_named_state(opt, reader.optimizer(names))


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("ef", [False, True], ids=["plain", "ef"])
@pytest.mark.parametrize("optim", OPTIMIZERS)
@pytest.mark.parametrize(("source", "target"), [("whole", "3 stages"), ("2 stages", "whole")])
def test_optimizer_state_moves_to_another_partition_exactly(tmp_path, optim, ef, source, target):
    cfg = _cfg(optim, ef)
    model = _model(cfg)
    optimizers = _optimizers(model, cfg, SPLITS[source])
    for t in range(3):
        _step(model, optimizers, t)
    _save(model, optimizers, tmp_path, 3)

    other = _model(cfg)
    with torch.no_grad():
        for name, p in other.named_parameters():
            p.copy_(dict(model.named_parameters())[name])
    moved = _optimizers(other, cfg, SPLITS[target])
    _load(other, moved, tmp_path)
    for t in (3, 4):
        _step(model, optimizers, t)
        _step(other, moved, t)
    want, got = _weights(model), _weights(other)
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_a_missing_or_extra_parameter_is_a_clear_error(tmp_path):
    cfg = _cfg("muon", True)
    model = _model(cfg)
    stages = _optimizers(model, cfg, 2)
    _step(model, stages, 0)
    first, second = named_state(stages[0]), named_state(stages[1])
    whole = _optimizers(model, cfg, 1)[0]
    with pytest.raises(NamedStateError, match=r"no entry for \d+ parameter"):
        load_named_state(whole, first)
    with pytest.raises(NamedStateError, match="does not hold"):
        load_named_state(stages[0], NamedState.merge([first, second]))
    load_named_state(stages[0], NamedState.merge([first, second]), skip_unowned=True)


def test_a_state_of_another_optimizer_or_without_ef_is_refused():
    model = _model(_cfg("adamw", False))
    adamw = _optimizers(model, _cfg("adamw", False), 1)[0]
    _step(model, [adamw], 0)
    with pytest.raises(NamedStateError, match="optimized by AdamW, this optimizer uses Lion"):
        load_named_state(_optimizers(model, _cfg("lion", False), 1)[0], named_state(adamw))
    with pytest.raises(NamedStateError, match="correction=none, this optimizer has correction=ef"):
        load_named_state(_optimizers(model, _cfg("adamw", True), 1)[0], named_state(adamw))


def test_group_state_that_disagrees_between_shards_is_refused():
    """pytorch_optimizer keeps a step count per param group: merged groups must agree on it."""
    cfg = _cfg("lion", False)
    model = _model(cfg)
    stages = _optimizers(model, cfg, 2)
    _step(model, stages, 0)
    _step(model, stages[:1], 1)  # stage 0 stepped twice, stage 1 once
    merged = NamedState.merge([named_state(stages[0]), named_state(stages[1])])
    with pytest.raises(NamedStateError, match="disagree on 'step'"):
        load_named_state(_optimizers(model, cfg, 1)[0], merged)


# -- whole runs in one process ----------------------------------------------------------------


def test_a_new_stage_split_continues_exactly_in_the_simulator(tmp_path):
    """2bw: every stage holds versions t-1 and t, whatever the split. Without clipping (the only
    per-stage rule) a 2-stage and a 4-stage run are the same run."""
    common = [
        *CONSTANT,
        "schedule=2bw",
        "microbatches=4",
        "grad_clip=0",
        "optim=muon",
        "correction=ef",
    ]
    assert train(tmp_path / "full", *common, "stages=4", "steps=6") == 0
    assert train(tmp_path / "cut", *common, "stages=2", "steps=3") == 0
    assert resume(tmp_path / "cut", "stages=4", "steps=6") == 0
    assert_same_run(tmp_path / "full", tmp_path / "cut")
    assert json.loads((tmp_path / "cut" / "config.json").read_text())["stages"] == 4


def test_a_new_stage_split_with_clipping_warns_that_clipping_follows_the_stages(tmp_path):
    common = [*CONSTANT, "schedule=2bw", "microbatches=4", "steps=3"]
    assert train(tmp_path / "r", *common, "stages=2") == 0
    with pytest.warns(UserWarning, match=r"clipped per stage .* over the 4 new stages"):
        assert resume(tmp_path / "r", "stages=4", "steps=4") == 0


def test_pipedream_across_a_changed_stage_split_is_refused(tmp_path, capsys):
    assert train(tmp_path / "r", "schedule=pipedream", "stages=2", "steps=2") == 0
    before = snapshot(tmp_path)
    for change in (["stages=3"], ["stage_layers=[1,3]"]):
        assert resume(tmp_path / "r", *change, "steps=3") == 2
        err = capsys.readouterr().err
        # the schedule, a stage's delay that would change, and the split to keep
        old, new = re.search(r"under pipedream .* from delay (\d+) to (\d+)", err).groups()
        assert old != new
        assert "stages=2" in err
        assert "Traceback" not in err
    assert snapshot(tmp_path) == before


def test_a_changed_schedule_is_refused_naming_why(tmp_path, capsys):
    assert train(tmp_path / "r", "schedule=2bw", "steps=2") == 0
    assert resume(tmp_path / "r", "schedule=sync", "steps=3") == 2
    err = capsys.readouterr().err
    assert "schedule='sync'" in err and "schedule='2bw'" in err  # the change and the saved value
    assert WHY_NOT["schedule"] in err  # why it cannot change
    assert "--out" in err  # the fix: a new run


def _rewrite_as_format_1(run, step: int) -> None:
    """Turn the checkpoint of ``step`` into what nobubble wrote before format 2: the optimizer's
    position-keyed state dict pickled in state.pt, no index, no format in the manifest."""
    folder = run / "checkpoints" / f"step_{step:06d}"
    cfg = build_config(read_meta(folder)["config"])
    reader = CheckpointReader(folder)
    loaded = reader.load()
    vocab = loaded.weights[f"v{step}/embed.weight"].shape[0]
    engine = OneProcessEngine(cfg, model_config(cfg, vocab), torch.device("cpu"))
    engine.restore(loaded.weights, {"step": loaded.step, "optimizer": loaded.optimizer})
    # format 1 held one optimizer over the whole model, its state keyed by position
    whole = build_stage_optimizer(list(engine.model.named_parameters()), cfg, delay=1)
    load_named_state(whole, loaded.optimizer)
    shard = folder / "shard_0"
    state = {"engine": {"step": step, "optimizer": whole.state_dict()}}
    torch.save({**state, "torch_rng": reader.rng(0)}, shard / "state.pt")
    save_file(engine.checkpoint_tensors(), shard / "weights.safetensors")
    (shard / "state.json").unlink()
    (shard / "state.safetensors").unlink()
    files = {f"shard_0/{p.name}": sha256(p) for p in sorted(shard.iterdir())}
    manifest = {"step": step, "shards": 1, "files": files}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_format_1_checkpoint_still_resumes_exactly(tmp_path):
    common = [
        *CONSTANT,
        "schedule=2bw",
        "microbatches=2",
        "optim=muon",
        "correction=ef",
        "stages=2",
    ]
    assert train(tmp_path / "full", *common, "steps=6") == 0
    assert train(tmp_path / "cut", *common, "steps=3") == 0
    _rewrite_as_format_1(tmp_path / "cut", 3)
    shard = tmp_path / "cut" / "checkpoints" / "step_000003" / "shard_0"
    assert {p.name for p in shard.iterdir()} == {"meta.json", "state.pt", "weights.safetensors"}
    assert resume(tmp_path / "cut", "steps=6") == 0
    assert_same_run(tmp_path / "full", tmp_path / "cut")


def test_a_checkpoint_of_a_newer_format_is_refused(tmp_path, capsys):
    assert train(tmp_path / "r", "steps=2") == 0
    folder = tmp_path / "r" / "checkpoints" / "step_000002"
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "format": 99}))
    assert resume(tmp_path / "r", "steps=3") == 2
    assert "written by a newer nobubble; upgrade nobubble" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="format 99"):
        CheckpointReader(folder)
    shutil.rmtree(tmp_path / "r")


# -- across launchers and stage counts (torchrun) -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [["optim=adamw", "correction=ef"], ["optim=muon", "correction=ef+predict"]],
    ids=["adamw+ef", "muon+ef+predict"],
)
def test_a_checkpoint_continues_exactly_in_the_other_launcher(tmp_path, extra):
    """The simulator and the pipeline compute the same run (test_pipeline_parity.py), so a
    pipeline checkpoint continued in one process, and the other way round, is that run. With
    predict the pipeline also saves w[t-2] and reads it back."""
    common = [*CONSTANT, "schedule=2bw", "microbatches=2", "stages=2", *extra]
    assert train(tmp_path / "full", *common, "steps=6") == 0

    nobubble(tmp_path / "pipeline", *common, "steps=3", stages=2)
    assert resume(tmp_path / "pipeline", "steps=6") == 0
    assert_same_run(tmp_path / "full", tmp_path / "pipeline")

    assert train(tmp_path / "simulated", *common, "steps=3") == 0
    launch("--resume", str(tmp_path / "simulated"), "steps=6", stages=2)
    assert_same_run(tmp_path / "full", tmp_path / "simulated")


@pytest.mark.slow
def test_an_interleaved_pipeline_checkpoint_continues_exactly_in_one_process(tmp_path):
    """Two processes holding model stages 0, 2 and 1, 3: one shard each, by name, which the
    single-process engine (the same 4-stage semantics) continues as if never cut."""
    common = [*CONSTANT, "schedule=interleaved-1f1b", "microbatches=2", "stages=2", "optim=adamw"]
    assert train(tmp_path / "full", *common, "steps=6") == 0
    nobubble(tmp_path / "cut", *common, "steps=3", stages=2)
    step3 = tmp_path / "cut" / "checkpoints" / "step_000003"
    assert json.loads((step3 / "manifest.json").read_text())["shards"] == 2
    assert resume(tmp_path / "cut", "steps=6") == 0
    assert_same_run(tmp_path / "full", tmp_path / "cut")


@pytest.mark.slow
def test_a_dualpipev_pipeline_resumed_equals_the_uninterrupted_run(tmp_path):
    """Under V each process holds stages r and 2P-1-r (0, 3 and 1, 2): one shard each, by name;
    the pipeline continued from step 3 is the uninterrupted run (the one-process engine's, which
    tests/test_pipeline_parity.py holds bitwise equal to the pipeline's)."""
    common = [*CONSTANT, "schedule=dualpipev", "microbatches=4", "stages=2", "optim=adamw"]
    assert train(tmp_path / "full", *common, "steps=6") == 0
    nobubble(tmp_path / "cut", *common, "steps=3", stages=2)
    step3 = tmp_path / "cut" / "checkpoints" / "step_000003"
    assert json.loads((step3 / "manifest.json").read_text())["shards"] == 2
    launch("--resume", str(tmp_path / "cut"), "steps=6", stages=2)
    assert_same_run(tmp_path / "full", tmp_path / "cut")


@pytest.mark.slow
@pytest.mark.parametrize(
    "optim",
    [["optim=adamw", "correction=ef"], pytest.param(["optim=muon"], marks=EXTENDED)],
    ids=["adamw+ef", "muon"],
)
def test_a_2bw_pipeline_checkpoint_continues_exactly_on_twice_the_stages(tmp_path, optim):
    """2 stages -> 4 under torchrun equals the uninterrupted 4-stage run. The reference is the
    simulator's 4-stage run, which test_pipeline_parity.py holds bitwise equal to the 4-stage
    pipeline for these very settings; grad_clip=0 so that the 2-stage start is the same run."""
    common = [*CONSTANT, "schedule=2bw", "microbatches=4", "grad_clip=0", *optim]
    assert train(tmp_path / "full", *common, "stages=4", "steps=6") == 0
    nobubble(tmp_path / "cut", *common, "stages=2", "steps=3", stages=2)
    launch("--resume", str(tmp_path / "cut"), "stages=4", "steps=6", stages=4)
    assert_same_run(tmp_path / "full", tmp_path / "cut")
    newest = tmp_path / "cut" / "checkpoints" / "step_000006"
    assert json.loads((newest / "manifest.json").read_text())["shards"] == 4


@pytest.mark.slow
def test_a_checkpoint_continues_with_another_dp(tmp_path):
    """One process -> two data-parallel replicas. dp changes the order of the gradient's sums
    (the last bits), so the comparison is test_data_parallel.py's tolerance: a replica that
    loaded the wrong state or data position would be off in the third decimal."""
    common = [*CONSTANT, "schedule=sync", "microbatches=2", "optim=adamw"]
    assert train(tmp_path / "full", *common, "steps=6") == 0
    assert train(tmp_path / "cut", *common, "steps=3") == 0
    launch("--resume", str(tmp_path / "cut"), "dp=2", "steps=6", stages=2)
    assert json.loads((tmp_path / "cut" / "config.json").read_text())["dp"] == 2
    assert_close_runs(tmp_path / "full", tmp_path / "cut")
