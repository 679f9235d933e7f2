"""The command line as a user meets it: the run folder it writes and the errors it gives."""

import contextlib
import json
import re
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nobubble.cli import main
from nobubble.config import FIELDS, ConfigError, load_toml, parse_overrides
from nobubble.configure import build_config
from tests.pipeline_helpers import SMALL


def train(*args: str) -> int:
    return main(["train", "--no-progress", *args])


def test_a_run_folder_holds_what_the_docs_promise(tmp_path):
    out = tmp_path / "run"
    assert train("--out", str(out), *SMALL, "steps=4", "eval_every=2") == 0
    assert json.loads((out / "config.json").read_text())["steps"] == 4
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert {"step", "train_loss", "lr", "grad_norm", "tokens", "tokens_per_s"} <= set(rows[1])
    assert {"val_loss", "val_bpb"} <= set(rows[0]) and {"val_loss", "val_bpb"} <= set(rows[4])
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "final_val_loss",
        "final_val_bpb",
        "tokens_per_s",
        "wall_s",
        "steps",
        "peak_mem_mb",
    ):
        assert key in summary
    assert summary["final_val_loss"] == rows[4]["val_loss"] and summary["steps"] == 4
    assert (out / "tokenizer.json").is_file()
    assert (out / "checkpoints" / "step_000004" / "manifest.json").is_file()


def test_bits_per_byte_follow_from_the_loss_for_the_byte_tokenizer(tmp_path):
    out = tmp_path / "run"
    assert train("--out", str(out), *SMALL, "steps=2") == 0
    summary = json.loads((out / "summary.json").read_text())
    # byte tokens are bytes, except <eos> (0 bytes); so bpb ≈ loss/ln 2 up to the few <eos>
    assert summary["final_val_bpb"] == pytest.approx(summary["final_val_loss"] / 0.6931, rel=0.02)


def test_flags_overrides_and_config_files_layer_in_order(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('optim = "lion"\nweight_decay = 0.2\nsteps = 3\n')
    out = tmp_path / "run"
    args = ["--config", str(toml), "--weight-decay", "0.05", "--out", str(out), *SMALL, "steps=2"]
    assert train(*args) == 0
    saved = json.loads((out / "config.json").read_text())
    assert (saved["optim"], saved["weight_decay"], saved["steps"]) == ("lion", 0.05, 2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["preset=huge"], "unknown preset 'huge'"),
        (["--optim", "adamx"], "unknown optim 'adamx' (did you mean 'adamw'?)"),
        (["schedule=2bvv"], "unknown schedule '2bvv'"),
        (["lerning_rate=1"], "unknown config key 'lerning_rate'"),
        (["data=/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
        (["seq_len=4096"], "exceeds the model's max_seq_len"),
        (["stages=4", "schedule=2bw", "microbatches=2", "batch_size=8"], ">= stages"),
        (["batch_size=10", "microbatches=4"], "not divisible"),
        (["stages=9"], "cannot split 4 blocks over 9 stages"),
        (["steps=-1"], "steps must be positive"),
    ],
)
def test_bad_input_gets_one_clear_line_and_leaves_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    assert train("--out", str(out), *SMALL, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("nobubble: error: ") and message in err
    assert "Traceback" not in err
    assert not out.exists()


def test_a_non_finite_abort_records_the_step_that_aborted(tmp_path, capsys):
    out = tmp_path / "run"
    diverge = ["lr=1e30", "grad_clip=0", "warmup_steps=0", "nonfinite_patience=3", "log_every=50"]
    with pytest.warns(RuntimeWarning, match="non-finite loss or gradient"):
        assert train("--out", str(out), *SMALL, *diverge, "steps=20") == 2
    last = int(re.search(r"last at step (\d+)", capsys.readouterr().err).group(1))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == last and rows[-1]["skipped_stages"] == [0]


def test_schedule_command_is_wired(capsys):
    assert main(["schedule", "--schedule", "2bw", "--stages", "2", "--microbatches", "2",
                 "--steps", "2", "--json", "--no-grid"]) == 0  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    assert "bubble_fraction" in summary


# -- property-based: whatever a user types, the answer is a config or a ConfigError ------------

keys = st.one_of(st.sampled_from(sorted(FIELDS)), st.text(string.ascii_letters + "_-", max_size=12))
values = st.one_of(
    st.text(max_size=12),
    st.integers(-(10**6), 10**6).map(str),
    st.floats(allow_nan=True).map(repr),
    st.sampled_from(["true", "false", "none", "[1, 2]", "[]", "'x'", '"adamw"', "{a=1}"]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(keys, values), max_size=4))
def test_any_key_value_overrides_give_a_config_or_a_config_error(pairs):
    with contextlib.suppress(ConfigError):
        build_config(parse_overrides(f"{k}={v}" for k, v in pairs))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_any_toml_file_gives_a_config_or_a_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("toml") / "c.toml"
    path.write_text(text)
    with contextlib.suppress(ConfigError):
        build_config(load_toml(path))
