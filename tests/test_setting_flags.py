"""A setting is one flag in every command: made from its field (nobubble.config.flags), with
train's name, help and range, and each rule on it said once, in the same words everywhere."""

from __future__ import annotations

import argparse
import re

import pytest

from nobubble.cli import build_parser, main
from nobubble.config import FIELDS, ConfigError, Range, zero_problem
from nobubble.config.flags import (
    SettingFlag,
    SettingSwitch,
    SettingValue,
    add_setting_flags,
    flag_of,
    section_of,
)
from nobubble.config.parallel import ParallelSettings
from nobubble.configure import build_config
from nobubble.schedules.registry import schedule_spec

COMMANDS: dict[str, argparse.ArgumentParser] = build_parser()._subparsers._group_actions[0].choices

GPU_CHECK_STEPS = ("plan", "row", "compare", "table")
# a command's option whose name is a setting's but which is another thing, and why
NOT_THE_SETTING = {
    ("sweep", "out"): "the sweep's root folder, not a run folder",
    ("report", "out"): "the report's folder",
    ("export", "out"): "the exported model's folder",
    ("eval", "batch_size"): "lm-evaluation-harness's sequences per forward pass, or auto",
    ("eval", "device"): "any torch device the harness evaluates on (cuda:1)",
    ("bench", "warmup_steps"): "steps left out of tokens/s, not the learning rate's warm-up",
    **{(f"gpu-check {step}", "out"): "the GPU check's folder" for step in GPU_CHECK_STEPS},
    **{(f"gpu-check {step}", "name"): "a run of the check's plan" for step in ("row", "compare")},
}


def options(name: str, parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    """Every (command, option) of ``parser``, its subcommands' too (``a b`` for b of a)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                found += options(f"{name} {sub}", subparser)
        else:
            found.append((name, action))
    return found


def setting_options() -> list[tuple[str, argparse.Action]]:
    """Every (command, option) whose dest names a setting of the configuration."""
    return [
        (name, action)
        for command, parser in COMMANDS.items()
        for name, action in options(command, parser)
        if action.dest in FIELDS
    ]


def test_no_command_declares_a_setting_by_hand():
    by_hand = [
        f"{name} {action.option_strings or action.dest}"
        for name, action in setting_options()
        if (name, action.dest) not in NOT_THE_SETTING
        and not isinstance(action, SettingFlag | SettingSwitch)
    ]
    assert by_hand == []
    listed = {(name, action.dest) for name, action in setting_options()}
    assert NOT_THE_SETTING.keys() <= listed  # the list names no option that has gone


def test_a_settings_flag_has_trains_name_and_help_everywhere():
    for name, action in setting_options():
        if (name, action.dest) in NOT_THE_SETTING:
            continue
        field = FIELDS[action.dest]
        assert action.option_strings[0] == flag_of(action.dest), (name, action.dest)
        assert action.help.startswith(field.metadata["help"] + " ("), (name, action.dest)
        if isinstance(action.type, SettingValue):  # a command's range lies within the field's
            own = field.metadata["range"]
            assert own is None or action.type.accepted.within(own), (name, action.dest)


def test_the_stage_and_microbatch_flags_are_settings_in_every_command_that_takes_them():
    takes = {
        name
        for name, action in setting_options()
        if action.dest in ("stages", "microbatches") and isinstance(action, SettingFlag)
    }
    assert takes >= {"train", "schedule", "plan", "bench"}


def test_a_command_range_or_words_outside_the_fields_are_refused_where_declared():
    parser = argparse.ArgumentParser()
    with pytest.raises(ValueError, match="must lie within the field's"):
        add_setting_flags(parser, ["zero"], limits={"zero": Range(0, 3, high_open=False)})
    with pytest.raises(ValueError, match="must be among"):
        add_setting_flags(parser, ["device"], limits={"device": ("cpu", "tpu")})


def test_a_section_is_built_from_the_flags_named_as_its_fields():
    parser = argparse.ArgumentParser()
    add_setting_flags(parser, ["stages", "dp", "zero"], defaults={"stages": 4})
    parallel = section_of(ParallelSettings, parser.parse_args(["--dp", "2", "--zero", "1"]))
    assert (parallel.stages, parallel.dp, parallel.zero) == (4, 2, 1)
    assert parallel.microbatches == ParallelSettings().microbatches  # no flag: its default


@pytest.mark.parametrize("command", ["schedule", "plan", "bench"])
@pytest.mark.parametrize(("flag", "wrong"), [("--stages", "0"), ("--microbatches", "-2")])
def test_a_count_out_of_the_fields_range_is_refused_in_every_command(capsys, command, flag, wrong):
    with pytest.raises(SystemExit):
        main([command, flag, wrong])
    err = capsys.readouterr().err
    assert err.startswith(f"nobubble {command}: error: argument {flag}: must be ")
    assert f"got {wrong}" in err


# -- each rule once, the same words in every command --------------------------------------------


@pytest.fixture
def no_bench_runs(monkeypatch) -> None:
    def launched(*args: object) -> None:
        raise AssertionError("a benchmark run was started")

    monkeypatch.setattr("nobubble.bench.cli.run_timed", launched)


def test_sharded_state_without_replicas_is_refused_alike_by_the_planner_and_the_bench(
    capsys, no_bench_runs
):
    rule = zero_problem(ParallelSettings(dp=1, zero=1))
    assert rule and "dp" in rule  # the one statement of the rule (config/checks.py)
    assert zero_problem(ParallelSettings(dp=2, zero=1)) is None
    assert zero_problem(ParallelSettings(dp=1, zero=0)) is None
    assert main(["plan", "--zero", "1"]) == 2
    assert capsys.readouterr().err == f"nobubble: error: {rule}\n"
    assert main(["bench", "--quick", "--zero", "1"]) == 2
    assert capsys.readouterr().err == f"nobubble bench: error: {rule}\n"


def test_the_schedules_rules_on_chunks_and_microbatches_read_alike_in_every_command(capsys):
    """The rules are the schedule's (schedules/registry.py); train refuses, schedule refuses,
    the planner says why it predicts no such shape, each in the rule's words."""
    chunks = schedule_spec("interleaved-1f1b").chunk_problem(1)
    microbatches = schedule_spec("2bw").microbatch_problem(4, 2)
    assert chunks and microbatches
    with pytest.raises(ConfigError, match=re.escape(chunks)):
        build_config({"schedule": "interleaved-1f1b", "chunks": 1, "stages": 2})
    with pytest.raises(ConfigError, match=re.escape(microbatches)):
        build_config({"schedule": "2bw", "stages": 4, "microbatches": 2, "batch_size": 8})
    for argv, rule in (
        (["--schedule", "interleaved-1f1b", "--chunks", "1"], chunks),
        (["--schedule", "2bw", "--stages", "4", "--microbatches", "2"], microbatches),
    ):
        assert main(["schedule", *argv, "--steps", "1", "--no-grid"]) == 2
        assert rule in capsys.readouterr().err
    tiny = ["plan", "--preset", "tiny", "--seq-len", "64"]
    assert main([*tiny, "--stages", "2", "--chunks", "1"]) == 0
    assert f"interleaved-1f1b: not predicted: {chunks}" in capsys.readouterr().out
    assert main([*tiny, "--stages", "4", "--microbatches", "2"]) == 0
    assert f"2bw: not predicted: {microbatches}" in capsys.readouterr().out
