"""Deterministic train/validation split of text, independent of the seed and the tokenizer.

Documents are cut into pieces of about :data:`PIECE_CHARS` characters at paragraph or line
boundaries; a piece goes to validation when a hash of its content falls below ``val_fraction``.
So the split of a piece never depends on what else is in the data (append files, keep the split),
one huge ``.txt`` file splits as well as a million small records, and exact duplicates always
land on the same side. Consecutive pieces of a document on the same side stay one run of text.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from nobubble.data.errors import DataError

PIECE_CHARS = 8192
Run = list[str]  # consecutive pieces of one document, all on the same side of the split


def cut_pieces(text: str, target: int = PIECE_CHARS) -> list[str]:
    """Cut ``text`` into consecutive pieces of ``target`` to ``2 * target`` characters (the last
    may be shorter): at the first blank line after ``target``, else the first line end, else
    mid-line at ``2 * target``."""
    pieces, start, n = [], 0, len(text)
    while n - start > target:
        lo, hi = start + target, min(start + 2 * target, n)
        cut = text.find("\n\n", lo, hi)
        if cut >= 0:
            cut += 2
        else:
            cut = text.find("\n", lo, hi)
            cut = cut + 1 if cut >= 0 else hi
        pieces.append(text[start:cut])
        start = cut
    if start < n:
        pieces.append(text[start:])
    return pieces


def piece_score(piece: str) -> int:
    """Stable 64-bit content hash (not Python's salted ``hash``)."""
    digest = hashlib.blake2b(piece.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def val_threshold(val_fraction: float) -> int:
    """Scores below this threshold go to validation."""
    return int(val_fraction * 2**64)


def _runs(pieces: list[str], is_val: list[bool]) -> list[tuple[bool, Run]]:
    grouped = itertools.groupby(zip(is_val, pieces, strict=True), key=lambda pair: pair[0])
    return [(side, [piece for _, piece in group]) for side, group in grouped]


def split_document(text: str, val_fraction: float) -> tuple[list[Run], list[Run]]:
    """(train runs, validation runs) of one document."""
    pieces = cut_pieces(text)
    threshold = val_threshold(val_fraction)
    return _sides(_runs(pieces, [piece_score(p) < threshold for p in pieces]))


def _sides(runs: list[tuple[bool, Run]]) -> tuple[list[Run], list[Run]]:
    return [r for is_val, r in runs if not is_val], [r for is_val, r in runs if is_val]


@dataclass
class TextSplit:
    train: list[Run]
    val: list[Run]


def split_documents(documents: Iterable[str], val_fraction: float) -> TextSplit:
    """Split a whole corpus held in memory.

    Neither side is ever empty: if no piece hashes into validation, the lowest-scoring piece
    goes there (and if all do, the highest-scoring one stays in training).
    """
    pieces = [cut_pieces(doc) for doc in documents if doc]
    scores = [[piece_score(p) for p in doc] for doc in pieces]
    threshold = val_threshold(val_fraction)
    is_val = [[s < threshold for s in doc] for doc in scores]
    flat = [(s, d, i) for d, doc in enumerate(scores) for i, s in enumerate(doc)]
    if len(flat) < 2:
        raise DataError(
            f"the data is too small to split into training and validation ({len(flat)} piece of "
            f"at most {2 * PIECE_CHARS} characters); use more text"
        )
    if not any(map(any, is_val)):
        _, d, i = min(flat)
        is_val[d][i] = True
    if all(map(all, is_val)):
        _, d, i = max(flat)
        is_val[d][i] = False
    runs = [run for doc, flags in zip(pieces, is_val, strict=True) for run in _runs(doc, flags)]
    train, val = _sides(runs)
    return TextSplit(train, val)
