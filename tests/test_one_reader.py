"""A run folder's files are named and opened in its package alone (``nobubble.runfolder``: the one
reader, :mod:`nobubble.runfolder.reading`, with the damaged-file handling): any other module that
spells one of their names is reading or writing the folder by hand."""

import ast
from pathlib import Path

from nobubble.runfolder.folder import CHECKPOINTS, CONFIG, METRICS, SUMMARY

SOURCE = Path(__file__).resolve().parents[1] / "src" / "nobubble"
NAMES = (CONFIG, METRICS, SUMMARY, CHECKPOINTS)
# Modules allowed a name, and why.
ALLOWED = {
    # a Hugging Face model folder's config.json (read by init_from, written by the export), not
    # the run's
    "hf/convert.py": {CONFIG},
}


def spelled_names(path: Path) -> list[str]:
    """``FILE:LINE NAME`` for every string in ``path`` (not a docstring) that is a run-folder
    file's name or a path ending in one."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
            continue
        if id(node) in docstrings:
            continue
        for name in NAMES:
            if node.value == name or node.value.endswith(f"/{name}"):
                found.append(f"{path.name}:{node.lineno} {name}")
    return found


def test_only_the_run_folder_package_names_its_files():
    spelled = []
    for path in sorted(SOURCE.rglob("*.py")):
        module = path.relative_to(SOURCE).as_posix()
        if module.startswith("runfolder/"):
            continue
        allowed = ALLOWED.get(module, set())
        spelled += [f"{module}: {s}" for s in spelled_names(path) if s.split()[-1] not in allowed]
    assert not spelled, (
        f"{spelled}: these modules open a run folder's files by hand; read them with "
        "nobubble.runfolder.reading (saved_config, read_summary, read_metrics, checkpoints, ...), "
        "which handles damaged files, or name them through RunFolder"
    )


def test_the_scan_sees_a_name_spelled_by_hand(tmp_path):
    """The scan itself: a path built with the name, or ending in it, is caught; a message or a
    docstring that mentions it is not."""
    source = tmp_path / "by_hand.py"
    source.write_text(
        '"""Reads summary.json."""\n'
        "def f(run):\n"
        '    """summary.json"""\n'
        '    a = run / "summary.json"\n'
        '    b = f"{run}/metrics.jsonl"\n'
        '    raise ValueError(f"{run} has no config.json")\n'
    )
    assert spelled_names(source) == ["by_hand.py:4 summary.json", "by_hand.py:5 metrics.jsonl"]
