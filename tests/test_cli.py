"""The command line as a user meets it: the run folder it writes and the errors it gives."""

import ast
import contextlib
import importlib
import json
import re
import string
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nobubble
from nobubble.cli import build_parser, chosen_keys, main, warn_unused_settings, warnings_in_one_line
from nobubble.config import FIELDS, ConfigError, NobubbleWarning, load_toml, parse_overrides
from nobubble.configure import build_config
from nobubble.settings_read import READ_WHEN, RunFacts, UnusedSettingWarning
from tests.helpers.launcher import run_nobubble
from tests.helpers.pipeline import SMALL, env


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
    with pytest.warns(NobubbleWarning, match="non-finite loss or gradient"):
        assert train("--out", str(out), *SMALL, *diverge, "steps=20") == 2
    last = int(re.search(r"last at step (\d+)", capsys.readouterr().err).group(1))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == last and rows[-1]["skipped_stages"] == [0]


def test_schedule_command_is_wired(capsys):
    assert main(["schedule", "--schedule", "2bw", "--stages", "2", "--microbatches", "2",
                 "--steps", "2", "--json", "--no-grid"]) == 0  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    assert "bubble_fraction" in summary


# -- key=value words and flags in any order ------------------------------------------------------


def test_key_value_words_may_follow_any_flag(tmp_path):
    out = tmp_path / "run"
    assert train("steps=2", "--out", str(out), *SMALL, "lr=1e-3", "--seed", "3", "lr=2e-3") == 0
    saved = json.loads((out / "config.json").read_text())
    assert (saved["steps"], saved["lr"], saved["seed"]) == (2, 2e-3, 3)  # the later word wins


@pytest.mark.parametrize(
    ("argv", "dest", "words"),
    [
        (
            ["train", "a=1", "--out", "X", "b=2", "--seed", "1", "c=3"],
            "overrides",
            ["a=1", "b=2", "c=3"],
        ),
        (["bench", "a=1", "--stages", "2", "b=2"], "overrides", ["a=1", "b=2"]),
        (["report", "runs/a", "--out", "R", "runs/b"], "runs", ["runs/a", "runs/b"]),
    ],
)
def test_every_command_takes_its_words_before_and_after_its_flags(argv, dest, words):
    assert getattr(build_parser().parse_args(argv), dest) == words


def test_an_unknown_flag_among_key_value_words_is_still_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["train", "steps=3", "--out", "X", "lr=1e-3", "--lr-max", "1"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --lr-max 1" in capsys.readouterr().err


# -- settings the run never reads -----------------------------------------------------------------

# (settings, under torchrun, the ones that do nothing); every setting that only some runs read
# appears as unused at least once (test_the_table_covers_every_setting_only_some_runs_read)
UNUSED = [
    ({"ef_gamma": 5.0}, False, {"ef_gamma"}),
    ({"ef_gamma": 5.0, "correction": "ef+predict", "schedule": "2bw"}, False, set()),
    ({"ef_gamma": 5.0, "correction": "ef"}, False, set()),
    ({"nesterov": True}, False, {"nesterov"}),
    ({"nesterov": False, "optim": "muon"}, False, set()),
    ({"nesterov": True, "optim": "sgd", "momentum": 0.0}, False, {"nesterov"}),
    ({"moe_top_k": 2}, False, {"moe_top_k"}),
    ({"moe_top_k": 1, "preset": "cpu-moe"}, False, set()),
    ({"moe_top_k": 1, "moe_experts": 4}, False, set()),
    (
        {"preset": "cpu-moe", "moe_experts": 0, "moe_shared_experts": 1, "moe_d_ff": 32,
         "moe_layers": [0], "moe_capacity_factor": 1.5, "moe_aux_coef": 0.0, "moe_bias_rate": 0.1},
        False,
        {"moe_shared_experts", "moe_d_ff", "moe_layers", "moe_capacity_factor", "moe_aux_coef",
         "moe_bias_rate"},
    ),
    ({"beta3": 0.9}, False, {"beta3"}),
    ({"beta3": 0.9, "optim": "adan"}, False, set()),
    ({"beta1": 0.8, "beta2": 0.9, "optim": "sgd"}, False, {"beta1", "beta2"}),
    ({"beta1": 0.8, "beta2": 0.9, "optim": "muon"}, False, set()),  # its AdamW part
    ({"eps": 1e-6, "optim": "lion"}, False, {"eps"}),
    ({"momentum": 0.9}, False, {"momentum"}),
    ({"momentum": 0.9, "optim": "signum"}, False, set()),
    ({"nadam_momentum_decay": 0.004}, False, {"nadam_momentum_decay"}),
    ({"muon_adjust_lr": "original", "optim": "sgd"}, False, {"muon_adjust_lr"}),
    ({"muon_ns_dtype": "float32", "optim": "adamw"}, False, {"muon_ns_dtype"}),
    ({"muon_blocks": 1, "optim": "adamw"}, False, {"muon_blocks"}),  # more blocks: refused
    ({"muon_blocks": 2, "optim": "muon"}, False, set()),
    ({"decay_frac": 0.3}, False, {"decay_frac"}),
    ({"decay_frac": 0.3, "lr_schedule": "wsd"}, False, set()),
    ({"min_lr_ratio": 0.0, "lr_schedule": "constant"}, False, {"min_lr_ratio"}),
    ({"nesterov_gamma": 0.5, "correction": "ef"}, False, {"nesterov_gamma"}),
    ({"nesterov_gamma": 0.5, "correction": "nesterov"}, False, set()),
    ({"dc_lambda": 0.1, "dc_mean_square_decay": 0.9}, False, {"dc_lambda", "dc_mean_square_decay"}),
    ({"dc_lambda": 0.1, "dc_mean_square_decay": 0.9, "correction": "dc"}, False, set()),
    ({"chunks": 1, "schedule": "1f1b", "stages": 2, "microbatches": 2}, False, {"chunks"}),
    ({"chunks": 2, "schedule": "interleaved-1f1b", "stages": 2, "microbatches": 2}, False, set()),
    ({"zero": 1}, False, {"zero"}),  # nothing to shard over: a warning, not an error
    ({"zero": 2, "dp": 2}, False, set()),  # the one-process engine notes it (dp_note)
    ({"p2p_timeout_s": 10.0, "p2p_routes": "per-edge", "stages": 2}, False,
     {"p2p_timeout_s", "p2p_routes"}),
    ({"p2p_timeout_s": 10.0, "p2p_routes": "per-edge", "stages": 2}, True, set()),
    ({"tp": 2, "stages": 2, "schedule": "1f1b", "microbatches": 2}, False, {"tp"}),
    ({"tp": 2, "stages": 2, "schedule": "1f1b", "microbatches": 2}, True, set()),
    ({"group_timeout_s": 900.0, "p2p_warmup": False, "p2p_dtype": "float32"}, False,
     {"group_timeout_s", "p2p_warmup", "p2p_dtype"}),
    ({"group_timeout_s": 900.0, "p2p_warmup": False, "p2p_dtype": "float32", "stages": 2}, True,
     set()),
    ({"tf32": False, "device": "cpu"}, False, {"tf32"}),  # the CPU has no TF32
    ({"tf32": False, "device": "auto"}, False, set()),
    ({"emulate_nccl": True, "dist_backend": "gloo"}, False, {"emulate_nccl", "dist_backend"}),
    ({"emulate_nccl": True, "dist_backend": "gloo", "stages": 2}, True, set()),
    ({"embed_cost": 2.0, "head_cost": 0.5}, False, {"embed_cost", "head_cost"}),
    ({"embed_cost": 2.0, "head_cost": 0.5, "stages": 2, "partition": "blocks"}, False, set()),
    ({"embed_cost": 2.0, "stages": 2, "stage_layers": [3, 1]}, False, {"embed_cost"}),
    ({"head_cost": 2.0, "stages": 2}, False, {"head_cost"}),  # the default: partition=flops
    ({"partition": "blocks"}, False, {"partition"}),
    ({"partition": "blocks", "stages": 2}, False, set()),
    ({"name": "mine", "out": "runs/here"}, False, {"name"}),
    ({"name": "mine"}, False, set()),
    ({"data_field": "body"}, False, {"data_field"}),
    ({"data_field": "body", "data": "hf:org/set"}, False, set()),
    ({"data_field": "body", "data": "shards/*.bin"}, False, {"data_field"}),
    ({"bin_dtype": "uint32", "data": "books/*.txt"}, False, {"bin_dtype"}),
    ({"bin_dtype": "uint32", "data": "shards"}, False, set()),  # a folder may hold .bin shards
    ({"bpe_vocab_size": 512}, False, {"bpe_vocab_size"}),
    ({"bpe_vocab_size": 512, "tokenizer": "bpe"}, False, set()),
    ({"staleness_every": 5}, False, {"staleness_every"}),  # sync: no delay
    ({"staleness_every": 5, "schedule": "2bw"}, False, set()),
    ({"staleness_every": 5, "schedule": "2bw", "stages": 2, "microbatches": 2}, True,
     {"staleness_every"}),  # the pipeline measures the drift only
    ({"applied_error_every": 5}, False, set()),  # sync too: its error is zero, a control
    ({"applied_error_every": 5, "schedule": "2bw", "stages": 2, "microbatches": 2}, True,
     {"applied_error_every"}),
    ({"wandb_project": "p", "wandb_mode": "offline"}, False, {"wandb_project", "wandb_mode"}),
    ({"wandb_project": "p", "logger": "tensorboard,wandb"}, False, set()),
    ({"lr": 1e-3, "steps": 5, "weight_decay": 0.0, "warmup_steps": 0}, False, set()),  # read by all
]  # fmt: skip


def unused_warnings(cfg, chosen, torchrun=False) -> dict[str, str]:
    """The UnusedSettingWarning messages the command line gives, by the setting they name."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warn_unused_settings(cfg, set(chosen), torchrun)
    messages = [str(w.message) for w in seen if w.category is UnusedSettingWarning]
    return {message.split("=", 1)[0]: message for message in messages}


@pytest.mark.parametrize(("settings", "torchrun", "unused"), UNUSED)
def test_a_setting_the_run_never_reads_gets_a_warning_that_says_why(settings, torchrun, unused):
    cfg = build_config(settings)
    found = unused_warnings(cfg, settings, torchrun)
    assert set(found) == unused
    for key, message in found.items():
        when = READ_WHEN[key]
        assert message.startswith(f"{key}=") and "does nothing in this run" in message
        assert when.when in message and when.now(cfg, RunFacts(False, torchrun)) in message
    assert unused_warnings(cfg, ()) == {}  # the same values as defaults: nothing was chosen


def test_the_table_covers_every_setting_only_some_runs_read():
    conditional = set(READ_WHEN)
    assert set().union(*(unused for _, _, unused in UNUSED)) == conditional


def test_a_config_file_s_default_values_are_not_chosen_but_its_other_values_are(tmp_path):
    toml = tmp_path / "c.toml"  # as a sweep writes it: every key, most at their default
    toml.write_text("nesterov = true\nbeta3 = 0.99\nmomentum = 0.9\n")
    layers = [load_toml(toml), {"ef_gamma": 1.0}, parse_overrides(["nesterov_gamma=0.9"])]
    assert chosen_keys(layers) == {"momentum", "ef_gamma", "nesterov_gamma"}
    cfg = build_config(*layers)
    assert set(unused_warnings(cfg, chosen_keys(layers))) == {
        "momentum",
        "ef_gamma",
        "nesterov_gamma",
    }


def test_unused_settings_warn_before_the_run_and_a_resume_does_not_repeat_them(tmp_path, recwarn):
    out = tmp_path / "run"
    unused = ["--nesterov", "--ef-gamma", "5", "moe_top_k=2", "beta3=0.5"]
    assert train("--out", str(out), *SMALL, "steps=2", *unused) == 0
    named = [str(w.message).split("=")[0] for w in recwarn if w.category is UnusedSettingWarning]
    assert sorted(named) == ["beta3", "ef_gamma", "moe_top_k", "nesterov"]
    recwarn.clear()
    assert main(["train", "--no-progress", "--resume", str(out), "steps=3"]) == 0
    assert json.loads((out / "config.json").read_text())["beta3"] == 0.5  # carried over
    assert not [w for w in recwarn if w.category is UnusedSettingWarning]


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


def test_nobubble_s_warnings_are_one_line_without_python_s_source_line(tmp_path):
    """A setting that does nothing, said by the command line as it is run: one line, not
    ``cli.py:124: UnusedSettingWarning: ...`` and the code line under it."""
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "run"  # refused after the warning: nothing trains
    done = run_nobubble(["train", "--out", str(out), "zero=1"], env=env())
    assert done.returncode == 2, done.stderr
    warning, error = done.stderr.splitlines()
    assert warning.startswith("nobubble: warning: zero=1 ")
    assert error.startswith("nobubble: error: ")


def test_only_nobubble_s_own_warnings_change_their_format():
    python = warnings.formatwarning
    with warnings_in_one_line():
        ours = warnings.formatwarning("x=1 does nothing", UnusedSettingWarning, "cli.py", 1, "w()")
        theirs = warnings.formatwarning("old", DeprecationWarning, "lib.py", 7, "f()")
    assert ours == "nobubble: warning: x=1 does nothing\n"
    assert theirs == python("old", DeprecationWarning, "lib.py", 7, "f()")
    assert warnings.formatwarning is python  # as it was once the command is done


def test_every_warning_nobubble_gives_is_a_nobubble_warning():
    """The command line shows a NobubbleWarning in one line; a warning of another category
    would print in Python's format, source line and all."""
    root = Path(nobubble.__file__).parent
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "warnings.warn"):
                continue
            given = [*node.args[1:2], *(k.value for k in node.keywords if k.arg == "category")]
            where = f"{path}:{node.lineno}"
            assert given, f"{where}: warnings.warn without a category"
            category = getattr(importlib.import_module(module), ast.unparse(given[0]))
            assert issubclass(category, NobubbleWarning), where
