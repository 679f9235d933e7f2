"""Build the English corpus ``english-v1`` from Debian packages: text, BPE tokenizer, shards.

``python -m nobubble.data.english OUT_DIR`` reads the text files that seven Debian packages
install (dictionaries, the Linux kernel's and Python's documentation), cleans them minimally,
writes them as JSON lines under ``OUT_DIR/text/``, trains a 4,096-token byte-level BPE on them,
tokenizes them into ``OUT_DIR/shard_*.bin`` and writes ``OUT_DIR/tokenizer.json`` and
``OUT_DIR/manifest.json``. Train with ``nobubble train data=OUT_DIR/
tokenizer=OUT_DIR/tokenizer.json``. See docs/data.md.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import itertools
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nobubble.config import ConfigError
from nobubble.data.errors import DataError
from nobubble.data.prepare import _document_tokens
from nobubble.data.shards import write_bin_shards
from nobubble.data.sources import iter_documents, parse_data_spec
from nobubble.data.tokenizer import load_tokenizer, train_bpe
from nobubble.destinations import check_output_folder

NAME = "english-v1"
VOCAB_SIZE = 4096
BIN_DTYPE = "uint16"
SHARD_TOKENS = 100_000_000
DOC_CHARS = 8192  # dictionary entries are packed into documents of at most this many characters
DPKG_STATUS = "var/lib/dpkg/status"


@dataclass(frozen=True)
class Source:
    """One Debian package and the files of it that the corpus reads."""

    name: str
    package: str
    version: str  # the version english-v1 was built from; another one is refused
    licence: str
    kind: str  # "dictd": a dictd database; "rst": reStructuredText / plain text files
    paths: tuple[str, ...]  # dictd: the database path without suffix; rst: globs; under root


SOURCES = (
    Source(
        "gcide", "dict-gcide", "0.48.5+nmu2",
        "GPL-3.0-or-later (GNU Collaborative International Dictionary of English)",
        "dictd", ("usr/share/dictd/gcide",),
    ),
    Source(
        "wordnet", "dict-wn", "1:3.0-37", "WordNet-3.0 (Princeton, permissive)",
        "dictd", ("usr/share/dictd/wn",),
    ),
    Source(
        "foldoc", "dict-foldoc", "20230119-1",
        "FOLDOC licence (verbatim copies and derived works under identical terms)",
        "dictd", ("usr/share/dictd/foldoc",),
    ),
    Source(
        "jargon", "dict-jargon", "4.4.7-3.1", "public domain (Jargon File 4.4.7)",
        "dictd", ("usr/share/dictd/jargon",),
    ),
    Source(
        "devil", "dict-devil", "1.0-13.1", "public domain (Bierce, The Devil's Dictionary)",
        "dictd", ("usr/share/dictd/devil",),
    ),
    Source(
        "linux-doc", "linux-doc-6.1", "6.1.192-3", "GPL-2.0-only (Linux kernel documentation)",
        "rst", (
            "usr/share/doc/linux-doc-6.1/Documentation/**/*.rst.gz",
            "usr/share/doc/linux-doc-6.1/Documentation/**/*.txt.gz",
        ),
    ),
    Source(
        "python-doc", "python3.11-doc", "3.11.2-6+deb12u9", "PSF-2.0 (Python documentation)",
        "rst", ("usr/share/doc/python3.11/html/_sources/**/*.rst.txt",),
    ),
)  # fmt: skip

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_SOURCE_TAG = re.compile(r"^\[[^\]\n]{1,40}\]$", re.M)  # gcide's "[1913 Webster]" lines
_PRONUNCIATION = re.compile(r" ?\\[^\\\n]*\\")  # gcide's "\Ab*do"men\"
_CROSS_REF = re.compile(r"\{([^{}]*)\}")  # dictd's "{see this}" links
_ADORNMENT = re.compile(r"^([=\-~^*#+`'\".:_])\1{2,}[ \t]*$", re.M)  # rst title underlines
_SPDX = re.compile(r"^\.\. SPDX-License-Identifier:.*$", re.M)
_BLANK_RUNS = re.compile(r"\n{3,}")


def installed_versions(root: Path) -> dict[str, str]:
    """Package -> version of every installed package in ``root``'s dpkg status file."""
    path = root / DPKG_STATUS
    if not path.is_file():
        return {}
    versions = {}
    for para in path.read_text(encoding="utf-8", errors="replace").split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in para.splitlines() if ": " in line and line[0] != " "
        )
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            versions[fields["Package"]] = fields.get("Version", "")
    return versions


def install_command(sources: Iterable[Source]) -> list[str]:
    """The ``apt-get`` command that installs ``sources`` at english-v1's versions."""
    return ["apt-get", "install", "-y", *(f"{s.package}={s.version}" for s in sources)]


def check_sources(root: Path) -> None:
    """Raise a one-line :class:`DataError` unless every package is installed at its version."""
    versions = installed_versions(root)
    missing = [s for s in SOURCES if s.package not in versions]
    if missing:
        names = " ".join(s.package for s in missing)
        raise DataError(
            f"{NAME} needs the Debian packages {names}, not installed under {root}: run "
            f"`{shlex.join(install_command(missing))}` or pass --install"
        )
    wrong = [s for s in SOURCES if versions[s.package] != s.version]
    if wrong:
        found = ", ".join(f"{s.package} {versions[s.package]} (needs {s.version})" for s in wrong)
        raise DataError(
            f"{NAME} is defined by fixed package versions, found {found}: run "
            f"`{shlex.join(install_command(wrong))}`, or build a new, differently named corpus"
        )


def _b64_number(text: str) -> int:
    value = 0
    for char in text:
        value = value * 64 + _B64.index(char)
    return value


def dictd_entries(base: Path) -> Iterator[str]:
    """The entries of the dictd database ``base.index`` + ``base.dict.dz``, in file order,
    without the ``00-database-*`` header entries."""
    spans = set()
    for line in base.with_suffix(".index").read_text(encoding="utf-8").splitlines():
        head, offset, length = line.split("\t")[:3]
        if not head.startswith(("00-database", "00database")):
            spans.add((_b64_number(offset), _b64_number(length)))
    data = gzip.decompress(base.with_suffix(".dict.dz").read_bytes())
    for offset, length in sorted(spans):
        raw = data[offset : offset + length]
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:  # a few gcide entries are in Windows-1252
            yield raw.decode("cp1252", errors="replace")


def clean_dictd(entry: str) -> str:
    """Drop gcide's pronunciations and source tags and the ``{link}`` braces; unindent."""
    entry = _PRONUNCIATION.sub("", entry)
    entry = _CROSS_REF.sub(r"\1", entry)
    lines = [line.strip() for line in entry.splitlines()]
    entry = _SOURCE_TAG.sub("", "\n".join(lines))
    return _BLANK_RUNS.sub("\n\n", entry).strip()


def clean_rst(text: str) -> str:
    """Drop SPDX lines and title underlines; the rest of the markup stays."""
    text = _SPDX.sub("", _ADORNMENT.sub("", text.replace("\r\n", "\n")))
    return _BLANK_RUNS.sub("\n\n", text).strip()


def pack(entries: Iterable[str], limit: int = DOC_CHARS) -> Iterator[str]:
    """Join consecutive entries with blank lines into documents of at most ``limit`` characters
    (an entry longer than that is a document of its own)."""
    doc: list[str] = []
    size = 0
    for entry in entries:
        if doc and size + 2 + len(entry) > limit:
            yield "\n\n".join(doc)
            doc, size = [], 0
        doc.append(entry)
        size += len(entry) + 2 * (len(doc) > 1)
    if doc:
        yield "\n\n".join(doc)


def source_files(source: Source, root: Path) -> list[Path]:
    """The files of ``source`` under ``root``, in sorted order."""
    if source.kind == "dictd":
        return [root / source.paths[0]]
    return sorted({p for pattern in source.paths for p in root.glob(pattern) if p.is_file()})


def source_documents(source: Source, root: Path) -> Iterator[str]:
    """The cleaned documents of ``source``: packed dictionary entries, or one per file."""
    if source.kind == "dictd":
        entries = (clean_dictd(e) for e in dictd_entries(root / source.paths[0]))
        yield from pack(e for e in entries if e)
        return
    for path in source_files(source, root):
        raw = path.read_bytes()
        text = clean_rst((gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8"))
        if text:
            yield text


def _read(path: Path) -> Iterator[str]:
    return iter_documents(parse_data_spec(str(path), "text"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_own_folder(out_dir: Path) -> None:
    """A build replaces the shards, text and tokenizer of ``out_dir``: refuse a folder that holds
    anything but an earlier build of this corpus (its manifest names it), so that nobody's
    data is deleted by pointing the builder at it."""
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    try:
        own = json.loads((out_dir / "manifest.json").read_text()).get("name") == NAME
    except (OSError, ValueError, AttributeError):
        own = False
    if not own:
        raise DataError(
            f"{out_dir} is not empty and holds no {NAME} build (its manifest.json): the build "
            "would replace shards and files there; build into a new or empty folder"
        )


def build(out_dir: Path, root: Path = Path("/")) -> dict:
    """Build the corpus into ``out_dir`` from the packages installed under ``root``; returns
    the manifest (also written to ``out_dir/manifest.json``)."""
    check_sources(root)
    _check_own_folder(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text_dir = out_dir / "text"  # not directly in out_dir: data=OUT_DIR/ reads only the shards
    text_dir.mkdir(exist_ok=True)
    for stale in out_dir.glob("shard_*.bin"):
        stale.unlink()
    versions = installed_versions(root)
    records = []
    for index, source in enumerate(SOURCES):
        path = text_dir / f"{index:02d}-{source.name}.jsonl"
        documents = n_bytes = 0
        with path.open("w", encoding="utf-8", newline="\n") as f:
            for doc in source_documents(source, root):
                f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
                documents += 1
                n_bytes += len(doc.encode("utf-8"))
        records.append({
            "name": source.name, "package": source.package, "version": versions[source.package],
            "licence": source.licence, "files": len(source_files(source, root)),
            "bytes": n_bytes, "documents": documents, "text": f"text/{path.name}",
            "text_sha256": _sha256(path),
        })  # fmt: skip
    texts = [out_dir / r["text"] for r in records]
    trained = train_bpe(itertools.chain.from_iterable(map(_read, texts)), VOCAB_SIZE)
    tok = load_tokenizer(trained.save(out_dir))

    def counted(record: dict, arrays: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
        record["tokens"] = 0
        for array in arrays:
            record["tokens"] += len(array)
            yield array

    arrays = itertools.chain.from_iterable(
        counted(r, _document_tokens(_read(p), tok, None))
        for r, p in zip(records, texts, strict=True)
    )
    shards = write_bin_shards(arrays, out_dir, bin_dtype=BIN_DTYPE, shard_tokens=SHARD_TOKENS)
    itemsize = np.dtype(BIN_DTYPE).itemsize
    manifest = {
        "name": NAME,
        "command": f"python -m nobubble.data.english {out_dir}",
        "vocab_size": tok.vocab_size,
        "bin_dtype": BIN_DTYPE,
        "tokenizer_sha256": _sha256(out_dir / "tokenizer.json"),
        "sources": records,
        "total": {k: sum(r[k] for r in records) for k in ("files", "bytes", "documents", "tokens")},
        "shards": [
            {"file": p.name, "tokens": p.stat().st_size // itemsize, "sha256": _sha256(p)}
            for p in shards
        ],
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m nobubble.data.english", description=__doc__.splitlines()[0]
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--root", type=Path, default=Path("/"), help="where packages are installed")
    parser.add_argument(
        "--install", action="store_true", help="run apt-get install for the packages first"
    )
    args = parser.parse_args(argv)
    try:  # before any work
        check_output_folder(args.out_dir, "OUT_DIR")
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    if args.install:
        command = install_command(SOURCES)
        print(f"running: {shlex.join(command)}", flush=True)
        subprocess.run(command, check=True)
    start = time.monotonic()
    try:
        manifest = build(args.out_dir, args.root)
    except DataError as exc:
        sys.exit(f"error: {exc}")
    total = manifest["total"]
    print(
        f"wrote {NAME} to {args.out_dir}: {total['bytes']:,} bytes, {total['tokens']:,} tokens "
        f"in {len(manifest['shards'])} shard(s), {time.monotonic() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
