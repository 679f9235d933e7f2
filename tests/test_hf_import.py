"""``init_from=PATH``: a run starts from a local Hugging Face Llama checkpoint, in the simulator
and in the pipeline, and computes transformers' logits and loss at step 0; a checkpoint of
another architecture, vocabulary or tokenizer is refused with the settings that fix it.

Tolerances as in test_hf_export: float32 logits within 1e-5 (same function, another order of
operations), losses within a relative 1e-6.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nobubble.cli import main
from nobubble.config import ConfigError
from nobubble.configure import build_config
from nobubble.data import ByteTokenizer, build_data
from nobubble.data.tokenizer import train_bpe
from nobubble.hf.convert import hf_config, hf_name, parameter_shapes
from nobubble.hf.init import check_init_from, load_init_from
from nobubble.model.layers import lm_loss
from nobubble.model.partition import TIED_WEIGHT
from nobubble.model.resolve import model_config
from nobubble.one_process import OneProcessEngine
from nobubble.runfolder.reading import saved_config
from tests.helpers.pipeline import SMALL, metrics, nobubble
from tests.helpers.runs import train

ATOL = 1e-5
# SMALL's shape (d_model 32, 4 blocks, 4 heads, 2 key/value heads, d_ff 64), byte vocabulary
SHAPE = dict(
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=320,
    rms_norm_eps=1e-5,
    max_position_embeddings=64,
)
# the tied model: one key/value head and another RoPE base, which the run must set
TIED_ARGS = ["tie_embeddings=true", "n_kv_heads=1", "rope_theta=50000"]


def settings(*args: str) -> dict:
    return dict(arg.split("=", 1) for arg in [*SMALL, *args])


@pytest.fixture(scope="module")
def hf():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield pytest.importorskip("transformers")


def random_llama(hf, folder: Path, seed: int, **changes):
    """A LlamaForCausalLM of SHAPE with every weight random (norms too), saved in ``folder``."""
    torch.manual_seed(seed)
    config = hf.LlamaConfig(**{**SHAPE, **changes})
    model = hf.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0, 0.1)
    model.save_pretrained(folder, max_shard_size="20KB")  # sharded: read through the index
    return model


@pytest.fixture(scope="module")
def llamas(hf, tmp_path_factory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("llamas")
    gqa = random_llama(hf, root / "gqa", 0)
    tied = random_llama(
        hf,
        root / "tied",
        1,
        tie_word_embeddings=True,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )
    assert (root / "gqa" / "model.safetensors.index.json").is_file()
    return {"gqa": (root / "gqa", gqa), "tied": (root / "tied", tied)}


def engine_from(folder: Path, *args: str) -> OneProcessEngine:
    cfg = build_config(settings(*args, f"init_from={folder}"))
    mc = model_config(cfg, ByteTokenizer.vocab_size)
    check_init_from(folder, mc, ByteTokenizer())
    engine = OneProcessEngine(cfg, mc, torch.device("cpu"))
    load_init_from(engine, folder)
    return engine


@pytest.mark.parametrize(
    "name, args",
    [("gqa", ["schedule=2bw", "stages=2", "microbatches=2"]), ("tied", [*TIED_ARGS, "stages=2"])],
)
def test_the_simulator_starts_with_transformers_logits_and_loss(llamas, name, args):
    folder, model = llamas[name]
    engine = engine_from(folder, *args)
    tokens = torch.randint(0, 320, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = engine.model(tokens[:, :-1])
        theirs = model(tokens[:, :-1]).logits
        their_loss = model(tokens, labels=tokens).loss.item()
    assert (ours - theirs).abs().max().item() < ATOL
    assert math.isclose(lm_loss(ours, tokens[:, 1:]).item(), their_loss, rel_tol=1e-6)
    if name == "tied":  # the last stage's copy of the tied weight holds it too
        copy = engine.trainer.stores[-1].params[TIED_WEIGHT]
        assert torch.equal(copy, model.model.embed_tokens.weight)


def hf_val_loss(model, run: Path) -> float:
    """transformers' mean loss over the run's validation batches (what it logs at step 0)."""
    data = build_data(build_config(saved_config(run)), run)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in data.val:
            logits = model(batch[:, :-1]).logits
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
            ).item()
            count += batch[:, 1:].numel()
    return total / count


def step0_val_loss(run: Path) -> float:
    return next(row["val_loss"] for row in metrics(run) if row["step"] == 0)


def test_a_run_starts_from_init_from_and_a_resumed_run_ignores_it(llamas, tmp_path, capsys):
    folder, model = llamas["gqa"]
    run = tmp_path / "run"
    assert train(run, f"init_from={folder}", "steps=1", "eval_every=1") == 0
    assert f"(weights from init_from={folder})" in capsys.readouterr().out
    assert math.isclose(step0_val_loss(run), hf_val_loss(model, run), rel_tol=1e-6)
    # a resumed run continues from its checkpoint: another init_from is not even read
    args = ["--resume", str(run), "steps=2", f"init_from={tmp_path / 'nothing'}"]
    assert main(["train", "--no-progress", *args]) == 0


@pytest.mark.slow
def test_the_pipeline_starts_from_init_from_and_exports_back(hf, llamas, tmp_path):
    folder, model = llamas["tied"]
    run = tmp_path / "run"
    args = [*TIED_ARGS, f"init_from={folder}", "schedule=2bw", "stages=2", "microbatches=2"]
    nobubble(run, *args, "steps=1", stages=2)
    assert math.isclose(step0_val_loss(run), hf_val_loss(model, run), rel_tol=1e-6)
    # the pipeline's checkpoint (two shards, the tied weight in both) exports and loads
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    exported = hf.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    trained = engine_from(tmp_path / "out", *TIED_ARGS)
    tokens = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        gap = (exported(tokens).logits - trained.model(tokens)).abs().max().item()
        moved = (exported.model.norm.weight - model.model.norm.weight).abs().max().item()
    assert gap < ATOL and moved > 0  # trained one step away from the start


# -- refusals ---------------------------------------------------------------------------------


def fake_checkpoint(folder: Path, config: dict, tensors: dict | None = None) -> Path:
    """A checkpoint folder with ``config`` and ``tensors`` (default: one placeholder)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors or {"x": torch.zeros(1)}, folder / "model.safetensors")
    return folder


def run_model(*args: str):
    return model_config(build_config(settings(*args)), ByteTokenizer.vocab_size)


def llama_config(**changes) -> dict:
    return {**hf_config(run_model(), eos_id=256), **changes}


def refused(folder: Path, *args: str) -> str:
    with pytest.raises(ConfigError) as caught:
        check_init_from(folder, run_model(*args), ByteTokenizer())
    return str(caught.value)


def test_another_shape_is_refused_with_the_settings_that_fit(tmp_path):
    smollm = llama_config(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        head_dim=64,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        rope_theta=100000.0,
        vocab_size=49152,
    )
    message = refused(fake_checkpoint(tmp_path / "smol", smollm))
    assert message.startswith(f"init_from={tmp_path / 'smol'} does not fit the model: ")
    for part in [
        "d_model 576 there, 32 here",
        "n_layers 30 there, 4 here",
        "tie_embeddings True there, False here",
        "rope_theta 100000.0 there, 10000.0 here",
        "vocab_size 49152 there, 320 here",
        "Set d_model=576 n_layers=30 n_heads=9 n_kv_heads=3 d_ff=1536 tie_embeddings=true "
        "rope_theta=100000 tokenizer=PATH/tokenizer.json",
        "preset=smollm2-135m has this shape",
    ]:
        assert part in message, part
    untied = fake_checkpoint(tmp_path / "untied", llama_config(tie_word_embeddings=False))
    assert "tie_embeddings False there, True here" in refused(untied, "tie_embeddings=true")


@pytest.mark.parametrize(
    "changes, part",
    [
        ({"model_type": "mistral"}, "model_type mistral there, llama here"),
        ({"attention_bias": True}, "attention_bias True there, False here"),
        ({"mlp_bias": True}, "mlp_bias True there, False here"),
        ({"hidden_act": "gelu"}, "hidden_act gelu there, silu here"),
        ({"head_dim": 16}, "head_dim 16 there, 8 here"),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
            "rope scaling llama3 there, none here",
        ),
        ({"rope_parameters": None, "rope_scaling": {"type": "linear"}}, "rope scaling linear"),
    ],
)
def test_an_architecture_nobubble_cannot_train_is_refused(tmp_path, changes, part):
    message = refused(fake_checkpoint(tmp_path / "c", llama_config(**changes)))
    assert part in message and "nobubble cannot start from this checkpoint" in message


def test_another_norm_eps_or_vocabulary_size_is_refused_with_the_key_that_fits(tmp_path):
    eps = fake_checkpoint(tmp_path / "eps", llama_config(rms_norm_eps=1e-6))
    message = refused(eps)
    assert "rms_norm_eps 1e-06 there, 1e-05 here" in message and "Set norm_eps=1e-06" in message
    assert "rms_norm_eps" not in refused(eps, "norm_eps=1e-6")  # now only the tensors differ
    wide = fake_checkpoint(tmp_path / "wide", llama_config(vocab_size=384))
    ByteTokenizer().save(wide)  # the same tokens: only the embedding has more rows
    message = refused(wide)
    assert "vocab_size 384 there, 320 here" in message and "Set vocab_size=384" in message
    assert "vocab_size" not in refused(wide, "vocab_size=384")


def test_another_tokenizer_is_refused_with_the_checkpoints_one_as_the_fix(tmp_path):
    folder = fake_checkpoint(tmp_path / "c", llama_config())
    train_bpe(["the quick brown fox\n" * 20], 300).save(folder)
    message = refused(folder)
    assert "token ids would stand for other tokens" in message
    assert f"Set tokenizer={folder / 'tokenizer.json'}" in message
    ByteTokenizer().save(folder)  # the run's own tokenizer: accepted
    with pytest.raises(ConfigError, match=r"lacks lm_head\.weight"):
        check_init_from(folder, run_model(), ByteTokenizer())


def real_tensors(**changes) -> dict[str, torch.Tensor]:
    return {
        hf_name(name): torch.zeros(shape) for name, shape in parameter_shapes(run_model()).items()
    } | changes


def test_missing_extra_or_misshapen_tensors_and_unreadable_folders_are_refused(tmp_path):
    config = llama_config()
    fine = fake_checkpoint(tmp_path / "fine", config, real_tensors())
    check_init_from(fine, run_model(), ByteTokenizer())
    tensors = real_tensors()
    del tensors["model.norm.weight"]
    missing = fake_checkpoint(tmp_path / "missing", config, tensors)
    assert "lacks model.norm.weight (1 of the 39 tensors" in refused(missing)
    bias = real_tensors(**{"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)})
    extra = fake_checkpoint(tmp_path / "extra", config, bias)
    assert "holds model.layers.0.self_attn.q_proj.bias" in refused(extra)
    wrong = real_tensors(**{"model.norm.weight": torch.zeros(33)})
    assert "of shape (33,)" in refused(fake_checkpoint(tmp_path / "wrong", config, wrong))
    assert "huggingface-cli download" in refused(tmp_path / "absent")
    (tmp_path / "bare").mkdir()
    assert "has no config.json" in refused(tmp_path / "bare")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(config))
    (pickled / "pytorch_model.bin").write_bytes(b"")
    assert "pickled PyTorch weights" in refused(pickled)


def test_the_cli_refuses_in_one_line_and_leaves_no_run(tmp_path, capsys):
    folder = fake_checkpoint(tmp_path / "c", llama_config(hidden_size=64, head_dim=16))
    assert train(tmp_path / "run", f"init_from={folder}", "steps=1") == 2
    err = capsys.readouterr().err
    assert err.startswith("nobubble: error: init_from=") and err.count("\n") == 1
    assert "d_model 64 there, 32 here" in err and "Set d_model=64" in err
    assert not (tmp_path / "run").exists()
