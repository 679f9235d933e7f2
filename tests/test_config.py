import re

import pytest

from nobubble.config import (
    ConfigError,
    TrainConfig,
    build_config,
    coerce,
    load_toml,
    parse_overrides,
)


def test_defaults_are_valid():
    cfg = build_config()
    assert cfg == TrainConfig()


def test_layers_apply_in_order():
    cfg = build_config({"lr": 1e-3, "optim": "muon"}, {"lr": 2e-3})
    assert cfg.lr == 2e-3 and cfg.optim == "muon"


def test_overrides_parse_toml_values_and_bare_strings():
    got = parse_overrides(["lr=1e-3", "ef=true", "optim=muon", "stage_layers=[1, 3]", "out=none"])
    assert got == {"lr": 1e-3, "ef": True, "optim": "muon", "stage_layers": [1, 3], "out": None}
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
        ({"ef": "maybe"}, "ef must be true or false"),
        ({"batch_size": 10, "microbatches": 4}, "not divisible"),
        ({"schedule": "2bw", "stages": 4, "microbatches": 2, "batch_size": 8}, "M >= P|>= stages"),
        ({"schedule": "pipedream", "stages": 2, "microbatches": 2}, "microbatches=1"),
        ({"stages": 2, "stage_layers": [4]}, "one block count per stage"),
        ({"val_fraction": 1.5}, "val_fraction"),
        ({"beta1": 1.5}, "beta1 must be in"),
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


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["lr"])


def test_none_only_for_optional_fields():
    assert coerce("n_layers", "none") is None
    with pytest.raises(ConfigError, match="cannot be empty"):
        coerce("steps", None)
