"""The data: its source, the tokenizer, the sequence length and the batch."""

from __future__ import annotations

from dataclasses import dataclass

from nobubble.config.fields import POSITIVE, Range, setting

BIN_DTYPES = ("uint16", "uint32")


@dataclass
class DataSettings:
    data: str = setting(
        "builtin", "builtin | FILE/GLOB (.txt .jsonl .parquet .bin) | hf:NAME[:CONFIG]"
    )
    data_field: str = setting("text", "text field of .jsonl/.parquet/HF records")
    val_fraction: float = setting(
        0.05, "share of documents held out for validation", Range(0, 1, low_open=True)
    )
    tokenizer: str = setting("byte", "byte | bpe | PATH/tokenizer.json | hf:NAME")
    bpe_vocab_size: int = setting(
        4096, "vocabulary size of a locally trained BPE tokenizer", POSITIVE
    )
    bin_dtype: str = setting("uint16", "token dtype of .bin shards", choices=BIN_DTYPES)
    seq_len: int = setting(256, "tokens per training sequence", POSITIVE)
    batch_size: int = setting(
        16, "sequences per optimizer step (split into microbatches)", POSITIVE
    )
