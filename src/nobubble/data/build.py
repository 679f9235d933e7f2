"""``build_data``: config -> tokenizer + training batches + fixed validation batches.

A pure function of the config and the tokenizer (one already saved in the run folder, or one
handed over in memory), so every pipeline stage that calls it sees the same batches in the same
order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nobubble.config import TrainConfig
from nobubble.data.batching import (
    PackedRows,
    ShuffledBatches,
    StreamBatches,
    TrainBatches,
    fixed_batches,
    pack_runs,
    record_tokens,
)
from nobubble.data.errors import DataError
from nobubble.data.shards import open_shard, split_shards
from nobubble.data.sources import (
    BinFiles,
    HFDataset,
    Source,
    iter_documents,
    iter_records,
    parse_data_spec,
)
from nobubble.data.split import split_document, split_documents
from nobubble.data.tokenizer import (
    TOKENIZER_FILE,
    Tokenizer,
    load_tokenizer,
    named_tokenizer,
    train_bpe,
)

BPE_STREAM_CHARS = 64 * 2**20  # BPE training text taken from the start of a streamed dataset
# validation tokens a streamed dataset is read for before training, held in memory (8 GB)
MAX_STREAM_VAL_TOKENS = 2**30


@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train: TrainBatches
    val: list[torch.Tensor]
    info: dict[str, Any] = field(default_factory=dict)  # what was loaded, for logs


def build_data(
    cfg: TrainConfig, run_dir: Path | None = None, tokenizer: Tokenizer | None = None
) -> DataBundle:
    """Tokenizer, training batches and validation batches for ``cfg``.

    With ``run_dir``, a ``tokenizer.json`` already there is used as is (resume), and otherwise the
    tokenizer is saved there. With ``tokenizer`` (and no ``run_dir``), that tokenizer is used as
    is and no folder is read or written: only the data source (a pipeline stage other than the
    leader, which received the leader's tokenizer).
    """
    source = parse_data_spec(cfg.data, cfg.data_field)
    return build_from_source(source, cfg, run_dir, tokenizer)


def build_from_source(
    source: Source, cfg: TrainConfig, run_dir: Path | None, tokenizer: Tokenizer | None = None
) -> DataBundle:
    if tokenizer is not None and run_dir is not None:
        raise ValueError("build_data takes a run folder or a tokenizer, not both")
    if isinstance(source, BinFiles):
        return _shard_data(source, cfg, run_dir, tokenizer)
    if isinstance(source, HFDataset):
        return _stream_data(source, cfg, run_dir, tokenizer)
    return _text_data(source, cfg, run_dir, tokenizer)


def resolve_tokenizer(
    cfg: TrainConfig,
    run_dir: Path | None,
    training_text: Callable[[], Iterable[str]] | None,
    given: Tokenizer | None = None,
) -> Tokenizer:
    """``given`` if there is one; else the run folder's tokenizer if it has one, else the one
    ``cfg.tokenizer`` names (a BPE is trained on ``training_text()``), saved into the run
    folder."""
    if given is not None:
        return given
    if run_dir is not None and (Path(run_dir) / TOKENIZER_FILE).is_file():
        return load_tokenizer(run_dir)
    if cfg.tokenizer == "bpe":
        if training_text is None:
            raise DataError(
                "tokenizer=bpe trains on text, but .bin shards hold token ids; set tokenizer= to "
                "the tokenizer that wrote the shards (PATH/tokenizer.json or hf:NAME)"
            )
        tokenizer: Tokenizer = train_bpe(training_text(), cfg.bpe_vocab_size)
    else:
        tokenizer = named_tokenizer(cfg.tokenizer)
    if run_dir is not None:
        tokenizer.save(run_dir)
    return tokenizer


def _bundle(
    tokenizer: Tokenizer, train: TrainBatches, val_rows: PackedRows, cfg: TrainConfig, **info: Any
) -> DataBundle:
    if len(val_rows) < cfg.batch_size:
        raise DataError(
            f"the validation split has {len(val_rows)} sequences of seq_len+1={cfg.seq_len + 1} "
            f"tokens, fewer than one batch (batch_size={cfg.batch_size}); raise val_fraction "
            f"(now {cfg.val_fraction}), use more data, or lower seq_len / batch_size"
        )
    val = fixed_batches(val_rows, cfg.batch_size, cfg.eval_batches)
    info |= {"tokenizer": tokenizer.spec, "vocab_size": tokenizer.vocab_size}
    return DataBundle(tokenizer, train, val, info | {"val_tokens": val_rows.tokens})


def _training_rows(rows: PackedRows, cfg: TrainConfig) -> ShuffledBatches:
    if len(rows) < cfg.batch_size:
        raise DataError(
            f"the training split has {len(rows)} sequences of seq_len+1={cfg.seq_len + 1} "
            f"tokens, fewer than one batch (batch_size={cfg.batch_size}); use more data or "
            "lower seq_len / batch_size"
        )
    return ShuffledBatches(rows, cfg.batch_size, cfg.seed)


def _text_data(
    source: Source, cfg: TrainConfig, run_dir: Path | None, given: Tokenizer | None
) -> DataBundle:
    split = split_documents(iter_documents(source), cfg.val_fraction)
    train_text = (piece for run in split.train for piece in run)
    tokenizer = resolve_tokenizer(cfg, run_dir, lambda: train_text, given)
    train = PackedRows([pack_runs(tokenizer, split.train)], cfg.seq_len, tokenizer.vocab_size)
    val = PackedRows([pack_runs(tokenizer, split.val)], cfg.seq_len, tokenizer.vocab_size)
    return _bundle(
        tokenizer, _training_rows(train, cfg), val, cfg, source=source.describe(),
        train_tokens=train.tokens,
    )  # fmt: skip


def _shard_data(
    source: BinFiles, cfg: TrainConfig, run_dir: Path | None, given: Tokenizer | None
) -> DataBundle:
    tokenizer = resolve_tokenizer(cfg, run_dir, None, given)
    shards = [(path.name, open_shard(path, cfg.bin_dtype)) for path in source.paths]
    for path, (_, tokens) in zip(source.paths, shards, strict=True):
        capacity = np.iinfo(tokens.dtype).max + 1
        if tokenizer.vocab_size > capacity:
            raise DataError(
                f"tokenizer {tokenizer.spec!r} has {tokenizer.vocab_size} tokens but {path} "
                f"stores {tokens.dtype.name} ids (at most {capacity}); write the shards with "
                "bin_dtype=uint32 and set bin_dtype=uint32"
            )
    train_segments, val_segments = split_shards(shards, cfg.val_fraction)
    train = PackedRows(train_segments, cfg.seq_len, tokenizer.vocab_size)
    val = PackedRows(val_segments, cfg.seq_len, tokenizer.vocab_size)
    return _bundle(
        tokenizer, _training_rows(train, cfg), val, cfg, source=source.describe(),
        train_tokens=train.tokens,
    )  # fmt: skip


def _stream_data(
    source: HFDataset, cfg: TrainConfig, run_dir: Path | None, given: Tokenizer | None
) -> DataBundle:
    _check_stream_val_size(cfg)
    train_text = lambda: _stream_train_text(source, cfg)  # noqa: E731
    tokenizer = resolve_tokenizer(cfg, run_dir, train_text, given)
    val = PackedRows(
        [_stream_val_tokens(source, tokenizer, cfg)], cfg.seq_len, tokenizer.vocab_size
    )
    train = StreamBatches(source, tokenizer, cfg.seq_len, cfg.batch_size, cfg.val_fraction)
    return _bundle(tokenizer, train, val, cfg, source=source.describe(), train_tokens=None)


def _check_stream_val_size(cfg: TrainConfig) -> None:
    """A streamed dataset is read for every validation token before training: refuse more of
    them than memory can be expected to hold (a local dataset's are bounded by its size)."""
    needed = cfg.eval_batches * cfg.batch_size * cfg.seq_len
    if needed > MAX_STREAM_VAL_TOKENS:
        raise DataError(
            f"eval_batches x batch_size x seq_len = {cfg.eval_batches} x {cfg.batch_size} x "
            f"{cfg.seq_len} = {needed:,} validation tokens, read from the stream and held in "
            f"memory before training; at most {MAX_STREAM_VAL_TOKENS:,} (2^30, 8 GB): use "
            "fewer eval_batches"
        )


def _stream_train_text(source: HFDataset, cfg: TrainConfig) -> Iterator[str]:
    """Training-side pieces from the start of the stream, about :data:`BPE_STREAM_CHARS`."""
    taken = 0
    with closing(iter_records(source)) as records:
        for _, text in records:
            for run in split_document(text, cfg.val_fraction)[0]:
                yield from run
                taken += sum(map(len, run))
            if taken >= BPE_STREAM_CHARS:
                return


def _stream_val_tokens(source: HFDataset, tokenizer: Tokenizer, cfg: TrainConfig) -> np.ndarray:
    """Validation-side tokens from the start of the stream, enough for ``eval_batches``."""
    needed = cfg.eval_batches * cfg.batch_size * cfg.seq_len + 1
    parts, total = [np.empty(0, dtype=np.int64)], 0
    with closing(iter_records(source)) as records:
        for _, text in records:
            parts.append(record_tokens(tokenizer, text, cfg.val_fraction, val=True))
            total += len(parts[-1])
            if total >= needed:
                break
    return np.concatenate(parts)
