"""Pre-tokenized ``.bin`` token shards: reading (memory-mapped), splitting, writing.

A shard is a raw array of ``uint16`` or ``uint32`` token ids. Shards written by llm.c /
modded-nanogpt start with a 256 x int32 header: magic, version, token count; magic 20240520 with
version 1 means uint16 tokens (GPT-2), magic 20240801 with version 7 uint32 tokens (Llama 3).
Such a header is recognised when magic, version and file size all agree, and then its dtype wins
over ``bin_dtype``.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from nobubble.data.errors import DataError
from nobubble.data.shuffle import mix64
from nobubble.data.split import val_threshold

BIN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
HEADER_FORMATS = {"uint16": (20240520, 1), "uint32": (20240801, 7)}  # bin_dtype: (magic, version)
BLOCK_TOKENS = 8192


def open_shard(path: Path, bin_dtype: str) -> np.ndarray:
    """Memory-map one shard as a 1-D token array."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = np.frombuffer(f.read(12).ljust(12, b"\0"), dtype="<i4")
    except OSError as exc:
        raise DataError(f"cannot read token shard {path}: {exc.strerror or exc}") from None
    if size == 0:
        raise DataError(f"token shard {path} is empty; remove it from data=")
    magic, version, count = (int(v) for v in head)
    header = next((name for name, (m, _) in HEADER_FORMATS.items() if m == magic), None)
    if header is not None:
        dtype = BIN_DTYPES[header]
        if version != HEADER_FORMATS[header][1] or size != HEADER_BYTES + count * dtype.itemsize:
            raise DataError(
                f"{path} starts with the llm.c shard magic {magic} but its header (version "
                f"{version}, {count} tokens) does not match the file size {size}; the file is "
                "truncated or corrupt, re-create it"
            )
        return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))
    dtype = BIN_DTYPES[bin_dtype]
    if size % dtype.itemsize:
        raise DataError(
            f"token shard {path} has {size} bytes, not a multiple of {dtype.itemsize} "
            f"(bin_dtype={bin_dtype}); the file is truncated or was written with another dtype "
            f"(set bin_dtype={'uint16' if dtype.itemsize == 4 else 'uint32'}?)"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def split_shards(
    shards: list[tuple[str, np.ndarray]], val_fraction: float
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(train segments, validation segments) of named shards.

    Each shard is cut into blocks of :data:`BLOCK_TOKENS`; a block goes to validation when a hash
    of (shard file name, block index) falls below ``val_fraction`` (no data is read, so this is
    instant on terabytes). Consecutive blocks on one side form one segment. As for text, neither
    side is ever left empty.
    """
    scores = [_block_scores(name, len(tokens)) for name, tokens in shards]
    all_scores = np.concatenate(scores)
    if len(all_scores) < 2:
        raise DataError(
            f"the token shards hold {sum(len(t) for _, t in shards)} tokens, too few to split "
            f"into training and validation blocks of {BLOCK_TOKENS}; use more data"
        )
    is_val = all_scores < np.uint64(val_threshold(val_fraction))
    if not is_val.any():
        is_val[np.argmin(all_scores)] = True
    if is_val.all():
        is_val[np.argmax(all_scores)] = False
    train, val, start = [], [], 0
    for (_, tokens), shard_scores in zip(shards, scores, strict=True):
        flags = is_val[start : start + len(shard_scores)]
        start += len(shard_scores)
        edges = np.flatnonzero(np.diff(flags)) + 1
        for lo, hi in zip([0, *edges], [*edges, len(flags)], strict=True):
            (val if flags[lo] else train).append(tokens[lo * BLOCK_TOKENS : hi * BLOCK_TOKENS])
    return train, val


def _block_scores(name: str, n_tokens: int) -> np.ndarray:
    blocks = np.arange(-(-n_tokens // BLOCK_TOKENS), dtype=np.uint64)
    return mix64((np.uint64(zlib.crc32(name.encode())) << np.uint64(32)) | blocks)


def write_bin_shards(
    token_arrays: Iterable[np.ndarray],
    out_dir: str | Path,
    *,
    bin_dtype: str = "uint16",
    shard_tokens: int = 100_000_000,
    header: bool = False,
    prefix: str = "shard",
) -> list[Path]:
    """Write token arrays, in order, into ``out_dir/{prefix}_00000.bin`` and up.

    Each shard holds ``shard_tokens`` tokens (the last fewer); with ``header`` the files get the
    llm.c header so that llm.c / modded-nanogpt can read them too.
    """
    dtype = BIN_DTYPES[bin_dtype]
    limit = np.iinfo(dtype).max
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    pending: list[np.ndarray] = []
    pending_tokens = 0

    def flush(parts: list[np.ndarray]) -> None:
        tokens = np.concatenate(parts).astype(dtype, copy=False)
        path = out_dir / f"{prefix}_{len(paths):05d}.bin"
        with path.open("wb") as f:
            if header:
                head = np.zeros(HEADER_INTS, dtype="<i4")
                head[:3] = *HEADER_FORMATS[bin_dtype], len(tokens)
                f.write(head.tobytes())
            f.write(tokens.tobytes())
        paths.append(path)

    for array in token_arrays:
        array = np.asarray(array)
        if len(array) and int(array.max()) > limit:
            raise DataError(
                f"token id {int(array.max())} does not fit bin_dtype={bin_dtype} (max {limit}); "
                "use bin_dtype=uint32"
            )
        while len(array):
            take = min(shard_tokens - pending_tokens, len(array))
            pending.append(array[:take])
            pending_tokens += take
            array = array[take:]
            if pending_tokens == shard_tokens:
                flush(pending)
                pending, pending_tokens = [], 0
    if pending:
        flush(pending)
    return paths
