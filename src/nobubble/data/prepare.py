"""Pre-tokenize text into ``.bin`` token shards for ``data=DIR``.

    python -m nobubble.data.prepare DATA OUT_DIR --tokenizer hf:HuggingFaceTB/SmolLM2-135M

DATA is anything ``data=`` accepts except ``.bin`` (``builtin``, files, globs, ``hf:NAME``).
Documents are tokenized in order and each is followed by EOS; ``OUT_DIR/tokenizer.json`` is
written next to the shards so that training can use ``tokenizer=OUT_DIR/tokenizer.json``.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from nobubble.config import ConfigError, Range
from nobubble.config.flags import OneLineParser, whole
from nobubble.data.errors import DataError
from nobubble.data.shards import BIN_DTYPES, write_bin_shards
from nobubble.data.sources import BinFiles, iter_documents, parse_data_spec
from nobubble.data.tokenizer import Tokenizer, named_tokenizer
from nobubble.destinations import check_output_folder

ENCODE_BATCH = 256  # documents per tokenizer call (HF tokenizers encode a batch in parallel)
SHARD_TOKENS = Range(  # a shard is gathered in memory, then written with its token count
    1, 2**31 - 1, high_open=False, why="llm.c's shard header counts the tokens in 32 bits"
)


def prepare(
    data: str,
    out_dir: str | Path,
    tokenizer: str = "byte",
    *,
    data_field: str = "text",
    bin_dtype: str = "uint16",
    shard_tokens: int = 100_000_000,
    header: bool = False,
    max_tokens: int | None = None,
) -> list[Path]:
    """Tokenize ``data`` into shards under ``out_dir``; returns the shard paths."""
    source = parse_data_spec(data, data_field)
    if isinstance(source, BinFiles):
        raise DataError(f"{data!r} is already token shards; point prepare at text")
    if tokenizer == "bpe":
        raise DataError(
            "prepare needs an existing tokenizer: train one with `nobubble train "
            "tokenizer=bpe ...` and pass RUN_DIR/tokenizer.json, or use byte or hf:NAME"
        )
    tok = named_tokenizer(tokenizer)
    capacity = np.iinfo(BIN_DTYPES[bin_dtype]).max + 1
    if tok.vocab_size > capacity:
        raise DataError(
            f"tokenizer {tokenizer!r} has {tok.vocab_size} tokens, more than bin_dtype="
            f"{bin_dtype} holds ({capacity}); use --bin-dtype uint32"
        )
    tok.save(out_dir)
    arrays = _document_tokens(iter_documents(source), tok, max_tokens)
    return write_bin_shards(
        arrays, out_dir, bin_dtype=bin_dtype, shard_tokens=shard_tokens, header=header
    )


def _document_tokens(
    documents: Iterator[str], tok: Tokenizer, max_tokens: int | None
) -> Iterator[np.ndarray]:
    eos, written = np.array([tok.eos_id]), 0
    while batch := list(itertools.islice(documents, ENCODE_BATCH)):
        for tokens in tok.encode_batch(batch):
            doc = np.concatenate([tokens, eos])
            if max_tokens is not None and written + len(doc) >= max_tokens:
                yield doc[: max_tokens - written]
                return
            written += len(doc)
            yield doc


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(
        prog="python -m nobubble.data.prepare", description=__doc__.splitlines()[0]
    )
    parser.add_argument("data", help="builtin | FILE/FOLDER/GLOB (.txt .jsonl .parquet) | hf:NAME")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tokenizer", default="byte", help="byte | PATH/tokenizer.json | hf:NAME")
    parser.add_argument("--data-field", default="text", help="text field of .jsonl/.parquet/hf")
    parser.add_argument("--bin-dtype", default="uint16", choices=sorted(BIN_DTYPES))
    parser.add_argument("--shard-tokens", type=whole(SHARD_TOKENS), default=100_000_000)
    parser.add_argument("--max-tokens", type=whole(), help="stop after this many tokens")
    parser.add_argument("--header", action="store_true", help="write llm.c shard headers")
    args = parser.parse_args(argv)
    try:  # before any work
        check_output_folder(args.out_dir, "OUT_DIR")
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    try:
        paths = prepare(
            args.data, args.out_dir, args.tokenizer, data_field=args.data_field,
            bin_dtype=args.bin_dtype, shard_tokens=args.shard_tokens, header=args.header,
            max_tokens=args.max_tokens,
        )  # fmt: skip
    except DataError as exc:
        sys.exit(f"error: {exc}")
    print(f"wrote {len(paths)} shard(s) and tokenizer.json to {args.out_dir}")


if __name__ == "__main__":
    main()
