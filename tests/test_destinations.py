"""The one rule for output paths (nobubble.destinations): what it refuses, in one line, and that
it creates and changes nothing. Each command's own test is beside the command's other tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nobubble.config import ConfigError
from nobubble.destinations import check_output_file, check_output_folder, make_output_folder
from tests.helpers.pipeline import snapshot


def refusal(check, path: Path | str, **options) -> str:
    with pytest.raises(ConfigError) as refused:
        check(path, "--flag", **options)
    message = str(refused.value)
    assert message.startswith(f"--flag {path}") and "\n" not in message, message
    return message


@pytest.fixture
def a_file(tmp_path) -> Path:
    (tmp_path / "notes.txt").write_text("mine")
    return tmp_path / "notes.txt"


@pytest.mark.parametrize("check", [check_output_file, check_output_folder, make_output_folder])
def test_a_path_under_a_regular_file_is_refused_and_the_file_kept(tmp_path, a_file, check):
    before = snapshot(tmp_path)
    assert f"{a_file} is not a folder" in refusal(check, a_file / "deeper" / "out")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("check", [check_output_file, check_output_folder, make_output_folder])
def test_a_folder_that_takes_no_new_files_is_refused(unwritable, check):
    """``unwritable``: see conftest.lock_writes for how read-only is simulated."""
    assert f"cannot write in {unwritable}" in refusal(check, unwritable / "out")
    assert list(unwritable.iterdir()) == []


@pytest.mark.parametrize("check", [check_output_file, check_output_folder, make_output_folder])
def test_a_path_in_proc_is_refused(check):
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    assert "cannot write in /proc" in refusal(check, "/proc/nobubble-test")


def test_a_folder_is_no_file_and_a_file_no_folder(tmp_path, a_file):
    assert "give a file name" in refusal(check_output_file, tmp_path)
    assert f"{a_file} is not a folder" in refusal(check_output_folder, a_file)
    assert a_file.read_text() == "mine"


def test_a_file_goes_into_a_folder_that_exists(tmp_path):
    assert f"folder {tmp_path / 'missing'} does not exist" in refusal(
        check_output_file, tmp_path / "missing" / "out.png"
    )
    assert not (tmp_path / "missing").exists()


def test_a_name_too_long_and_a_nul_are_refused(tmp_path):
    longest = os.pathconf(tmp_path, "PC_NAME_MAX")
    for check in (check_output_file, check_output_folder):
        assert "is longer than" in refusal(check, tmp_path / ("x" * (longest + 1)))
    with pytest.raises(ConfigError, match="NUL"):
        check_output_folder(f"{tmp_path}/a\0b", "--flag")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_made_whole_needs_its_parent_to_take_files(lock_writes, tmp_path):
    """A run folder or an export is made beside its path and renamed into place: an empty
    folder that takes files, in a parent that takes none, cannot become one."""
    out = tmp_path / "parent" / "out"
    out.mkdir(parents=True)
    lock_writes(out.parent)
    check_output_folder(out, "--flag")  # filled in place: fine
    assert f"cannot write in {out.parent}" in refusal(check_output_folder, out, whole=True)


def test_what_can_be_written_passes_and_only_make_creates(tmp_path, a_file):
    check_output_file(a_file, "--flag")  # replaced when written, not by the check
    check_output_file(tmp_path / "new.png", "--flag")
    check_output_folder(tmp_path / "a" / "b", "--flag")
    check_output_folder(tmp_path / "a" / "b", "--flag", whole=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert a_file.read_text() == "mine"
    assert make_output_folder(tmp_path / "a" / "b", "--flag") == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir()


def test_a_link_is_checked_where_it_points(tmp_path, a_file):
    (tmp_path / "link").symlink_to(a_file / "run")  # dangling, and under a file
    assert f"{a_file} is not a folder" in refusal(check_output_folder, tmp_path / "link")
    (tmp_path / "made").symlink_to(tmp_path / "target")
    make_output_folder(tmp_path / "made", "--flag")
    assert (tmp_path / "target").is_dir() and (tmp_path / "made").is_symlink()
