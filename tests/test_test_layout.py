"""The tests' own layout: shared helpers live in tests/helpers/ and fixtures in
tests/conftest.py, so no test file imports from another test file (moving or renaming one
test file then breaks no other, and an autouse fixture applies only in the file that holds it)."""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def imported_modules(source: str, path: Path) -> set[str]:
    """Every module (and name, as ``module.name``) that ``source``, the text of ``path``,
    imports; relative imports resolved against the tests package."""
    package = ["tests", *path.parent.relative_to(TESTS).parts]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def of_test_files(modules: set[str]) -> set[str]:
    """The modules that are test files: tests.test_*."""
    return {m for m in modules if m.split(".")[0] == "tests" and m[6:].startswith("test_")}


def test_no_test_file_imports_from_another_test_file():
    offenders = {
        str(path.relative_to(TESTS)): sorted(found)
        for path in sorted(TESTS.rglob("*.py"))
        if (found := of_test_files(imported_modules(path.read_text(), path)))
    }
    assert offenders == {}, "move what they share to tests/helpers/ or tests/conftest.py"


@pytest.mark.parametrize(
    "line",
    [
        "from tests.test_resume import train",
        "import tests.test_resume",
        "from tests import test_resume",
        "from .test_resume import train",
        "from . import test_resume",
    ],
)
def test_every_spelling_of_such_an_import_is_seen(line):
    assert of_test_files(imported_modules(line, TESTS / "test_example.py")) == {
        "tests.test_resume",
        *({"tests.test_resume.train"} if line.endswith("train") else ()),
    }
    from_a_helper = line.replace("from .", "from ..")
    assert of_test_files(imported_modules(from_a_helper, TESTS / "helpers" / "example.py"))


@pytest.mark.parametrize(
    "line", ["from tests.helpers.runs import train", "from .helpers import runs", "import tests"]
)
def test_imports_of_helpers_are_allowed(line):
    assert of_test_files(imported_modules(line, TESTS / "test_example.py")) == set()
