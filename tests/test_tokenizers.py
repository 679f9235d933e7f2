"""Tokenizers: byte, trained BPE, tokenizer.json files, hf:NAME through the Hub cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFModel
from tokenizers import decoders, models, pre_tokenizers

from nobubble.data import ByteTokenizer, DataError, HFTokenizer, load_tokenizer
from nobubble.data.tokenizer import byte_to_char, named_tokenizer, tokenizer_from_json, train_bpe

TEXTS = [
    "Who's there?\nNay, answer me: stand, and unfold yourself.\n",
    "Long live the king! Ünïcödé — 東京 🎭\n",
    "  leading spaces, tabs\tand\r\nwindows line ends  ",
]
TRAIN_TEXT = [
    f"Line {i}: the quick brown fox jumps over the lazy dog {i % 7} times; ça va? 東京.\n" * 3
    for i in range(200)
]
any_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=200)


@pytest.fixture(scope="module")
def bpe() -> HFTokenizer:
    return train_bpe(TRAIN_TEXT, 400)


def test_byte_tokenizer_ids_are_utf8_bytes_plus_eos():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id, tok.spec) == (257, 256, "byte")
    assert tok.encode("aé") == [97, 0xC3, 0xA9]
    assert [a.tolist() for a in tok.encode_batch(["aé", ""])] == [[97, 0xC3, 0xA9], []]
    assert tok.decode([104, 105, 256, 33]) == "hi!"
    lengths = tok.token_bytes()
    assert lengths.dtype == torch.int64 and lengths.shape == (257,)
    assert lengths[:256].eq(1).all() and lengths[256] == 0


@settings(max_examples=50, deadline=None)
@given(any_text)
def test_byte_tokenizer_roundtrips(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_byte_to_char_is_gpt2_byte_level_alphabet():
    chars = byte_to_char()
    assert sorted(chars) == list(range(256)) and len(set(chars.values())) == 256
    assert set(chars.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert chars[ord("A")] == "A" and chars[ord(" ")] == "Ġ" and chars[ord("\n")] == "Ċ"


def test_saved_byte_tokenizer_is_an_equivalent_hf_tokenizer(tmp_path):
    path = ByteTokenizer().save(tmp_path)
    assert path == tmp_path / "tokenizer.json"
    hf = HFModel.from_file(str(path))
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False).ids == list(text.encode())
    assert hf.token_to_id("<eos>") == 256
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    assert isinstance(load_tokenizer(path), ByteTokenizer)


def test_bpe_training_is_deterministic_and_sized(bpe):
    again = train_bpe(TRAIN_TEXT, 400)
    assert bpe.to_json() == again.to_json()
    assert bpe.vocab_size == 400 and bpe.eos_id == 0 and bpe.spec == "bpe"
    assert len(bpe.encode(TRAIN_TEXT[0])) < len(TRAIN_TEXT[0].encode()) / 2


@settings(max_examples=50, deadline=None)
@given(any_text)
def test_bpe_roundtrips_and_counts_bytes_exactly(bpe, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert int(bpe.token_bytes()[ids].sum()) == len(text.encode())


def test_bpe_eos_has_zero_bytes_and_is_skipped_in_decode(bpe):
    assert bpe.token_bytes()[bpe.eos_id] == 0
    assert bpe.decode([*bpe.encode("to be"), bpe.eos_id]) == "to be"


def test_saved_bpe_reloads_identically(bpe, tmp_path):
    loaded = load_tokenizer(bpe.save(tmp_path))
    assert isinstance(loaded, HFTokenizer)
    assert loaded.to_json() == bpe.to_json()
    assert (loaded.vocab_size, loaded.eos_id) == (bpe.vocab_size, bpe.eos_id)
    assert torch.equal(loaded.token_bytes(), bpe.token_bytes())
    for text in TEXTS:
        assert loaded.encode(text) == bpe.encode(text)
    assert [a.tolist() for a in loaded.encode_batch(TEXTS)] == [bpe.encode(t) for t in TEXTS]


def test_bpe_vocab_too_small_is_a_clear_error():
    with pytest.raises(DataError, match="bpe_vocab_size 100 is too small"):
        train_bpe(TRAIN_TEXT, 100)


def test_bpe_vocab_too_large_is_refused_before_training_sets_memory_aside():
    """10**9 entries would have the tokenizers library ask for 70 GB (and abort, uncaught)."""
    with pytest.raises(DataError, match=r"bpe_vocab_size 1000000000 is too large: .* 1048576"):
        train_bpe(TRAIN_TEXT, 10**9)


def _word_level(vocab: list[str], specials: list[str]) -> HFModel:
    tok = HFModel(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=vocab[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    return tok


def test_eos_is_found_among_known_end_of_text_tokens(tmp_path):
    tok = _word_level(["<unk>", "hello", "world"], ["<|endoftext|>", "</s>"])
    wrapped = HFTokenizer(tok, "x")
    assert wrapped.eos_id == tok.token_to_id("<|endoftext|>")
    assert wrapped.vocab_size == 5
    assert wrapped.token_bytes().tolist() == [5, 5, 5, 0, 0]


def test_tokenizer_without_eos_gets_one_that_survives_saving(tmp_path):
    tok = _word_level(["<unk>", "hello", "world"], [])
    wrapped = HFTokenizer(tok, "x")
    assert (wrapped.vocab_size, wrapped.eos_id) == (4, 3)
    reloaded = load_tokenizer(wrapped.save(tmp_path))
    assert (reloaded.vocab_size, reloaded.eos_id) == (4, 3)


def test_token_bytes_of_sentencepiece_style_vocabulary():
    vocab = {"<unk>": 0, "▁the": 1, "<0x0A>": 2, "é": 3, "▁": 4}
    tok = HFModel(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens(["<unk>", "</s>"])
    wrapped = HFTokenizer(tok, "sp")
    assert wrapped.eos_id == 5
    assert wrapped.token_bytes().tolist() == [0, 4, 1, 2, 1, 0]


def test_token_bytes_of_wordpiece_vocabulary():
    vocab = {"[UNK]": 0, "play": 1, "##ing": 2}
    tok = HFModel(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[UNK]"])
    assert HFTokenizer(tok, "wp").token_bytes().tolist() == [0, 4, 3, 0]


def test_a_tokenizer_rebuilt_from_its_json_text_is_the_same(bpe):
    """How the pipeline's leader hands its tokenizer to the other ranks: text, no file."""
    again = tokenizer_from_json(bpe.to_json(), bpe.spec)
    assert isinstance(again, HFTokenizer) and again.spec == "bpe"
    assert again.to_json() == bpe.to_json()  # saved byte for byte alike: same checksum
    assert (again.vocab_size, again.eos_id) == (bpe.vocab_size, bpe.eos_id)
    assert torch.equal(again.token_bytes(), bpe.token_bytes())
    assert [again.encode(t) for t in TEXTS] == [bpe.encode(t) for t in TEXTS]
    byte = tokenizer_from_json(ByteTokenizer().to_json(), "byte")
    assert isinstance(byte, ByteTokenizer)  # keeps its numpy fast path
    with pytest.raises(DataError, match=r"not a valid Hugging Face tokenizer\.json"):
        tokenizer_from_json("{not json", "bpe")


def test_load_tokenizer_errors_name_the_problem(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "nope.json")
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path)  # a folder without tokenizer.json
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match=r"not a valid Hugging Face tokenizer\.json"):
        load_tokenizer(bad)


def test_named_tokenizer_accepts_a_path(bpe, tmp_path):
    path = bpe.save(tmp_path)
    tok = named_tokenizer(str(path))
    assert tok.spec == str(path) and tok.to_json() == bpe.to_json()


def test_hf_tokenizer_comes_from_the_hub_cache_offline(bpe, tmp_path):
    """hf:NAME goes through hf_hub_download; an offline Hub cache layout stands in for the Hub."""
    snapshot = tmp_path / "hub/models--acme--tiny-lm/snapshots/0123abcd"
    snapshot.mkdir(parents=True)
    (tmp_path / "hub/models--acme--tiny-lm/refs").mkdir()
    (tmp_path / "hub/models--acme--tiny-lm/refs/main").write_text("0123abcd")
    bpe.save(snapshot)
    script = textwrap.dedent(
        """
        import json
        from nobubble.data import DataError
        from nobubble.data.tokenizer import named_tokenizer
        tok = named_tokenizer("hf:acme/tiny-lm")
        out = {"spec": tok.spec, "vocab": tok.vocab_size, "eos": tok.eos_id,
               "ids": tok.encode("Who's there?")}
        try:
            named_tokenizer("hf:acme/missing")
        except DataError as exc:
            out["error"] = str(exc)
        print(json.dumps(out))
        """
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HOME": str(tmp_path / "home"),
    }
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["spec"] == "hf:acme/tiny-lm"
    assert (out["vocab"], out["eos"]) == (bpe.vocab_size, bpe.eos_id)
    assert out["ids"] == bpe.encode("Who's there?")
    assert "acme/missing" in out["error"] and "tokenizer=PATH/tokenizer.json" in out["error"]
    assert not Path(tmp_path / "hub/models--acme--missing/snapshots").exists()
