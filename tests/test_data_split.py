"""The train/validation split and the seeded shuffle."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nobubble.data import DataError
from nobubble.data.shuffle import Permutation, key64
from nobubble.data.split import PIECE_CHARS, cut_pieces, split_document, split_documents


def _lines(n: int, seed: int = 0, width: int = 60) -> str:
    rng = random.Random(seed)
    return "".join(
        "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, width))) + "\n"
        for _ in range(n)
    )


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="ab \n", max_size=3000), st.integers(min_value=8, max_value=300))
def test_pieces_are_a_lossless_cut_of_bounded_size(text, target):
    pieces = cut_pieces(text, target)
    assert "".join(pieces) == text
    assert all(pieces) and all(len(p) <= 2 * target for p in pieces)
    assert all(len(p) >= target for p in pieces[:-1])


def test_pieces_end_at_blank_lines_then_lines_then_anywhere():
    paragraphs = "\n\n".join(_lines(5, seed=i) for i in range(200))
    pieces = cut_pieces(paragraphs, 1000)
    assert len(pieces) > 10 and all(p.endswith("\n\n") for p in pieces[:-1])
    pieces = cut_pieces(_lines(400), 1000)
    assert all(p.endswith("\n") and not p.endswith("\n\n") for p in pieces[:-1])
    assert [len(p) for p in cut_pieces("x" * 5000, 1000)] == [2000, 2000, 1000]


def test_split_is_deterministic_and_near_the_requested_fraction():
    docs = [_lines(40, seed=i) for i in range(3000)]  # about 1.2 KB each: one piece per doc
    split = split_documents(docs, 0.1)
    assert split == split_documents(docs, 0.1)
    val_docs = {run[0] for run in split.val}
    assert len(val_docs) == len(split.val)  # each val run is one whole document here
    assert 240 < len(val_docs) < 360
    assert not val_docs & {run[0] for run in split.train}


def test_a_piece_keeps_its_side_whatever_else_is_in_the_data():
    docs = [_lines(40, seed=i) for i in range(400)]
    alone = {run[0] for run in split_documents(docs[:200], 0.2).val}
    together = {run[0] for run in split_documents(docs, 0.2).val}
    assert alone and alone == together & set(docs[:200])


def test_one_big_text_splits_into_runs_that_rebuild_the_text():
    text = _lines(20_000, seed=1)  # about 600 KB, a single document
    train, val = split_document(text, 0.1)
    assert train and val
    pieces = cut_pieces(text)
    assert sum(len(run) for run in train + val) == len(pieces)
    assert sorted(p for run in train + val for p in run) == sorted(pieces)
    assert 0.03 < sum(len(p) for run in val for p in run) / len(text) < 0.2


def test_consecutive_same_side_pieces_form_one_run():
    text = _lines(20_000, seed=2)
    train, val = split_document(text, 0.3)
    pieces = cut_pieces(text)
    val_pieces = {p for run in val for p in run}
    sides = [p in val_pieces for p in pieces]
    switches = sum(a != b for a, b in itertools.pairwise(sides))
    assert len(train) + len(val) == switches + 1


def test_neither_side_is_ever_empty():
    docs = [_lines(40, seed=i) for i in range(20)]
    assert len(split_documents(docs, 1e-9).val) == 1
    assert len(split_documents(docs, 0.999999).train) == 1
    with pytest.raises(DataError, match="too small to split"):
        split_documents(["just one short document\n"], 0.5)
    assert split_documents(["a" * PIECE_CHARS * 3], 0.5).val  # one document, several pieces


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=5000), st.integers(min_value=0, max_value=2**63))
def test_permutation_is_a_bijection(n, key):
    assert sorted(Permutation(n, key)(np.arange(n)).tolist()) == list(range(n))


def test_permutation_depends_on_the_key_and_nothing_else():
    a = Permutation(1000, key64(0, 0))(np.arange(1000))
    assert np.array_equal(a, Permutation(1000, key64(0, 0))(np.arange(1000)))
    assert not np.array_equal(a, Permutation(1000, key64(0, 1))(np.arange(1000)))
    assert not np.array_equal(a, Permutation(1000, key64(1, 0))(np.arange(1000)))
    assert not np.array_equal(a, np.arange(1000))
    assert key64(1, 2) != key64(2, 1)


def test_permutation_of_a_huge_range_needs_no_memory():
    perm = Permutation(10**12, 7)
    first = perm(np.arange(1000))
    assert first.min() >= 0 and first.max() < 10**12 and len(set(first.tolist())) == 1000
    assert np.array_equal(perm(np.arange(500, 1000)), first[500:])
