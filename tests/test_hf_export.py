"""``nobubble export --format hf``: a run folder's checkpoint loads in transformers and computes
what nobubble computes; its tokenizer encodes as the run's; versions, shards, refusals.

Logits are compared in float32 with ``atol=1e-5``: both sides compute the same function with
the same weights, in another order (transformers repeats the key/value heads where nobubble's
SDPA call groups them; its RoPE tables are computed in float32, nobubble's in float64 then
rounded), and the differences measured are below 1e-6 on logits of magnitude about 1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nobubble.checkpoint.files import CheckpointReader, publish, read_meta, staging_dir, write_shard
from nobubble.cli import main
from nobubble.configure import build_config
from nobubble.data import load_tokenizer
from nobubble.data.tokenizer import train_bpe
from nobubble.hf.convert import hf_name, parameter_shapes
from nobubble.hf.export import export_hf
from nobubble.hf.init import check_init_from, load_init_from
from nobubble.model.layers import build_model
from nobubble.model.partition import TIED_WEIGHT, partition, stage_parameter_names
from nobubble.model.resolve import model_config
from nobubble.one_process import OneProcessEngine
from nobubble.runfolder.reading import saved_config
from tests.helpers.pipeline import snapshot

ATOL = 1e-5  # float32 logits; see the module docstring
TEXTS = [
    "Who's there?\nNay, answer me: stand, and unfold yourself.\n",
    "Long live the king! Ünïcödé — 東京 🎭\n",
    "  leading spaces, tabs\tand\r\nwindows line ends  ",
    "",
]
COMMON = ["seq_len=32", "batch_size=4", "steps=2", "eval_batches=1", "threads=1"]
COMMON += ["warmup_steps=1", "lr=1e-2"]
# the tiny preset (GQA: 4 heads, 2 key/value heads), byte tokenizer, under 2bw (a stash)
TINY = ["schedule=2bw", "stages=2", "microbatches=2"]
# a tied embedding split over two stages, one key/value head, a BPE tokenizer
TIED = ["d_model=64", "n_layers=2", "n_heads=4", "n_kv_heads=1", "d_ff=128"]
TIED += ["tie_embeddings=true", "stages=2"]


def train_run(out: Path, *args: str) -> Path:
    assert main(["train", "--no-progress", "--out", str(out), *COMMON, *args]) == 0
    return out


@pytest.fixture(scope="module")
def hf():
    """transformers, never reaching for the network."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    bpe = train_bpe([f"line {i}: the quick brown fox, ça va? 東京\n" * 3 for i in range(100)], 300)
    bpe.save(root / "bpe")
    return {
        "tiny": train_run(root / "tiny", *TINY),
        "tied": train_run(root / "tied", *TIED, f"tokenizer={root / 'bpe' / 'tokenizer.json'}"),
    }


def model_of(run: Path):
    cfg = build_config(saved_config(run))
    return model_config(cfg, load_tokenizer(run).vocab_size)


def checkpoint_version(run: Path, version: int | None = None) -> dict[str, torch.Tensor]:
    """``version`` (default: the newest) of every parameter of the run's newest checkpoint."""
    reader = CheckpointReader(sorted((run / "checkpoints").glob("step_*"))[-1])
    chosen = reader.step if version is None else version
    tensors = reader.weights(reader.index, versions={chosen})
    return {key.split("/", 1)[1]: tensor for key, tensor in tensors.items()}


def nobubble_logits(run: Path, weights: dict[str, torch.Tensor], tokens: torch.Tensor):
    model = build_model(model_of(run))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
        return model(tokens)


def tokens_for(run: Path) -> torch.Tensor:
    vocab = load_tokenizer(run).vocab_size
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    return {name: export_hf(run, root / name) for name, run in runs.items()}


@pytest.mark.parametrize("name", ["tiny", "tied"])
def test_exported_model_computes_the_runs_logits_in_transformers(hf, runs, exports, name):
    run, out = runs[name], exports[name]
    config = json.loads((out / "config.json").read_text())
    mc = model_of(run)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is mc.tie_embeddings
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (
        mc.n_heads,
        mc.n_kv_heads,
    )
    saved = load_file(out / "model.safetensors")
    assert ("lm_head.weight" in saved) is not mc.tie_embeddings
    assert saved.keys() == {hf_name(n) for n in parameter_shapes(mc)}

    model = hf.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    tokens = tokens_for(run)
    with torch.no_grad():
        theirs = model(tokens).logits
    ours = nobubble_logits(run, checkpoint_version(run), tokens)
    assert theirs.shape == ours.shape == (2, 32, mc.vocab_size)
    assert (theirs - ours).abs().max().item() < ATOL
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == load_tokenizer(run).eos_id


@pytest.mark.parametrize("name", ["tiny", "tied"])
def test_exported_tokenizer_loads_fast_and_encodes_like_the_run(hf, runs, exports, name):
    ours = load_tokenizer(runs[name])
    theirs = hf.AutoTokenizer.from_pretrained(exports[name], local_files_only=True)
    assert theirs.is_fast and theirs.eos_token_id == ours.eos_id
    for text in TEXTS:
        ids = ours.encode(text)
        assert theirs(text, add_special_tokens=False)["input_ids"] == ids
        assert theirs(text)["input_ids"] == ids  # nothing is added around a text
        assert theirs.decode(ids) == text
    assert (ours.spec == "byte") is (name == "tiny")  # the other one is a BPE


def test_a_stashed_version_exports_its_own_weights(runs, tmp_path, capsys):
    run = runs["tiny"]  # 2bw: the checkpoint of step 2 holds versions 1 (the stash) and 2
    assert main(["export", str(run), str(tmp_path / "v1"), "--format", "hf", "--version", "1"]) == 0
    assert "weight version 1" in capsys.readouterr().out
    stashed, newest = load_file(tmp_path / "v1" / "model.safetensors"), checkpoint_version(run)
    for name, tensor in checkpoint_version(run, 1).items():
        assert torch.equal(stashed[hf_name(name)], tensor)
    assert not torch.equal(stashed[hf_name("head.weight")], newest["head.weight"])
    provenance = json.loads((tmp_path / "v1" / "nobubble.json").read_text())
    assert (provenance["step"], provenance["version"], provenance["schedule"]) == (2, 1, "2bw")


@pytest.mark.parametrize("name", ["tiny", "tied"])
def test_an_export_starts_a_new_run_with_exactly_its_weights(runs, exports, name):
    run, out = runs[name], exports[name]
    cfg = build_config({**saved_config(run), "init_from": str(out)})
    tokenizer = load_tokenizer(run)
    mc = model_config(cfg, tokenizer.vocab_size)
    check_init_from(out, mc, tokenizer)
    engine = OneProcessEngine(cfg, mc, torch.device("cpu"))
    load_init_from(engine, out)
    started, newest = engine.named_weights(), checkpoint_version(run)
    assert started.keys() == newest.keys()
    assert all(torch.equal(started[k], newest[k]) for k in newest)
    last_stage = engine.trainer.stores[-1].params  # the tied run's split: its copy too
    if name == "tied":
        assert torch.equal(last_stage[TIED_WEIGHT], newest[TIED_WEIGHT])


def reshard(run: Path, dest: Path, stages: int) -> Path:
    """A copy of ``run`` whose newest checkpoint has one shard per stage of a ``stages``-stage
    pipeline, written as the pipeline writes it (the tied weight in the first and last)."""
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("checkpoints"))
    source = sorted((run / "checkpoints").glob("step_*"))[-1]
    reader, meta = CheckpointReader(source), read_meta(source)
    mc = model_of(run)
    groups = stage_parameter_names(sorted(reader.index), partition(mc.n_layers, stages))
    if mc.tie_embeddings:
        groups[-1].append(TIED_WEIGHT)
    root = dest / "checkpoints"
    for index, names in enumerate(groups):
        optimizer = reader.optimizer(names)
        write_shard(
            staging_dir(root, reader.step),
            index,
            reader.weights(names),
            reader.step,
            optimizer,
            reader.rng(0),
            meta,
        )
    publish(staging_dir(root, reader.step), root / source.name, reader.step, stages)
    return dest


def test_a_pipeline_checkpoint_exports_as_the_single_shard_one(runs, exports, tmp_path):
    sharded = reshard(runs["tied"], tmp_path / "run", 2)
    manifest = json.loads(next((sharded / "checkpoints").glob("step_*/manifest.json")).read_text())
    assert manifest["shards"] == 2
    for shard in ("shard_0", "shard_1"):  # the tied weight is in both
        state = json.loads(
            next((sharded / "checkpoints").glob(f"step_*/{shard}/state.json")).read_text()
        )
        assert TIED_WEIGHT in state["params"]
    out = export_hf(sharded, tmp_path / "out")
    a, b = load_file(out / "model.safetensors"), load_file(exports["tied"] / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_crash_while_writing_leaves_no_export(runs, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("nobubble.hf.export.save_file", fail)
    with pytest.raises(KeyboardInterrupt):
        export_hf(runs["tied"], tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def refusal(capsys, *args: str) -> str:
    assert main(["export", *map(str, args)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nobubble: error: ") and err.count("\n") == 1
    return err


def test_refusals_name_the_problem_and_change_nothing(runs, tmp_path, capsys):
    run = runs["tiny"]
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep")
    assert "already exists and is not an empty folder" in refusal(capsys, run, full)
    assert [p.name for p in full.iterdir()] == ["mine.txt"]
    assert "is not a folder" in refusal(capsys, run, full / "mine.txt")
    assert "version 0 is not one that every parameter holds" in refusal(
        capsys, run, tmp_path / "a", "--version", "0"
    )
    assert "holds weight version(s) 1, 2 of every parameter" in refusal(
        capsys, run, tmp_path / "a", "--version", "7"
    )
    assert "no checkpoint of step 5 (steps with one: 2)" in refusal(
        capsys, run, tmp_path / "a", "--step", "5"
    )
    assert "not a nobubble run folder" in refusal(capsys, tmp_path, tmp_path / "a")
    bare = tmp_path / "bare"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("checkpoints"))
    assert "holds no complete checkpoint to export (it has none)" in refusal(
        capsys, bare, tmp_path / "a"
    )
    assert not (tmp_path / "a").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(run), str(empty)]) == 0  # an empty folder is filled
    assert (empty / "model.safetensors").is_file()


def test_an_out_that_cannot_be_written_is_refused_before_reading_the_run(
    runs, tmp_path, capsys, unwritable, monkeypatch
):
    """Under a regular file, in a folder that takes no files (``unwritable``: see
    conftest.lock_writes for how read-only is simulated), in /proc: one line, nothing made."""
    monkeypatch.setattr("nobubble.hf.export.export_hf", None)  # never reached
    (tmp_path / "file").write_text("keep")
    outs = [tmp_path / "file" / "model", unwritable / "model", unwritable / "a" / "b"]
    outs += [Path("/proc/nobubble-export")] if Path("/proc/self").is_dir() else []
    before = snapshot(tmp_path)
    for out in outs:
        assert f"OUT {out}: " in refusal(capsys, runs["tiny"], out)
    assert snapshot(tmp_path) == before
