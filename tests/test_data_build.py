"""build_data end to end: packing, order, resume, validation, run folders, .bin and HF streams."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nobubble.config import TrainConfig
from nobubble.data import DataBundle, DataError, build_data, load_tokenizer, write_bin_shards
from nobubble.data.batching import PackedRows
from nobubble.data.build import build_from_source
from nobubble.data.prepare import main as prepare_main
from nobubble.data.shards import BLOCK_TOKENS, open_shard
from nobubble.data.sources import HFDataset


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"seq_len": 32, "batch_size": 4, "eval_batches": 3, **kw})


def _text(n_lines: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "ay", "there's", "rub"]
    return "".join(" ".join(rng.choices(words, k=rng.randint(1, 9))) + "\n" for _ in range(n_lines))


def _batches(bundle: DataBundle, n: int) -> list[torch.Tensor]:
    return [bundle.train.next_batch() for _ in range(n)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _resumes_exactly(make: callable, before: int, after: int) -> None:
    """Save the position after ``before`` batches (through JSON), restore it in a fresh bundle:
    the next ``after`` batches equal those of an uninterrupted run."""
    straight = make()
    _batches(straight, before)
    state = json.loads(json.dumps(straight.train.state_dict()))
    expected = _batches(straight, after)
    resumed = make()
    resumed.train.load_state_dict(state)
    assert _same(_batches(resumed, after), expected)


@pytest.fixture(scope="module")
def builtin() -> DataBundle:
    return build_data(TrainConfig())


def test_default_data_is_the_builtin_corpus_in_bytes(builtin):
    cfg = TrainConfig()
    assert builtin.tokenizer.spec == "byte"
    batch = builtin.train.next_batch()
    assert batch.dtype == torch.int64 and batch.shape == (cfg.batch_size, cfg.seq_len + 1)
    assert len(builtin.val) == cfg.eval_batches
    assert all(v.dtype == torch.int64 and v.shape == batch.shape for v in builtin.val)
    assert int(batch.min()) >= 0 and int(batch.max()) < builtin.tokenizer.vocab_size
    info = builtin.info
    assert info["train_tokens"] > 4_000_000 and 0.02 < info["val_tokens"] / 5e6 < 0.08
    text = builtin.tokenizer.decode(torch.cat(list(builtin.val[0])))
    assert text.count(":\n") > 20  # speakers' lines of the plays


def test_two_builds_give_identical_batches_and_seeds_reorder(builtin):
    again = build_data(TrainConfig())
    first, second = _batches(build_data(TrainConfig()), 5), _batches(again, 5)
    assert _same(first, second)
    assert _same(builtin.val, again.val)
    other_seed = build_data(TrainConfig(seed=1))
    assert not _same(_batches(other_seed, 5), first)
    assert _same(other_seed.val, again.val)  # validation does not depend on the seed


def test_rows_overlap_by_one_token_and_cover_the_stream():
    tokens = np.arange(100, dtype=np.uint16)
    rows = PackedRows([tokens], seq_len=10, vocab_size=1000)
    assert len(rows) == 9  # (100 - 1) // 10
    table = rows.take(np.arange(len(rows)))
    assert table.shape == (9, 11)
    assert torch.equal(table[:-1, -1], table[1:, 0])
    assert table[:, :-1].flatten().tolist() == list(range(90))


def test_rows_never_cross_segments():
    rows = PackedRows([np.arange(25), np.arange(100, 108), np.arange(200, 221)], 10, 1000)
    assert len(rows) == 2 + 0 + 2
    table = rows.take(np.arange(4)).tolist()
    assert [r[0] for r in table] == [0, 10, 200, 210] and table[3][-1] == 220


def test_an_epoch_visits_every_row_once_in_a_seeded_order(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(_text(3000, 0))
    bundle = build_data(_cfg(data=str(path), batch_size=5))
    rows = bundle.train.rows
    n = len(rows)
    in_data_order = [tuple(r) for r in rows.take(np.arange(n)).tolist()]
    seen = [tuple(r) for r in torch.cat(_batches(bundle, -(-2 * n // 5))).tolist()]
    first, second = seen[:n], seen[n : 2 * n]
    assert sorted(first) == sorted(in_data_order) == sorted(second)  # each row once per epoch
    assert len(set(in_data_order)) == n
    assert first != in_data_order and second != first  # shuffled, differently every epoch
    assert bundle.train.state_dict()["epoch"] == 2


def test_resume_is_exact_mid_epoch_and_across_epochs(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(_text(2000, 1))
    make = lambda: build_data(_cfg(data=str(path), batch_size=3))  # noqa: E731
    n_batches = len(make().train.rows) // 3
    _resumes_exactly(make, 7, 10)
    _resumes_exactly(make, n_batches - 1, 5)  # the restored run crosses into epoch 2


def test_resume_rejects_a_position_of_other_data(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(_text(2000, 1))
    state = build_data(_cfg(data=str(path))).train.state_dict()
    other = build_data(_cfg(data=str(path), seq_len=16))
    with pytest.raises(DataError, match="resume with the original settings"):
        other.train.load_state_dict(state)


def test_train_and_validation_text_do_not_overlap(tmp_path):
    for i in range(30):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"DOCUMENT {i}\n" + _text(400, i))
    bundle = build_data(_cfg(data=str(tmp_path / "*.txt"), val_fraction=0.2, seq_len=64))
    decode = bundle.tokenizer.decode
    val_text = "".join(decode(row) for batch in bundle.val for row in batch)
    train_rows = bundle.train.rows.take(np.arange(len(bundle.train.rows)))
    train_text = "".join(decode(row) for row in train_rows)
    val_lines = {line for line in val_text.splitlines() if len(line) > 45}
    assert val_lines and not any(line in train_text for line in val_lines)


def test_documents_are_joined_with_eos(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        "\n".join(json.dumps({"text": f"record {i} " * 20}) for i in range(200))
    )
    bundle = build_data(_cfg(data=str(tmp_path / "a.jsonl"), val_fraction=0.3))
    rows = bundle.train.rows.take(np.arange(len(bundle.train.rows)))
    stream = torch.cat([rows[0], *[r[1:] for r in rows[1:]]])
    eos, documents, current = bundle.tokenizer.eos_id, [], []
    for token in stream.tolist():
        if token == eos:
            documents.append(bytes(current).decode())
            current = []
        else:
            current.append(token)
    numbers = [int(doc.split(" ")[1]) for doc in documents]
    assert 100 < len(documents) < 190 and numbers == sorted(set(numbers))
    assert documents == [f"record {i} " * 20 for i in numbers]


def test_validation_is_capped_at_eval_batches_and_may_be_fewer(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(_text(3000, 2))
    assert len(build_data(_cfg(data=str(path), eval_batches=2)).val) == 2
    few = build_data(_cfg(data=str(path), eval_batches=1000))
    assert 1 <= len(few.val) < 1000
    assert len(few.val) == few.info["val_tokens"] // 32 // 4


def test_too_little_data_for_the_sequence_length_is_an_error(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(_text(400, 3))  # about 13 KB: two pieces
    with pytest.raises(DataError, match="lower seq_len / batch_size"):
        build_data(_cfg(data=str(path), seq_len=4096))
    with pytest.raises(DataError, match="raise val_fraction"):
        build_data(_cfg(data=str(path), seq_len=512, batch_size=8))


def test_bpe_is_trained_on_training_text_saved_and_reused(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(_text(3000, 4))
    run = tmp_path / "run"
    cfg = _cfg(data=str(path), tokenizer="bpe", bpe_vocab_size=300)
    first = build_data(cfg, run)
    assert (run / "tokenizer.json").is_file() and 257 < first.tokenizer.vocab_size <= 300
    again = build_data(cfg, run)  # a resume loads the saved tokenizer instead of retraining
    assert again.tokenizer.spec == str(run / "tokenizer.json")
    assert again.tokenizer.to_json() == first.tokenizer.to_json()
    assert _same(_batches(first, 3), _batches(again, 3)) and _same(first.val, again.val)
    assert _same(build_data(cfg).val, first.val)  # no run folder: same training, same data


def test_a_given_tokenizer_builds_the_same_data_and_touches_no_folder(tmp_path, monkeypatch):
    """A pipeline rank other than the leader: the leader's tokenizer, handed over in memory,
    and only the data source is read."""
    path = tmp_path / "a.txt"
    path.write_text(_text(3000, 4))
    cfg = _cfg(data=str(path), tokenizer="bpe", bpe_vocab_size=300)
    leader = build_data(cfg, tmp_path / "run")
    before = sorted(tmp_path.rglob("*"))
    monkeypatch.chdir(tmp_path)
    given = load_tokenizer(tmp_path / "run")  # any object with the leader's tokenizer
    other = build_data(cfg, tokenizer=given)
    assert other.tokenizer is given
    assert sorted(tmp_path.rglob("*")) == before
    assert _same(_batches(other, 3), _batches(leader, 3)) and _same(other.val, leader.val)
    with pytest.raises(ValueError, match="not both"):
        build_data(cfg, tmp_path / "run", tokenizer=given)


def test_the_run_folder_tokenizer_wins_on_resume(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(_text(3000, 5))
    run = tmp_path / "run"
    build_data(_cfg(data=str(path), tokenizer="bpe", bpe_vocab_size=300), run)
    path.write_text(_text(3000, 6))  # different text would train a different BPE
    resumed = build_data(_cfg(data=str(path), tokenizer="bpe", bpe_vocab_size=300), run)
    assert resumed.tokenizer.to_json() == load_tokenizer(run).to_json()
    byte_run = tmp_path / "byte-run"
    assert build_data(_cfg(data=str(path)), byte_run).tokenizer.spec == "byte"
    assert load_tokenizer(byte_run).spec == "byte"


# --- .bin token shards ------------------------------------------------------------------------


def _write_raw(path: Path, tokens: np.ndarray, dtype: str, header: bool = False) -> Path:
    with path.open("wb") as f:
        if header:
            magic, version = (20240520, 1) if dtype == "uint16" else (20240801, 7)  # llm.c
            head = np.zeros(256, dtype="<i4")
            head[:3] = magic, version, len(tokens)
            f.write(head.tobytes())
        f.write(tokens.astype("<u2" if dtype == "uint16" else "<u4").tobytes())
    return path


@pytest.mark.parametrize("header", [False, True])
@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_shards_raw_and_with_llmc_header(tmp_path, dtype, header):
    tokens = np.arange(3 * BLOCK_TOKENS + 100) % 251
    _write_raw(tmp_path / "s0.bin", tokens, dtype, header)
    shard = open_shard(tmp_path / "s0.bin", dtype if not header else "uint16")
    assert shard.dtype.itemsize == (2 if dtype == "uint16" else 4)
    assert np.array_equal(shard, tokens)


def test_bin_data_trains_validates_and_resumes(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(3):
        _write_raw(tmp_path / f"s{i}.bin", rng.integers(0, 257, 5 * BLOCK_TOKENS), "uint16")
    cfg = _cfg(data=str(tmp_path / "*.bin"), val_fraction=0.2)
    bundle = build_data(cfg)
    assert bundle.info["train_tokens"] + bundle.info["val_tokens"] <= 15 * BLOCK_TOKENS
    assert bundle.info["val_tokens"] >= BLOCK_TOKENS // 2 and len(bundle.val) == 3
    _resumes_exactly(lambda: build_data(cfg), 11, 6)
    other = build_data(_cfg(data=str(tmp_path / "*.bin"), val_fraction=0.2, seed=3))
    assert not _same(_batches(other, 3), _batches(build_data(cfg), 3))


def test_bin_errors_are_actionable(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
    with pytest.raises(DataError, match="not a multiple of 2"):
        build_data(_cfg(data=str(tmp_path / "odd.bin")))
    (tmp_path / "odd.bin").unlink()
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(DataError, match="is empty"):
        build_data(_cfg(data=str(tmp_path / "empty.bin")))
    (tmp_path / "empty.bin").unlink()
    bad = _write_raw(tmp_path / "bad.bin", np.arange(4 * BLOCK_TOKENS) % 250, "uint16", True)
    bad.write_bytes(bad.read_bytes()[:-2])
    with pytest.raises(DataError, match="truncated or corrupt"):
        build_data(_cfg(data=str(bad)))
    bad.unlink()
    big = _write_raw(tmp_path / "big.bin", np.arange(4 * BLOCK_TOKENS) % 1000, "uint16")
    with pytest.raises(DataError, match=r"token id \d+, outside the tokenizer's vocabulary of 257"):
        build_data(_cfg(data=str(big), val_fraction=0.5))
    with pytest.raises(DataError, match="tokenizer=bpe trains on text"):
        build_data(_cfg(data=str(big), tokenizer="bpe"))


def test_bin_dtype_must_hold_the_vocabulary(tmp_path):
    from tokenizers import Tokenizer as HFModel
    from tokenizers import models

    vocab = {f"w{i}": i for i in range(70_000)}
    HFModel(models.WordLevel(vocab, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    _write_raw(tmp_path / "s.bin", np.arange(4 * BLOCK_TOKENS), "uint16")
    cfg = _cfg(data=str(tmp_path / "s.bin"), tokenizer=str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match=r"stores uint16 ids .* set bin_dtype=uint32"):
        build_data(cfg)


def test_write_bin_shards_roundtrip_and_sizes(tmp_path):
    docs = [np.arange(n) for n in (5, 17, 3, 40)]
    paths = write_bin_shards(docs, tmp_path, shard_tokens=20, bin_dtype="uint32", header=True)
    assert [p.name for p in paths] == [f"shard_0000{i}.bin" for i in range(4)]
    shards = [open_shard(p, "uint16") for p in paths]  # the header overrides bin_dtype
    assert [len(s) for s in shards] == [20, 20, 20, 5] and shards[0].dtype == np.dtype("<u4")
    assert np.concatenate(shards).tolist() == np.concatenate(docs).tolist()
    with pytest.raises(DataError, match="use bin_dtype=uint32"):
        write_bin_shards([np.array([70_000])], tmp_path / "x")


def test_prepare_refuses_an_out_dir_that_cannot_be_written(tmp_path, capsys, unwritable):
    """Under a regular file, or in a folder that takes no files (``unwritable``: see
    conftest.lock_writes for how read-only is simulated): one line, exit 2."""
    (tmp_path / "a.txt").write_text("some text\n")
    (tmp_path / "file").write_text("keep")
    for out in (tmp_path / "file" / "bins", unwritable / "bins"):
        with pytest.raises(SystemExit) as exit_info:
            prepare_main([str(tmp_path / "a.txt"), str(out)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"error: OUT_DIR {out}: " in err and err.count("\n") == 1, err
    assert (tmp_path / "file").read_text() == "keep" and list(unwritable.iterdir()) == []


def test_prepare_writes_shards_that_train_like_the_text(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(_text(4000, 7))
    prepare_main([str(tmp_path / "a.txt"), str(tmp_path / "bins"), "--shard-tokens", "30000"])
    assert "wrote 3 shard(s)" in capsys.readouterr().out
    shards = sorted((tmp_path / "bins").glob("*.bin"))
    tokens = np.concatenate([open_shard(p, "uint16") for p in shards])
    assert bytes(tokens[:-1].astype(np.uint8)) == (tmp_path / "a.txt").read_bytes()
    assert tokens[-1] == 256
    bundle = build_data(
        _cfg(data=str(tmp_path / "bins"), tokenizer=str(tmp_path / "bins/tokenizer.json"))
    )
    assert bundle.tokenizer.spec == "byte" and len(bundle.val) == 3
    with pytest.raises(SystemExit, match=r"error: .*prepare needs an existing tokenizer"):
        prepare_main([str(tmp_path / "a.txt"), str(tmp_path / "x"), "--tokenizer", "bpe"])


# --- Hugging Face streaming, through load_dataset on local parquet ----------------------------


@pytest.fixture
def parquet_stream(tmp_path, monkeypatch):
    """An HFDataset source that load_dataset streams from local parquet (no network)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    files = []
    for i in range(2):
        texts = [f"doc {i}-{j}\n" + _text(20 + j % 13, 100 * i + j) for j in range(150)]
        files.append(str(tmp_path / f"part{i}.parquet"))
        pq.write_table(
            pa.table({"text": texts, "n": list(range(150))}), files[-1], row_group_size=40
        )
    return HFDataset("parquet", None, "text", tuple(files))


def test_hf_stream_batches_are_sequential_and_deterministic(parquet_stream):
    cfg = _cfg(val_fraction=0.1)
    a, b = (
        build_from_source(parquet_stream, cfg, None),
        build_from_source(parquet_stream, cfg, None),
    )
    assert a.info["source"] == "hf:parquet" and len(a.val) == 3
    first = _batches(a, 4)
    assert _same(first, _batches(b, 4)) and _same(a.val, b.val)
    rows = torch.cat(first)
    assert torch.equal(rows[:-1, -1], rows[1:, 0])  # consecutive rows continue the stream
    assert a.tokenizer.decode(rows[0]).startswith("doc 0-0\n")


def test_hf_stream_resumes_exactly_within_and_across_passes(parquet_stream):
    cfg = _cfg(val_fraction=0.1)
    make = lambda: build_from_source(parquet_stream, cfg, None)  # noqa: E731
    _resumes_exactly(make, 5, 6)
    probe = make()
    tokens_per_pass = 0
    while probe.train.state_dict()["epoch"] == 0:
        probe.train.next_batch()
        tokens_per_pass += 4 * 32
    passes = tokens_per_pass // (4 * 32)
    _resumes_exactly(make, passes - 1, 4)  # position saved near the end, restored into pass 2


def test_hf_stream_with_bpe_and_missing_field(parquet_stream, tmp_path):
    cfg = _cfg(val_fraction=0.1, tokenizer="bpe", bpe_vocab_size=300)
    bundle = build_from_source(parquet_stream, cfg, tmp_path / "run")
    assert bundle.tokenizer.vocab_size == 300 and (tmp_path / "run/tokenizer.json").is_file()
    assert bundle.train.next_batch().max() < 300
    missing = HFDataset("parquet", None, "body", parquet_stream.data_files)
    with pytest.raises(DataError, match=r"has no field 'body' \(fields: text, n\)"):
        build_from_source(missing, _cfg(), None)


def test_hf_dataset_that_cannot_load_is_a_clear_error(tmp_path):
    missing = HFDataset("parquet", None, "text", (str(tmp_path / "nothing.parquet"),))
    with pytest.raises(DataError, match="cannot stream Hugging Face dataset 'hf:parquet'"):
        build_from_source(missing, _cfg(), None)
