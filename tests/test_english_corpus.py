"""english-v1 on a fake package tree: cleaning, errors, manifest, determinism, training."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from nobubble.data import DataError
from nobubble.data.english import (
    SOURCES,
    build,
    check_sources,
    clean_dictd,
    clean_rst,
    dictd_entries,
    main,
    pack,
)
from tests.helpers.pipeline import nobubble

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
DICTD = {s.name for s in SOURCES if s.kind == "dictd"}
_SYLLABLES = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "da", "gu", "zo"]


def _b64(n: int) -> str:
    digits = ""
    while True:
        digits = _B64[n % 64] + digits
        n //= 64
        if not n:
            return digits


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(_SYLLABLES, k=rng.randint(1, 3))) for _ in range(n))


def _write_dictd(base: Path, entries: list[tuple[str, str]]) -> None:
    base.parent.mkdir(parents=True, exist_ok=True)
    data, index = b"", []
    for head, body in entries:
        raw = body.encode("utf-8")
        index.append(f"{head}\t{_b64(len(data))}\t{_b64(len(raw))}")
        data += raw
    base.with_suffix(".index").write_text("\n".join(sorted(index)) + "\n")
    base.with_suffix(".dict.dz").write_bytes(gzip.compress(data, mtime=0))


def _status(root: Path, skip: tuple[str, ...] = (), versions: dict[str, str] | None = None):
    paras = [
        f"Package: {s.package}\nStatus: install ok installed\n"
        f"Version: {(versions or {}).get(s.package, s.version)}\n"
        for s in SOURCES
        if s.package not in skip
    ]
    path = root / "var/lib/dpkg/status"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(paras))


def fake_root(root: Path, words: int = 400) -> Path:
    """Every source laid out as the packages install it, filled with made-up words."""
    rng = random.Random(0)
    _status(root)
    for source in SOURCES:
        if source.kind == "dictd":
            entries = [("00-database-info", "This file was converted by dictfmt.\n")]
            entries += [
                (f"w{i}", f"w{i} \\W{i}\\, n.\n   {_words(rng, words)}\n   [1913 Webster]\n\n")
                for i in range(6)
            ]
            _write_dictd(root / source.paths[0], entries)
        else:
            for i in range(4):
                folder = root / source.paths[0].split("*")[0] / f"part{i}"
                folder.mkdir(parents=True, exist_ok=True)
                text = f"Title {i}\n=======\n\n{_words(rng, words)}\n"
                if source.paths[0].endswith(".gz"):
                    (folder / "page.rst.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
                    (folder / "skip.yaml.gz").write_bytes(gzip.compress(b"not: read", mtime=0))
                else:
                    (folder / "page.rst.txt").write_text(text)
    return root


def test_clean_dictd_drops_gcide_markup_and_link_braces():
    entry = (
        'Apple \\Ap"ple\\, n. [OE. appel.]\n'
        "   1. The fleshy pome of a {rosaceous} tree.\n"
        "      [1913 Webster]\n\n\n"
        "   2. See {apple tree}.\n"
    )
    assert clean_dictd(entry) == (
        "Apple, n. [OE. appel.]\n1. The fleshy pome of a rosaceous tree.\n\n2. See apple tree."
    )


def test_clean_rst_drops_spdx_and_title_underlines_only():
    text = (
        ".. SPDX-License-Identifier: GPL-2.0\n\n=====\nTitle\n=====\n\n"
        "Some *text* with :ref:`a link <x>`.\n\n\n\nSub\n---\nMore.\r\n"
    )
    assert clean_rst(text) == "Title\n\nSome *text* with :ref:`a link <x>`.\n\nSub\n\nMore."


def test_pack_joins_entries_up_to_the_limit():
    assert list(pack(["aaaa", "bbbb", "cccc", "d" * 20], limit=10)) == [
        "aaaa\n\nbbbb",
        "cccc",
        "d" * 20,
    ]


def test_dictd_entries_follow_the_file_and_skip_the_header(tmp_path):
    base = tmp_path / "x"
    _write_dictd(base, [("00-database-url", "u\n"), ("zeta", "zeta def\n"), ("alpha", "a\n")])
    assert list(dictd_entries(base)) == ["zeta def\n", "a\n"]


def test_a_missing_package_is_a_one_line_error_with_the_command(tmp_path, capsys):
    root = fake_root(tmp_path / "root")
    _status(root, skip=("dict-wn", "python3.11-doc"))
    with pytest.raises(DataError, match=r"dict-wn python3\.11-doc") as info:
        check_sources(root)
    assert "\n" not in str(info.value)
    assert "apt-get install -y dict-wn=1:3.0-37 python3.11-doc=" in str(info.value)
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "out"), "--root", str(root)])
    assert str(exit_info.value).startswith("error: english-v1 needs the Debian packages")
    assert not (tmp_path / "out").exists()


def test_an_out_dir_that_cannot_be_written_is_refused_before_any_work(
    tmp_path, capsys, unwritable, monkeypatch
):
    """Under a regular file, or in a folder that takes no files (``unwritable``: see
    conftest.lock_writes for how read-only is simulated): one line, exit 2, before --install
    and before the packages are looked at."""

    def installed(*args: object) -> None:
        raise AssertionError("the packages were installed")

    monkeypatch.setattr("nobubble.data.english.install_command", installed)
    (tmp_path / "file").write_text("keep")
    for out in (tmp_path / "file" / "corpus", unwritable / "corpus"):
        with pytest.raises(SystemExit) as exit_info:
            main([str(out), "--root", str(tmp_path / "no-packages"), "--install"])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"error: OUT_DIR {out}: " in err and err.count("\n") == 1, err
    assert (tmp_path / "file").read_text() == "keep" and list(unwritable.iterdir()) == []


def test_another_package_version_is_refused(tmp_path):
    root = fake_root(tmp_path / "root")
    _status(root, versions={"dict-gcide": "0.49"})
    with pytest.raises(DataError, match=r"dict-gcide 0.49 \(needs 0.48.5\+nmu2\)"):
        check_sources(root)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("english")
    out = tmp / "out"
    return out, build(out, fake_root(tmp / "root"))


def test_a_folder_with_other_data_is_refused_and_left_alone(tmp_path, built):
    out = tmp_path / "data"
    out.mkdir()
    (out / "shard_00000.bin").write_bytes(b"theirs")
    with pytest.raises(DataError, match="not empty and holds no english-v1 build"):
        build(out, fake_root(tmp_path / "root"))
    assert [p.name for p in out.iterdir()] == ["shard_00000.bin"]
    assert (out / "shard_00000.bin").read_bytes() == b"theirs"


def test_an_earlier_build_may_be_built_again(built, tmp_path):
    out, manifest = built
    again = build(out, fake_root(tmp_path / "root"))
    assert {k: v for k, v in again.items() if k != "command"} == {
        k: v for k, v in manifest.items() if k != "command"
    }


def test_manifest_counts_every_source(built):
    out, manifest = built
    assert manifest == json.loads((out / "manifest.json").read_text())
    assert [r["name"] for r in manifest["sources"]] == [s.name for s in SOURCES]
    for record in manifest["sources"]:
        lines = (out / record["text"]).read_text().splitlines()
        texts = [json.loads(line)["text"] for line in lines]
        assert record["documents"] == len(texts) > 0
        assert record["bytes"] == sum(len(t.encode()) for t in texts)
        assert record["files"] == (1 if record["name"] in DICTD else 4)
        assert record["tokens"] > record["documents"]
        assert "1913 Webster" not in "".join(texts) and "dictfmt" not in "".join(texts)
    total = manifest["total"]
    assert total["tokens"] == sum(s["tokens"] for s in manifest["shards"])
    assert total["bytes"] == sum(r["bytes"] for r in manifest["sources"])
    assert [s["file"] for s in manifest["shards"]] == ["shard_00000.bin"]
    assert (out / "shard_00000.bin").stat().st_size == 2 * total["tokens"]


def test_two_builds_are_identical(built, tmp_path):
    out, manifest = built
    again = build(tmp_path / "again", fake_root(tmp_path / "root"))
    assert again == manifest | {"command": again["command"]}  # the command names the folder
    for name in ["tokenizer.json", "shard_00000.bin"]:
        assert (out / name).read_bytes() == (tmp_path / "again" / name).read_bytes()


def test_training_runs_on_the_built_corpus(built, tmp_path):
    out, _ = built
    tokenizer = str(out / "tokenizer.json")
    nobubble(tmp_path / "run", f"data={out}/", f"tokenizer={tokenizer}", "steps=2")
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
