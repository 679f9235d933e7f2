"""The house's one rule (docs/architecture.md): every module imports only from below it, so the
imports of nobubble, counted inside functions and under ``TYPE_CHECKING`` too, make no circle:
neither between files nor between the rooms of the plan (a top-level module, or a package as a
whole), where a circle is an arrow that runs back up a layer."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

import nobubble

SOURCE = Path(nobubble.__file__).parent


def module_names() -> dict[str, Path]:
    """Every module of nobubble by its dotted name (a package by its own)."""
    found = {}
    for path in sorted(SOURCE.rglob("*.py")):
        parts = path.relative_to(SOURCE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Which modules of nobubble each module imports, wherever in it the import stands."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                origin = ".".join(part for part in (base, node.module) if part)
                for alias in node.names:  # a submodule by name, else a name of the module
                    submodule = f"{origin}.{alias.name}"
                    found.add(submodule if submodule in modules else origin)
        graph[name] = {target for target in found if target in modules and target != name}
    return graph


def room(module: str) -> str | None:
    """The room of the plan a module stands in: ``nobubble.X``, file or package (None: the
    package's face, ``nobubble`` itself)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else None


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of ``graph``, as the nodes it passes, or None."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := walk(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


def rooms_graph(graph: dict[str, set[str]], where: Callable[[str], str | None]) -> dict:
    rooms: dict[str, set[str]] = {}
    for source, targets in graph.items():
        here = where(source)
        if here is None:
            continue
        rooms.setdefault(here, set()).update(
            there for target in targets if (there := where(target)) not in (None, here)
        )
    return rooms


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return imports(module_names())


def test_no_module_imports_one_that_imports_it(graph):
    assert circle(graph) is None


def test_no_arrow_runs_back_up_between_the_rooms(graph):
    """A package is one room: its modules may not import a room that imports any of them."""
    found = circle(rooms_graph(graph, room))
    assert found is None, " -> ".join(found)


def test_the_check_finds_an_arrow_back_up():
    toy = {"nobubble.a.x": {"nobubble.b"}, "nobubble.b": {"nobubble.a.y"}, "nobubble.a.y": set()}
    assert circle(toy) is None  # no circle of files
    assert circle(rooms_graph(toy, room)) == ["nobubble.a", "nobubble.b", "nobubble.a"]
