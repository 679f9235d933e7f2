import dataclasses
import math
import re
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nobubble.config import (
    FIELDS,
    ConfigError,
    TrainConfig,
    coerce,
    from_saved,
    load_toml,
    parse_overrides,
)
from nobubble.configure import build_config


def test_defaults_are_valid():
    """The defaults build, and building resolves chunks to the schedule's (sync: 1) and dtype
    to what auto trains in here."""
    cfg = build_config()
    here = "bfloat16" if torch.cuda.is_available() else "float32"
    assert cfg == dataclasses.replace(TrainConfig(), chunks=1, dtype=here)


def test_layers_apply_in_order():
    cfg = build_config({"lr": 1e-3, "optim": "muon"}, {"lr": 2e-3})
    assert cfg.lr == 2e-3 and cfg.optim == "muon"


def test_overrides_parse_toml_values_and_bare_strings():
    got = parse_overrides(
        ["lr=1e-3", "nesterov=true", "optim=muon", "stage_layers=[1, 3]", "out=none"]
    )
    assert got == {
        "lr": 1e-3,
        "nesterov": True,
        "optim": "muon",
        "stage_layers": [1, 3],
        "out": None,
    }
    assert parse_overrides(["batch-size=8"]) == {"batch_size": 8}


def test_toml_file_with_sections(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        'steps = 10\n[optim]\noptim = "lion"\nlr = 1e-4\n[schedule]\nschedule = "2bw"\n'
    )
    assert load_toml(path) == {"steps": 10, "optim": "lion", "lr": 1e-4, "schedule": "2bw"}


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        ({"optimm": "adamw"}, re.escape("unknown config key 'optimm' (did you mean 'optim'?)")),
        ({"optim": "adamx"}, re.escape("unknown optim 'adamx' (did you mean 'adamw'?)")),
        ({"schedule": "2bvv"}, "unknown schedule"),
        ({"preset": "huge"}, "choose one of: tiny, small"),
        ({"steps": "many"}, "steps must be a whole number"),
        ({"steps": 0}, "steps must be positive"),
        ({"lr": True}, "lr must be a number"),
        ({"nesterov": "maybe"}, "nesterov must be true or false"),
        ({"ef": "maybe"}, "ef must be true or false"),  # the old key, read (and checked) still
        ({"batch_size": 10, "microbatches": 4}, "not divisible"),
        ({"schedule": "2bw", "stages": 4, "microbatches": 2, "batch_size": 8}, "M >= P|>= stages"),
        ({"schedule": "pipedream", "stages": 2, "microbatches": 2}, "microbatches=1"),
        ({"stages": 2, "stage_layers": [4]}, "one block count per model stage"),
        ({"val_fraction": 1.5}, "val_fraction"),
        (
            {"p2p_timeout_s": 600, "group_timeout_s": 300},
            "group_timeout_s=300 is below p2p_timeout_s=600.*raise group_timeout_s",
        ),
        ({"beta1": 1.5}, "beta1 must be in"),
        (
            {"muon_ns_dtype": "float16"},
            re.escape("unknown muon_ns_dtype 'float16'")
            + ".*choose one of: auto, float32, bfloat16",
        ),
    ],
)
def test_bad_values_get_clear_errors(layer, message):
    with pytest.raises(ConfigError, match=message):
        build_config(layer)


def test_malformed_toml_is_reported_with_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("steps = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("text", "first", "second"),
    [
        ("[optimizer]\nlr = 1e-3\n[training]\nlr = 2e-3\n", "[optimizer]", "[training]"),
        ("lr = 1e-3\n[optimizer]\nlr = 2e-3\n", "the top level", "[optimizer]"),
        ("[optimizer]\nlr = 1e-3\n[model]\nd_model = 64\n[x]\nlr = 2e-3\n", "[optimizer]", "[x]"),
        ("[data]\nbatch-size = 8\nbatch_size = 16\n", "[data]", "[data]"),  # one key, two ways
    ],
)
def test_a_key_set_in_two_tables_of_a_config_file_is_refused_naming_both(
    tmp_path, text, first, second
):
    """The sections share one set of keys: the last table's value was taken silently."""
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_toml(path)
    message = str(caught.value)
    key = "lr" if "lr" in text else "batch_size"
    assert f"sets {key} in {first} and again in {second}; keep one" in message
    assert str(path) in message and "\n" not in message


def test_a_config_file_with_a_key_in_two_tables_trains_nothing(tmp_path, capsys):
    from nobubble.cli import main

    path = tmp_path / "c.toml"
    path.write_text("[optimizer]\nlr = 1e-3\n[training]\nlr = 2e-3\n")
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nobubble: error: ") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["lr"])


def test_none_only_for_optional_fields():
    assert coerce("n_layers", "none") is None
    with pytest.raises(ConfigError, match="cannot be empty"):
        coerce("steps", None)


# -- numbers: finite and within each key's accepted range ---------------------------------------

HINTS = typing.get_type_hints(TrainConfig)


def _holds(kind: type, hint: object) -> bool:
    return hint is kind or kind in typing.get_args(hint)


FLOAT_KEYS = sorted(k for k in FIELDS if _holds(float, HINTS[k]))
NUMBER_KEYS = sorted(k for k in FIELDS if _holds(float, HINTS[k]) or _holds(int, HINTS[k]))
NUMBER_KEYS += sorted(k for k in FIELDS if _holds(list[int], HINTS[k]))


@pytest.mark.parametrize(
    ("key", "value", "accepted"),
    [
        ("lr", math.nan, "positive (> 0) and finite"),
        ("lr", math.inf, "positive (> 0) and finite"),
        ("lr", -1e-3, "positive (> 0) and finite"),
        ("weight_decay", math.nan, ">= 0 and finite"),
        ("ef_gamma", math.nan, ">= 0 and finite"),
        ("eps", -1.0, "positive (> 0) and finite"),
        ("eps", 0.0, "positive (> 0) and finite"),
        ("p2p_timeout_s", math.inf, "positive (> 0) and finite"),
        ("grad_clip", -math.inf, ">= 0 and finite"),
        ("rope_theta", math.nan, "positive (> 0) and finite"),
        ("beta1", 1.0, "in [0, 1)"),  # Adam's bias correction divides by 1 - beta1^t
        ("beta2", math.nan, "in [0, 1)"),
        ("momentum", 1.0, "in [0, 1)"),
        ("val_fraction", 0.0, "in (0, 1)"),
        ("embed_cost", -1.0, ">= 0 and finite"),
        ("zero", 3, "in [0, 2]"),  # the valid values: 0, 1, 2
        ("d_model", 0, "positive (> 0)"),
        ("seed", -1, "in [0, 4294967296)"),
        ("stage_layers", [2, -1], ">= 0"),
    ],
)
def test_numbers_outside_their_range_name_key_value_and_range(key, value, accepted):
    with pytest.raises(ConfigError) as caught:
        build_config({key: value})
    message = str(caught.value)
    assert message.startswith(f"{key} must be {accepted}, got ")
    shown = value[-1] if isinstance(value, list) else value
    assert repr(shown) in message


def test_every_number_key_declares_its_accepted_range():
    missing = [k for k in NUMBER_KEYS if FIELDS[k].metadata["range"] is None]
    assert not missing, f"declare an accepted range for {missing}"
    for key in NUMBER_KEYS:  # the default lies inside it
        default = FIELDS[key].default
        for value in default if isinstance(default, list) else [default]:
            assert value is None or value in FIELDS[key].metadata["range"], key


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(FLOAT_KEYS), st.floats(allow_nan=True, allow_infinity=True))
def test_no_float_key_accepts_a_non_finite_value(key, value):
    try:
        cfg = build_config({key: value})
    except ConfigError as exc:  # a finite value may meet a check across keys instead
        if not math.isfinite(value):
            assert str(exc).startswith(f"{key} must be ") and repr(value) in str(exc)
    else:
        assert math.isfinite(getattr(cfg, key))


def test_corrections_parse_and_combine():
    from nobubble.corrections.registry import chosen

    assert chosen(build_config({})) == ()
    assert chosen(build_config({"correction": "ef"})) == ("ef",)
    for bad, message in [
        ("ef+dc", "both change the update"),
        ("ef+ef", "names a correction twice"),
        ("efx", "unknown correction 'efx'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build_config({"correction": bad})


def test_a_saved_config_without_a_key_reads_as_what_it_meant_when_saved():
    """A key's default may change (partition: blocks, then flops); a configuration saved
    before the key existed did what its saved_default says, and loads so; a key it holds, or
    one whose meaning never changed, is read as saved or as the default."""
    saved = TrainConfig().to_dict()
    assert saved["partition"] == "flops"
    del saved["partition"], saved["lr"]
    loaded = from_saved(saved)
    assert loaded["partition"] == "blocks" and loaded["lr"] == TrainConfig().lr
    assert from_saved({**saved, "partition": "flops"})["partition"] == "flops"
    assert build_config(loaded).partition == "blocks"
