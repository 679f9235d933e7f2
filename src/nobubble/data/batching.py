"""Packing token streams into fixed-length rows, and serving them as batches.

Documents are joined with EOS into one token stream, which is cut into rows of ``seq_len + 1``
tokens with stride ``seq_len``: consecutive rows share one token, so every token is a prediction
target exactly once. Rows never cross a segment boundary (a gap where validation data was taken
out). Training rows are served in a seeded per-epoch order; the position is a small JSON dict.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from nobubble.data.errors import DataError
from nobubble.data.shuffle import Permutation, key64
from nobubble.data.sources import HFDataset, iter_records, open_hf_stream
from nobubble.data.split import Run, split_document
from nobubble.data.tokenizer import Tokenizer


class TrainBatches(Protocol):
    def next_batch(self) -> torch.Tensor:
        """LongTensor ``(batch_size, seq_len + 1)``."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable position; loading it continues exactly where this one stands."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def pack_runs(tokenizer: Tokenizer, runs: Sequence[Run]) -> np.ndarray:
    """Tokens of each run (its pieces back to back) followed by EOS, all runs concatenated."""
    pieces = [piece for run in runs for piece in run]
    encoded = iter(tokenizer.encode_batch(pieces))
    eos = np.array([tokenizer.eos_id])
    parts = []
    for run in runs:
        parts.extend(next(encoded) for _ in run)
        parts.append(eos)
    dtype = token_dtype(tokenizer.vocab_size)
    return np.concatenate(parts, dtype=dtype, casting="unsafe") if parts else np.empty(0, dtype)


class PackedRows:
    """Rows of ``seq_len + 1`` tokens cut from token segments (arrays or memory maps)."""

    def __init__(self, segments: Sequence[np.ndarray], seq_len: int, vocab_size: int) -> None:
        counts = [max(0, (len(s) - 1) // seq_len) for s in segments]
        self.segments = [s for s, n in zip(segments, counts, strict=True) if n]
        self._ends = np.cumsum([n for n in counts if n], dtype=np.int64)
        self.seq_len, self.vocab_size = seq_len, vocab_size

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    @property
    def tokens(self) -> int:
        return len(self) * self.seq_len

    def take(self, rows: np.ndarray) -> torch.Tensor:
        """LongTensor ``(len(rows), seq_len + 1)`` of the given row indices."""
        segment = np.searchsorted(self._ends, rows, side="right")
        first = np.concatenate(([0], self._ends))[segment]
        out = np.empty((len(rows), self.seq_len + 1), dtype=np.int64)
        for i, (s, r) in enumerate(zip(segment, rows - first, strict=True)):
            start = int(r) * self.seq_len
            out[i] = self.segments[s][start : start + self.seq_len + 1]
        if out.size and (out.max() >= self.vocab_size or out.min() < 0):
            raise DataError(
                f"the data holds token id {int(out.max())}, outside the tokenizer's vocabulary "
                f"of {self.vocab_size}; use the tokenizer that produced the token shards "
                "(tokenizer=PATH/tokenizer.json or hf:NAME)"
            )
        return torch.from_numpy(out)


def fixed_batches(rows: PackedRows, batch_size: int, max_batches: int) -> list[torch.Tensor]:
    """The first ``max_batches`` full batches of rows, in data order (validation)."""
    n = min(max_batches, len(rows) // batch_size)
    return [rows.take(np.arange(i * batch_size, (i + 1) * batch_size)) for i in range(n)]


class ShuffledBatches:
    """Batches of rows drawn without replacement; each epoch has its own seeded order."""

    def __init__(self, rows: PackedRows, batch_size: int, seed: int) -> None:
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.epoch, self.position = 0, 0
        self._order = Permutation(len(rows), key64(seed, 0))

    def next_batch(self) -> torch.Tensor:
        n, picked = len(self.rows), []
        while sum(map(len, picked)) < self.batch_size:
            take = min(self.batch_size - sum(map(len, picked)), n - self.position)
            picked.append(self._order(np.arange(self.position, self.position + take)))
            self.position += take
            if self.position == n:
                self._start_epoch(self.epoch + 1)
        return self.rows.take(np.concatenate(picked))

    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0
        self._order = Permutation(len(self.rows), key64(self.seed, epoch))

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "rows",
            "rows": len(self.rows),
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "rows" or state.get("rows") != len(self.rows):
            raise DataError(
                f"the saved data position ({state.get('rows')} rows) does not match this data "
                f"({len(self.rows)} rows of seq_len={self.rows.seq_len}); the data, tokenizer or "
                "seq_len changed since the checkpoint, resume with the original settings"
            )
        self._start_epoch(int(state["epoch"]))
        self.position = int(state["position"])


def record_tokens(tokenizer: Tokenizer, text: str, val_fraction: float, val: bool) -> np.ndarray:
    """Packed tokens of one streamed record's training (or validation) side."""
    train_runs, val_runs = split_document(text, val_fraction)
    return pack_runs(tokenizer, val_runs if val else train_runs)


class StreamBatches:
    """Sequential batches from a streamed Hugging Face dataset.

    The position is the dataset's own ``state_dict()`` taken before the oldest record whose
    tokens are still buffered, plus how many of that record's tokens were already used: resuming
    re-reads from that record and skips those tokens. At the end of the stream a new pass starts.
    """

    def __init__(
        self,
        source: HFDataset,
        tokenizer: Tokenizer,
        seq_len: int,
        batch_size: int,
        val_fraction: float,
    ) -> None:
        self.source, self.tokenizer = source, tokenizer
        self.seq_len, self.batch_size, self.val_fraction = seq_len, batch_size, val_fraction
        self._buffer: list[tuple[int, dict, np.ndarray]] = []  # (pass, position, tokens)
        self._offset = 0
        self._close_records: weakref.finalize | None = None
        self._open_pass(0, None)

    def _open_pass(self, epoch: int, position: dict | None) -> None:
        self.epoch, self._whole_pass, self._pass_tokens = epoch, position is None, 0
        self._stream = open_hf_stream(self.source)
        if position is not None:
            self._stream.load_state_dict(position)
        if self._close_records is not None:
            self._close_records()
        self._records = iter_records(self.source, self._stream)
        # Close the reader before interpreter teardown, when `datasets` can still clean up.
        self._close_records = weakref.finalize(self, self._records.close)

    def _pull(self) -> None:
        """Buffer the next record that has training tokens, starting new passes as needed."""
        while True:
            for position, text in self._records:
                tokens = record_tokens(self.tokenizer, text, self.val_fraction, val=False)
                if len(tokens):
                    self._buffer.append((self.epoch, position, tokens))
                    self._pass_tokens += len(tokens)
                    return
            if self._whole_pass and not self._pass_tokens:
                raise DataError(
                    f"a full pass over {self.source.describe()} gave no training text; check "
                    "data_field and val_fraction"
                )
            self._open_pass(self.epoch + 1, None)

    def _row(self) -> np.ndarray:
        need = self.seq_len + 1
        while sum(len(t) for *_, t in self._buffer) < self._offset + need:
            self._pull()
        parts, skip = [], self._offset
        for *_, tokens in self._buffer:
            part = tokens[skip : skip + need - sum(map(len, parts))]
            parts.append(part)
            skip = 0
            if sum(map(len, parts)) == need:
                break
        self._offset += self.seq_len
        while self._buffer and self._offset >= len(self._buffer[0][2]):
            self._offset -= len(self._buffer.pop(0)[2])
        return np.concatenate(parts)

    def next_batch(self) -> torch.Tensor:
        rows = np.stack([self._row() for _ in range(self.batch_size)]).astype(np.int64)
        return torch.from_numpy(rows)

    def state_dict(self) -> dict[str, Any]:
        if self._buffer:
            epoch, position, _ = self._buffer[0]
        else:
            epoch, position = self.epoch, self._stream.state_dict()
        return {"kind": "stream", "epoch": epoch, "stream": position, "offset": self._offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "stream":
            raise DataError(
                "the saved data position is not one of a streamed dataset; the data setting "
                "changed since the checkpoint, resume with the original data="
            )
        self._buffer, self._offset = [], int(state["offset"])
        self._open_pass(int(state["epoch"]), state["stream"])
