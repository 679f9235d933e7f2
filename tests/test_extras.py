"""Optional extras: nobubble and its default path run without them, and each feature that needs
one names the extra to install (nobubble.config.extras)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import matplotlib.figure
import pytest

from nobubble.cli import main
from nobubble.config.extras import EXTRAS, MissingExtra, require
from tests.helpers.pipeline import SMALL, env
from tests.helpers.runs import make_run

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


def hide(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make ``import package`` and its submodules fail, as if it were not installed (a loaded
    submodule would otherwise still be found in sys.modules)."""
    loaded = [name for name in sys.modules if name == package or name.startswith(f"{package}.")]
    for name in {package, *loaded}:
        monkeypatch.setitem(sys.modules, name, None)


def test_each_optional_package_is_an_extra_and_not_a_core_dependency():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    core = " ".join(project["dependencies"])
    for distribution, extra in EXTRAS.values():
        assert any(r.startswith(distribution) for r in project["optional-dependencies"][extra])
        assert distribution not in core


# nobubble imported with every optional package hidden, each of its modules, then a short run of
# the default path (`make train`'s: the built-in corpus, adamw, the one-process engine)
CORE_PATH = """
import importlib, pkgutil, sys
for name in {hidden!r}:
    sys.modules[name] = None
import nobubble
for module in pkgutil.walk_packages(nobubble.__path__, "nobubble."):
    if not module.name.endswith(".__main__"):  # running a command is not importing it
        importlib.import_module(module.name)
from nobubble.cli import main
sys.exit(main({argv!r}))
"""


def test_nobubble_and_its_default_path_run_without_any_optional_package(tmp_path):
    argv = ["train", "--no-progress", "--out", str(tmp_path / "run"), *SMALL, "steps=2"]
    script = CORE_PATH.format(hidden=sorted(EXTRAS), argv=argv)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "nobubble: done: 2 steps" in done.stderr + done.stdout
    assert (tmp_path / "run" / "summary.json").is_file()


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], package: str) -> str:
    """``nobubble ARGV``'s error line, having checked that it names ``package``'s extra."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    distribution, extra = EXTRAS[package]
    assert f"needs the optional package {distribution} (" in err
    assert f"install it with: pip install 'nobubble[{extra}]'" in err
    return err


@pytest.mark.parametrize(
    ("package", "setting"),
    [
        ("pytorch_optimizer", "optim=lion"),
        ("datasets", "data=hf:someone/corpus"),
        ("tensorboard", "logger=tensorboard"),
        ("wandb", "logger=wandb"),
    ],
)
def test_a_training_setting_whose_package_is_missing_is_refused_before_anything_is_written(
    tmp_path, monkeypatch, capsys, package, setting
):
    hide(monkeypatch, package)
    out = tmp_path / "run"
    err = refused(capsys, ["train", "--out", str(out), *SMALL, "steps=1", setting], package)
    assert f"nobubble: error: {setting} needs" in err
    assert not out.exists()


def test_a_parquet_file_without_pyarrow_names_the_parquet_extra(tmp_path, monkeypatch, capsys):
    hide(monkeypatch, "pyarrow")
    data = tmp_path / "corpus.parquet"
    data.write_bytes(b"PAR1")  # never read: the import fails first
    argv = ["train", "--out", str(tmp_path / "run"), *SMALL, "steps=1", f"data={data}"]
    assert f"reading {data} needs" in refused(capsys, argv, "pyarrow")


def test_the_pngs_without_matplotlib_name_the_plots_extra(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    for seed in (0, 1):
        make_run(runs, 2.0 + seed / 10, seed=seed)
    hide(monkeypatch, "matplotlib")
    shape = ["--schedule", "2bw", "--stages", "2", "--microbatches", "2", "--steps", "1"]
    schedule = ["schedule", *shape, "--png", str(tmp_path / "s.png")]
    assert "a PNG timeline (--png) needs" in refused(capsys, schedule, "matplotlib")
    plan = ["plan", "--preset", "small", "--grid", "2", "--png", str(tmp_path / "g.png")]
    assert "plan --grid --png needs" in refused(capsys, plan, "matplotlib")
    report = ["report", str(runs), "--out", str(tmp_path / "report")]
    assert "drawing the report's figures needs" in refused(capsys, report, "matplotlib")


@pytest.mark.parametrize("package", ["lm_eval", "transformers"])
def test_nobubble_eval_without_lm_eval_or_transformers_names_the_eval_extra(
    tmp_path, monkeypatch, capsys, package
):
    run = make_run(tmp_path, 2.0, name_as="run")
    hide(monkeypatch, package)
    argv = ["eval", str(run), "--tasks", "hellaswag"]
    assert "nobubble eval needs" in refused(capsys, argv, package)
    assert not (run / "downstream").exists()


def test_require_gives_the_module_or_says_which_extra_brings_it():
    assert require("matplotlib.figure", "a test") is matplotlib.figure
    with pytest.raises(MissingExtra, match="install it with"):
        require("pyarrow.no_such_module", "a test")
