"""The private parts of torch that nobubble imports, held against the installed torch.

pyproject.toml leaves torch without an upper bound (GPU users keep their own build), so a torch
release that moves one of these must fail here, naming it, rather than somewhere in a run.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.optim._muon as torch_muon

import nobubble

SOURCE = Path(nobubble.__file__).parent


def is_private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split("."))


def private_torch_imports() -> dict[str, set[str]]:
    """``{module: names}`` for every import of nobubble's source that reaches a private part of
    torch (a module or a name beginning with ``_``), wherever in a module it stands."""
    found: dict[str, set[str]] = {}
    for path in sorted(SOURCE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("torch.") and is_private(alias.name):
                        found.setdefault(alias.name, set())
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch."):
                names = {a.name for a in node.names}
                if is_private(node.module) or any(is_private(name) for name in names):
                    found.setdefault(node.module, set()).update(names)
    return found


def test_every_private_torch_name_nobubble_imports_is_in_this_torch():
    imports = private_torch_imports()
    assert "_adjust_lr" in imports["torch.optim._muon"]  # the scan sees optim/muon.py's
    moved = []
    for module, names in sorted(imports.items()):
        try:
            loaded = importlib.import_module(module)
        except ImportError as exc:
            moved.append(f"module {module} ({exc})")
            continue
        moved += [f"{module}.{name}" for name in sorted(names) if not hasattr(loaded, name)]
    assert not moved, (
        f"torch {torch.__version__} moved private names that nobubble imports: "
        f"{', '.join(moved)}; adapt the modules that import them (grep for the names in src/)"
    )


def test_torch_muon_still_means_what_nobubble_copies():
    """optim/muon.py replaces torch.optim.Muon's step with its own, from torch's constants and LR
    adjustment: they must still be the defaults of torch's Muon, with the same signature."""
    defaults = {
        name: p.default for name, p in inspect.signature(torch.optim.Muon).parameters.items()
    }
    assert defaults["ns_coefficients"] == (
        torch_muon.DEFAULT_A,
        torch_muon.DEFAULT_B,
        torch_muon.DEFAULT_C,
    )
    assert defaults["ns_steps"] == torch_muon.DEFAULT_NS_STEPS
    assert defaults["eps"] == torch_muon.EPS
    assert list(inspect.signature(torch_muon._adjust_lr).parameters) == [
        "lr",
        "adjust_lr_fn",
        "param_shape",
    ]


def test_a_torch_without_them_is_refused_at_import_naming_what_moved(monkeypatch):
    moved = types.ModuleType("torch.optim._muon")
    moved.__dict__.update({k: v for k, v in vars(torch_muon).items() if k != "_adjust_lr"})
    monkeypatch.setitem(sys.modules, "torch.optim._muon", moved)
    monkeypatch.delitem(sys.modules, "nobubble.optim.muon", raising=False)  # import it anew
    with pytest.raises(ImportError) as caught:
        importlib.import_module("nobubble.optim.muon")
    message = str(caught.value)
    assert "private names of torch.optim._muon" in message
    assert f"torch {torch.__version__} does not have" in message
    assert "_adjust_lr" in message  # Python's own words name the missing name
    assert "install the torch nobubble is tested with" in message
