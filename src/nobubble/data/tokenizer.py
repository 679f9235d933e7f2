"""Tokenizers: bytes, a locally trained byte-level BPE, any ``tokenizer.json``, ``hf:NAME``.

Every tokenizer saves itself as a Hugging Face ``tokenizer.json`` (the byte tokenizer as the
equivalent merge-free byte-level BPE), so a run folder always holds the exact tokenizer it used and
any HF tool can read it. The byte tokenizer is recognised on load and keeps its numpy fast path.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from functools import cache
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizerModel
from tokenizers import decoders, models, pre_tokenizers, trainers

from nobubble.data.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
EOS = "<eos>"
# the tokenizers library sets aside about 70 bytes per entry before it trains (70 GB for 10**9);
# the largest vocabularies in use have about 256k entries
MAX_BPE_VOCAB = 2**20
# End-of-text tokens of common tokenizers, most preferred first (GPT-2/SmolLM2, Llama 3, ...).
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", EOS, "<|eos|>")
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@cache
def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters (ByteLevel)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(256 + n) for n, b in enumerate(others)})
    return dict(sorted(mapping.items()))


class Tokenizer(ABC):
    """What the data pipeline and the trainer need from a tokenizer."""

    spec: str
    vocab_size: int
    eos_id: int

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text (no special tokens added), as integer arrays."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are skipped."""

    @abstractmethod
    def token_bytes(self) -> torch.Tensor:
        """int64 ``(vocab_size,)``: UTF-8 bytes each id stands for, 0 for special tokens."""

    @abstractmethod
    def to_json(self) -> str:
        """The tokenizer as Hugging Face ``tokenizer.json`` text."""

    def save(self, directory: str | Path) -> Path:
        """Write ``directory/tokenizer.json`` atomically (concurrent writers of one run agree)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / TOKENIZER_FILE
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tokenizer-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(self.to_json())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        return path

    def __repr__(self) -> str:
        return f"{type(self).__name__}(spec={self.spec!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: ids 0..255 are the byte values, 256 is ``<eos>``."""

    spec = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in map(int, ids) if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> torch.Tensor:
        lengths = torch.ones(self.vocab_size, dtype=torch.int64)
        lengths[self.eos_id] = 0
        return lengths

    def to_json(self) -> str:
        return byte_hf_tokenizer().to_str(pretty=True)


def byte_hf_tokenizer() -> HFTokenizerModel:
    """The byte tokenizer as an HF byte-level BPE without merges (same ids for every text)."""
    vocab = {char: b for b, char in byte_to_char().items()}
    tok = HFTokenizerModel(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return tok


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer.

    The end-of-text id is the first of :data:`EOS_CANDIDATES` the vocabulary has; a tokenizer
    without any of them gets an ``<eos>`` special token appended (saved with the run).
    """

    def __init__(self, tok: HFTokenizerModel, spec: str) -> None:
        vocab = tok.get_vocab(with_added_tokens=True)
        eos = next((vocab[name] for name in EOS_CANDIDATES if name in vocab), None)
        if eos is None:
            tok.add_special_tokens([EOS])
            vocab = tok.get_vocab(with_added_tokens=True)
            eos = vocab[EOS]
        self._tok, self.spec, self.eos_id = tok, spec, eos
        self.vocab_size = max(vocab.values()) + 1
        self._token_bytes: torch.Tensor | None = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_bytes(self) -> torch.Tensor:
        if self._token_bytes is None:
            self._token_bytes = _token_byte_lengths(json.loads(self._tok.to_str()), self.vocab_size)
        return self._token_bytes.clone()

    def to_json(self) -> str:
        return self._tok.to_str(pretty=True)


def _token_byte_lengths(spec: dict, vocab_size: int) -> torch.Tensor:
    """Bytes per id from the tokenizer.json: byte-level vocabularies map each character back to
    one byte; SentencePiece-style ones use ``▁`` for a space and ``<0xNN>`` for a raw byte;
    WordPiece drops its ``##`` prefix. Added non-special tokens are literal text."""
    decoder = json.dumps(spec.get("decoder"))
    byte_level = '"ByteLevel"' in decoder
    prefix = spec["model"].get("continuing_subword_prefix") if '"WordPiece"' in decoder else None
    to_byte = {char: b for b, char in byte_to_char().items()}
    lengths = torch.zeros(vocab_size, dtype=torch.int64)
    vocab = spec["model"]["vocab"]  # Unigram models list [piece, score] pairs in id order
    pairs = vocab.items() if isinstance(vocab, dict) else ((p, i) for i, (p, _) in enumerate(vocab))
    for token, idx in pairs:
        if byte_level and all(c in to_byte for c in token):
            lengths[idx] = len(token)
        elif _BYTE_FALLBACK.fullmatch(token):
            lengths[idx] = 1
        else:
            if prefix and token.startswith(prefix):
                token = token[len(prefix) :]
            lengths[idx] = len(token.replace("▁", " ").encode("utf-8"))
    for added in spec.get("added_tokens", []):
        lengths[added["id"]] = 0 if added["special"] else len(added["content"].encode("utf-8"))
    return lengths


def _is_byte_tokenizer(tok: HFTokenizerModel) -> bool:
    if tok.get_vocab_size(with_added_tokens=True) != ByteTokenizer.vocab_size:
        return False
    return json.loads(tok.to_str()) == json.loads(byte_hf_tokenizer().to_str())


def load_tokenizer(path_or_run_dir: str | Path) -> Tokenizer:
    """Load a ``tokenizer.json``, or the one inside a folder (e.g. a run folder)."""
    path = Path(path_or_run_dir)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(
            f"tokenizer file {path} does not exist; give a tokenizer.json path, a folder that "
            "holds one, or tokenizer=byte | bpe | hf:NAME"
        )
    return _read_tokenizer_file(path, str(path))


def _read_tokenizer_file(path: str | Path, spec: str) -> Tokenizer:
    try:
        tok = HFTokenizerModel.from_file(str(path))
    except Exception as exc:  # the Rust loader raises a bare Exception
        raise DataError(
            f"{path} is not a valid Hugging Face tokenizer.json ({exc}); point tokenizer= at a "
            "file saved by `tokenizers` or `transformers`"
        ) from None
    return _wrap(tok, spec)


def _wrap(tok: HFTokenizerModel, spec: str) -> Tokenizer:
    return ByteTokenizer() if _is_byte_tokenizer(tok) else HFTokenizer(tok, spec)


def tokenizer_from_json(text: str, spec: str) -> Tokenizer:
    """The tokenizer whose :meth:`Tokenizer.to_json` is ``text`` (and whose spec was ``spec``),
    built in memory: how the pipeline's leader hands its tokenizer to the other stages without
    a file. ``tokenizer_from_json(t.to_json(), t.spec)`` encodes and saves exactly as ``t``."""
    try:
        tok = HFTokenizerModel.from_str(text)
    except Exception as exc:  # the Rust loader raises a bare Exception
        raise DataError(f"not a valid Hugging Face tokenizer.json ({exc})") from None
    return _wrap(tok, spec)


def hub_tokenizer(name: str) -> Tokenizer:
    """``tokenizer.json`` of a Hugging Face Hub model repo (cached by ``huggingface_hub``)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError

    try:
        path = hf_hub_download(repo_id=name, filename=TOKENIZER_FILE)
    except (EntryNotFoundError, HfHubHTTPError, HFValidationError, OSError) as exc:
        raise DataError(
            f"cannot get tokenizer.json of Hugging Face repo {name!r}: {exc}\nCheck the repo "
            "name and your network; offline, download it once (`hf download "
            f"{name} tokenizer.json`) or pass tokenizer=PATH/tokenizer.json"
        ) from None
    return _read_tokenizer_file(path, f"hf:{name}")


def train_bpe(texts: Iterator[str] | Iterable[str], vocab_size: int) -> HFTokenizer:
    """Byte-level BPE trained from scratch: ``<eos>`` is id 0, then the 256 byte symbols, then
    merges (deterministic for the same texts in the same order)."""
    if vocab_size < 258:
        raise DataError(
            f"bpe_vocab_size {vocab_size} is too small: a byte-level BPE needs 256 byte tokens "
            "and <eos>; use at least 258 (e.g. 4096)"
        )
    if vocab_size > MAX_BPE_VOCAB:
        raise DataError(
            f"bpe_vocab_size {vocab_size} is too large: training sets aside memory for every "
            f"entry before it starts (about 70 bytes each); use at most {MAX_BPE_VOCAB} (2^20)"
        )
    tok = HFTokenizerModel(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return HFTokenizer(tok, "bpe")


def named_tokenizer(spec: str) -> Tokenizer:
    """Every tokenizer spec except ``bpe`` (which needs training text)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("hf:"):
        return hub_tokenizer(spec.removeprefix("hf:"))
    return load_tokenizer(spec)
