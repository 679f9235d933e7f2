"""Where documents come from: the built-in corpus, local files, Hugging Face datasets, .bin shards.

``data=`` grammar: ``builtin`` | ``hf:NAME[:CONFIG]`` | a file, folder or glob of ``.txt``
(one document per file), ``.jsonl`` / ``.parquet`` (one document per record, text in
``data_field``) or ``.bin`` token shards.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nobubble.config.extras import require
from nobubble.data.corpus import corpus_documents
from nobubble.data.errors import DataError

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
BIN_SUFFIX = ".bin"
DATA_SUFFIXES = (*TEXT_SUFFIXES, BIN_SUFFIX)
_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class BuiltinCorpus:
    def describe(self) -> str:
        return "builtin (Shakespeare's plays)"


@dataclass(frozen=True)
class TextFiles:
    paths: tuple[Path, ...]
    field: str

    def describe(self) -> str:
        return _describe_paths(self.paths)


@dataclass(frozen=True)
class BinFiles:
    paths: tuple[Path, ...]

    def describe(self) -> str:
        return _describe_paths(self.paths)


@dataclass(frozen=True)
class HFDataset:
    """A Hugging Face dataset streamed with ``datasets.load_dataset(..., streaming=True)``.

    ``data_files`` is only set for packaged builders such as ``parquet`` (what the tests use).
    """

    name: str
    config: str | None
    field: str
    data_files: tuple[str, ...] | None = None

    def describe(self) -> str:
        return f"hf:{self.name}" + (f":{self.config}" if self.config else "")


Source = BuiltinCorpus | TextFiles | BinFiles | HFDataset


def _describe_paths(paths: tuple[Path, ...]) -> str:
    return str(paths[0]) if len(paths) == 1 else f"{len(paths)} files under {paths[0].parent}"


def parse_data_spec(spec: str, field: str) -> Source:
    """Turn ``cfg.data`` into a source; local paths are resolved and checked here."""
    if spec == "builtin":
        return BuiltinCorpus()
    if spec.startswith("hf:"):
        name, _, config = spec.removeprefix("hf:").partition(":")
        if not name:
            raise DataError(f"data={spec!r} names no dataset; use hf:NAME or hf:NAME:CONFIG")
        return HFDataset(name, config or None, field)
    paths = expand_paths(spec)
    kinds = {path.suffix == BIN_SUFFIX for path in paths}
    if len(kinds) > 1:
        raise DataError(
            f"data={spec!r} mixes .bin token shards with text files; point data= at one kind"
        )
    return BinFiles(tuple(paths)) if kinds == {True} else TextFiles(tuple(paths), field)


def expand_paths(spec: str) -> list[Path]:
    """A file, a folder (its data files) or a glob (``**`` recurses), sorted."""
    pattern = os.path.expanduser(spec)
    if any(c in pattern for c in _GLOB_CHARS):
        paths = [Path(p) for p in sorted(glob.glob(pattern, recursive=True)) if Path(p).is_file()]
        if not paths:
            raise DataError(
                f"data glob {spec!r} matches no file; check the pattern (quote it in the shell "
                "so that nobubble expands it)"
            )
    else:
        path = Path(pattern)
        if path.is_dir():
            paths = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in DATA_SUFFIXES)
            if not paths:
                raise DataError(
                    f"data folder {path} holds no {' / '.join(DATA_SUFFIXES)} file; point data= at "
                    "the files or a glob such as 'DIR/**/*.jsonl'"
                )
        elif path.is_file():
            paths = [path]
        else:
            raise DataError(
                f"data path {spec!r} does not exist; give a file, folder or glob of "
                ".txt/.jsonl/.parquet/.bin files, data=builtin, or data=hf:NAME[:CONFIG]"
            )
    for path in paths:
        if path.suffix not in DATA_SUFFIXES:
            raise DataError(
                f"{path}: unknown data file type {path.suffix or '(no extension)'!r}; nobubble "
                "reads .txt (one document per file), .jsonl and .parquet (one document per "
                "record) and .bin token shards; rename or convert the file"
            )
    return paths


def iter_documents(source: BuiltinCorpus | TextFiles | HFDataset) -> Iterator[str]:
    """Every document of a text source in a fixed order (empty ones skipped)."""
    if isinstance(source, BuiltinCorpus):
        yield from corpus_documents()
    elif isinstance(source, HFDataset):
        yield from (text for _, text in iter_records(source) if text)
    else:
        readers = {".txt": read_txt, ".jsonl": read_jsonl, ".parquet": read_parquet}
        for path in source.paths:
            found = False
            for text in readers[path.suffix](path, source.field):
                found = True
                yield text
            if not found:
                raise DataError(f"{path} contains no text; remove it from data= or fill it")


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read data file {path}: {exc.strerror or exc}") from None


def _decode(raw: bytes, path: Path, line: int | None = None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = line or raw.count(b"\n", 0, exc.start) + 1
        bad = raw[exc.start : exc.start + 4]
        raise DataError(
            f"{path} line {line} is not valid UTF-8 (bytes {bad!r}); convert the file to UTF-8, "
            "e.g. `iconv -f latin1 -t utf-8`"
        ) from None


def read_txt(path: Path, _field: str = "") -> Iterator[str]:
    text = _decode(_read_bytes(path), path)
    if text.strip():
        yield text


def read_jsonl(path: Path, field: str) -> Iterator[str]:
    for number, raw in enumerate(_read_bytes(path).splitlines(), start=1):
        line = _decode(raw, path, number)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path} line {number} is not valid JSON ({exc.msg}); .jsonl needs one JSON "
                "object per line"
            ) from None
        text = record_text(record, field, f"{path} line {number}")
        if text:
            yield text


def read_parquet(path: Path, field: str) -> Iterator[str]:
    pa = require("pyarrow", f"reading {path}")
    pq = require("pyarrow.parquet", f"reading {path}")

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"cannot read {path} as Parquet: {one_line(exc)}") from None
    schema = parquet.schema_arrow
    if field not in schema.names:
        raise DataError(
            f"{path} has no column {field!r} (columns: {', '.join(schema.names)}); set "
            "data_field= to the text column"
        )
    if not pa.types.is_string(schema.field(field).type) and not pa.types.is_large_string(
        schema.field(field).type
    ):
        raise DataError(
            f"{path} column {field!r} holds {schema.field(field).type}, not text; set "
            "data_field= to a string column"
        )
    row = 0
    batches = parquet.iter_batches(columns=[field])
    while True:
        try:
            batch = next(batches, None)
        except (OSError, pa.ArrowException) as exc:
            raise DataError(
                f"{path} is damaged after row {row} ({one_line(exc)}); re-create or replace the "
                "file"
            ) from None
        if batch is None:
            return
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                raise DataError(f"{path} row {row}: column {field!r} is null; drop such rows")
            if text:
                yield text


def one_line(exc: BaseException) -> str:
    """An error's message on one line (pyarrow's end in blank lines)."""
    return " ".join(str(exc).split())


def record_text(record: Any, field: str, where: str) -> str:
    """The text field of one record, or an error that names the record."""
    if not isinstance(record, dict):
        raise DataError(f"{where} is a {type(record).__name__}, not an object with a text field")
    if field not in record:
        raise DataError(
            f"{where} has no field {field!r} (fields: {', '.join(map(str, record))}); set "
            "data_field= to the field that holds the text"
        )
    text = record[field]
    if not isinstance(text, str):
        raise DataError(
            f"{where}: field {field!r} holds {type(text).__name__}, not text; set data_field= to "
            "a text field"
        )
    return text


def open_hf_stream(source: HFDataset) -> Any:
    """``datasets.load_dataset(NAME, CONFIG, split="train", streaming=True)``."""
    datasets = require("datasets", f"data={source.describe()}")
    try:
        stream = datasets.load_dataset(
            source.name,
            source.config,
            split="train",
            streaming=True,
            data_files=list(source.data_files) if source.data_files else None,
        )
    except (datasets.exceptions.DatasetsError, OSError, ValueError, ConnectionError) as exc:
        raise DataError(
            f"cannot stream Hugging Face dataset {source.describe()!r} (split 'train'): {exc}\n"
            "Check the name and config (data=hf:NAME:CONFIG) and your network"
        ) from None
    features = getattr(stream, "features", None)
    if features is not None and source.field not in features:
        raise DataError(
            f"{source.describe()} has no field {source.field!r} (fields: {', '.join(features)}); "
            "set data_field= to the text field"
        )
    return stream


def iter_records(source: HFDataset, stream: Any = None) -> Iterator[tuple[Any, str]]:
    """(stream position before the record, its text) for each record of one pass.

    The position is ``stream.state_dict()``; ``stream.load_state_dict(position)`` resumes there.
    """
    stream = open_hf_stream(source) if stream is None else stream
    records = iter(stream)
    try:
        for number in itertools.count(1):
            position = stream.state_dict()
            try:
                record = next(records)
            except StopIteration:
                return
            where = f"{source.describe()} record {number} (counted from where reading started)"
            yield position, record_text(record, source.field, where)
    finally:
        close = getattr(records, "close", None)
        if close is not None:
            close()
