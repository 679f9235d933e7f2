"""Every file nobubble reads can be damaged without a traceback: cut short, overwritten with
garbage, JSON of another type, a folder in its place, or missing. The command that reads it either
copes (a damaged metrics line is dropped with a warning) or refuses in one line that names the
file, and a refused command changes no file.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from nobubble.cli import main
from nobubble.configure import build_config
from nobubble.data import ByteTokenizer
from nobubble.hf.convert import hf_config, hf_name, parameter_shapes
from nobubble.model.resolve import model_config
from nobubble.runfolder.reading import saved_config
from nobubble.sweeping.planned import PlannedRun, Status
from tests.helpers.pipeline import snapshot

TINY = [
    *("d_model=32", "n_layers=2", "n_heads=2", "n_kv_heads=1", "d_ff=64", "seq_len=32"),
    *("batch_size=4", "eval_batches=1", "threads=1", "warmup_steps=1"),
]


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garbage(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 4)  # not UTF-8, not JSON, not safetensors


def wrong_type(path: Path) -> None:
    path.write_text("[1, 2, 3]\n")  # valid JSON, not an object


def folder(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "inside").write_text("x")


def missing(path: Path) -> None:
    path.unlink()


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": truncate,
    "garbage": garbage,
    "wrong type": wrong_type,
    "a folder": folder,
    "missing": missing,
}


def outcome(capsys, argv: list[str]) -> tuple[int, str]:
    """Exit status and stderr of ``nobubble ARGV``; any exception is a failure of the test."""
    code = main(argv)
    err = capsys.readouterr().err
    if code:
        assert err.startswith("nobubble: error: ") and err.count("\n") == 1, err
    return code, err


# -- the run folder: train --resume, report, export, sweep ----------------------------------

CKPT = "checkpoints/step_000002"
RUN_FILES = {
    "config.json": ("resume", "report", "export", "sweep"),
    "metrics.jsonl": ("resume", "report"),
    "summary.json": ("resume", "report", "sweep"),
    "tokenizer.json": ("resume", "export"),
    f"{CKPT}/manifest.json": ("resume", "export"),
    f"{CKPT}/shard_0/state.json": ("resume", "export"),
    f"{CKPT}/shard_0/meta.json": ("resume", "export"),
    f"{CKPT}/shard_0/weights.safetensors": ("resume", "export"),
    f"{CKPT}/shard_0/state.safetensors": ("resume",),
}
# What is still accepted (the command copes), by (file, command); everything else is refused.
COPES = {
    ("metrics.jsonl", "resume"),  # damaged lines dropped with a warning; missing: a new file
    ("metrics.jsonl", "report"),  # damaged lines skipped with a warning
    ("summary.json", "resume"),  # a resumed run writes a new one; a folder is refused
}
# Damage a command does not see: (file, damage) -> the commands.
UNSEEN = {("summary.json", "missing"): ("report", "sweep")}  # an unfinished run: skipped


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 2-step run, made once; every case damages a copy."""
    run = tmp_path_factory.mktemp("base") / "run"
    assert main(["train", "--no-progress", "--out", str(run), *TINY, "steps=2"]) == 0
    return run


def read_by(command: str, run: Path, tmp: Path) -> list[str] | None:
    """The command line of ``command`` on ``run`` (None: the sweep's check, called directly)."""
    return {
        "resume": ["train", "--no-progress", "--resume", str(run), "steps=3"],
        "report": ["report", str(run), "--out", str(tmp / "report")],
        "export": ["export", str(run), str(tmp / "export")],
        "sweep": None,
    }[command]


CASES = [
    pytest.param(name, damage, command, id=f"{name.split('/')[-1]} {damage} {command}")
    for name, commands in RUN_FILES.items()
    for damage in DAMAGE
    for command in commands
    if command not in UNSEEN.get((name, damage), ())
    and not (name.endswith(".safetensors") and damage == "wrong type")  # as garbage
]


@pytest.mark.parametrize("name, damage, command", CASES)
def test_a_damaged_run_folder_file_is_one_line_and_changes_nothing(
    finished_run, tmp_path, capsys, name, damage, command
):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    DAMAGE[damage](run / name)
    argv = read_by(command, run, tmp_path)
    if argv is None:  # the sweep reads the folder to decide whether to train it
        planned = PlannedRun("", "run", run, build_config(saved_config(finished_run)), "python")
        assert planned.status() is Status.CONFLICT
        assert name in planned.conflict()
        return
    before = snapshot(run)
    code, err = outcome(capsys, argv)
    if (name, command) in COPES and damage != "a folder":
        assert code == 0
        return
    assert code == 2
    file_named = name if name in ("config.json", "metrics.jsonl", "summary.json") else ""
    checkpoint_named = "checkpoint" in err and name.startswith("checkpoints")
    assert file_named in err or checkpoint_named or "tokenizer.json" in err, err
    assert snapshot(run) == before


def test_a_resume_with_metrics_jsonl_as_a_folder_changes_no_file(finished_run, tmp_path, capsys):
    """It was refused only after config.json had been rewritten."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    folder(run / "metrics.jsonl")
    before = snapshot(run)
    code, err = outcome(capsys, ["train", "--no-progress", "--resume", str(run), "steps=3"])
    assert code == 2 and f"{run / 'metrics.jsonl'} is a folder, not a file" in err
    assert snapshot(run) == before


def test_damaged_metrics_lines_are_dropped_on_resume_with_a_warning(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (run / "metrics.jsonl").write_bytes(lines[0] + b"\xff\xfe[1]\n[1, 2]\n" + b"".join(lines[1:]))
    with pytest.warns(UserWarning, match=r"metrics.jsonl: dropping 2 damaged line"):
        assert main(["train", "--no-progress", "--resume", str(run), "steps=3"]) == 0
    kept = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept if "train_loss" in r] == [1, 2, 3]


# -- data files -------------------------------------------------------------------------------

TEXT = "To be, or not to be, that is the question. " * 300


def parquet_file(path: Path) -> None:
    rows = [TEXT[i : i + 400] for i in range(0, len(TEXT), 400)]
    pq.write_table(pa.table({"text": rows}), path, compression="snappy")


def damaged_pages(path: Path) -> None:
    """Garbage in the middle of the file: its footer (schema) still reads, its pages do not."""
    raw = bytearray(path.read_bytes())
    raw[8 : len(raw) // 3] = bytes(i % 256 for i in range(len(raw) // 3 - 8))
    path.write_bytes(bytes(raw))


DATA_CASES = {
    "txt garbage": ("a.txt", garbage),
    "txt a folder of nothing": ("a.txt", lambda p: (p.unlink(), p.mkdir())),
    "jsonl truncated": ("a.jsonl", truncate),
    "jsonl garbage": ("a.jsonl", garbage),
    "jsonl wrong type": ("a.jsonl", wrong_type),
    "parquet truncated": ("a.parquet", truncate),
    "parquet garbage": ("a.parquet", garbage),
    "parquet damaged pages": ("a.parquet", damaged_pages),
    "bin truncated": ("a.bin", lambda p: p.write_bytes(p.read_bytes()[:-1])),
    "bin empty": ("a.bin", lambda p: p.write_bytes(b"")),
    "bin garbage ids": ("a.bin", lambda p: p.write_bytes(b"\xff" * 40000)),
    "missing": ("a.txt", missing),
}


def data_file(path: Path) -> None:
    if path.suffix == ".txt":
        path.write_text(TEXT)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({"text": TEXT[i : i + 400]}) + "\n" for i in range(9)))
    elif path.suffix == ".parquet":
        parquet_file(path)
    else:
        ids = ByteTokenizer().encode(TEXT) * 3
        path.write_bytes(np.asarray(ids, dtype="<u2").tobytes())


@pytest.mark.parametrize("case", DATA_CASES)
def test_a_damaged_data_file_is_one_line_naming_it(tmp_path, capsys, case):
    name, damage = DATA_CASES[case]
    path = tmp_path / name
    data_file(path)
    damage(path)
    tokenizer = ["tokenizer=byte"] if path.suffix == ".bin" else []
    argv = ["train", "--no-progress", "--out", str(tmp_path / "run"), *TINY, "steps=1"]
    code, err = outcome(capsys, [*argv, f"data={path}", *tokenizer])
    assert code == 2 and (str(path) in err or "token id" in err or "holds no" in err), err
    assert not (tmp_path / "run").exists()


# -- files given on the command line: tokenizer, TOML configs, grid files ---------------------

GRID = '[base]\ndata = "builtin"\nsteps = 1\n[grid]\nseed = [0]\n'  # cut in half: not TOML


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("kind", ["tokenizer", "config", "grid"])
def test_a_damaged_input_file_is_one_line_naming_it(tmp_path, capsys, kind, damage):
    path = tmp_path / ("tokenizer.json" if kind == "tokenizer" else f"{kind}.toml")
    if kind == "tokenizer":
        ByteTokenizer().save(tmp_path)
    else:
        path.write_text(GRID if kind == "grid" else "lr = 0.001\n")
    DAMAGE[damage](path)
    out = ["--out", str(tmp_path / "run")]
    argv = {
        "tokenizer": ["train", "--no-progress", *out, *TINY, f"tokenizer={path}"],
        "config": ["train", "--no-progress", *out, "--config", str(path), *TINY],
        "grid": ["sweep", "--config", str(path), *out, "--dry-run"],
    }[kind]
    code, err = outcome(capsys, argv)
    assert code == 2 and str(path) in err, err
    assert not (tmp_path / "run").exists()


# -- init_from: a Hugging Face model folder ---------------------------------------------------


@pytest.fixture
def hf_folder(tmp_path) -> Path:
    """A Llama folder of TINY's shape (zeros), with the byte tokenizer."""
    mc = model_config(build_config(dict(a.split("=", 1) for a in TINY)), ByteTokenizer.vocab_size)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config(mc, eos_id=256)))
    tensors = {hf_name(n): torch.zeros(s) for n, s in parameter_shapes(mc).items()}
    save_file(tensors, folder / "model.safetensors")
    ByteTokenizer().save(folder)
    return folder


def non_finite(path: Path) -> None:
    tensors = load_file(path)
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, path)


def index_placing_a_lost_tensor(path: Path) -> None:
    """An index beside ``path`` that places one tensor more in it than it holds."""
    names = [*load_file(path), "model.lost.weight"]
    index = {"weight_map": {name: path.name for name in names}}
    (path.parent / "model.safetensors.index.json").write_text(json.dumps(index))


INIT_CASES = {
    **{f"model.safetensors {d}": ("model.safetensors", DAMAGE[d]) for d in DAMAGE},
    "model.safetensors NaN": ("model.safetensors", non_finite),
    **{f"config.json {d}": ("config.json", DAMAGE[d]) for d in DAMAGE if d != "missing"},
    "tokenizer.json garbage": ("tokenizer.json", garbage),
    "tokenizer.json truncated": ("tokenizer.json", truncate),
    "index garbage": ("model.safetensors.index.json", garbage),
    "index places a tensor a file lacks": ("model.safetensors", index_placing_a_lost_tensor),
}


@pytest.mark.parametrize("case", INIT_CASES)
def test_a_damaged_init_from_folder_is_one_line_and_leaves_no_run(
    hf_folder, tmp_path, capsys, case
):
    name, damage = INIT_CASES[case]
    damage(hf_folder / name)
    run = tmp_path / "run"
    argv = ["train", "--no-progress", "--out", str(run), *TINY, f"init_from={hf_folder}"]
    code, err = outcome(capsys, [*argv, "steps=1"])
    assert code == 2 and name in err, err
    assert not run.exists()


def test_an_undamaged_init_from_folder_trains(hf_folder, tmp_path):
    """The table's starting point is a folder that works."""
    argv = ["train", "--no-progress", "--out", str(tmp_path / "run"), *TINY]
    assert main([*argv, f"init_from={hf_folder}", "steps=1"]) == 0


SCORE_DAMAGE = {
    "truncated": '{"format": 1, "step": 2, "res',
    "garbage": bytes(range(256)),
    "wrong type": "[1, 2, 3]",
    "incomplete": '{"format": 1, "step": 2}',
    "a folder": None,
}


@pytest.mark.parametrize("damage", SCORE_DAMAGE)
def test_a_damaged_score_file_is_one_line_in_the_report(finished_run, tmp_path, capsys, damage):
    """The downstream scores `nobubble eval` keeps in the run folder, which `report` reads."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    path = run / "downstream" / "step_000002.json"
    path.parent.mkdir()
    content = SCORE_DAMAGE[damage]
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, err = outcome(capsys, ["report", str(run), "--out", str(tmp_path / "report")])
    assert code == 2 and str(path) in err, err
