"""The defaults of a GPU run (bfloat16 autocast, TF32, expandable segments) and what stays as it
was on the CPU; and every torch.distributed name nobubble uses exists in the installed torch."""

import ast
import dataclasses
import importlib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import nobubble
from nobubble.cli import main
from nobubble.config import TrainConfig
from nobubble.config.parse import from_saved
from nobubble.configure import build_config, resolve_config
from nobubble.device import ALLOC_CONF, configure_cuda, configure_torch
from nobubble.model.presets import PRESETS
from nobubble.one_process import OneProcessEngine
from nobubble.reporting.runs import result_settings
from nobubble.run.summary import summary_line
from nobubble.runfolder.resume import resumed_config
from nobubble.settings_read import RunFacts, unused_settings
from nobubble.stage_options import autocast, compute_dtype, precision
from tests.helpers.pipeline import SMALL

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


def test_dtype_auto_is_bfloat16_on_cuda_and_float32_elsewhere():
    assert TrainConfig().dtype == "auto"
    assert compute_dtype("auto", CUDA) == "bfloat16"
    assert compute_dtype("auto", CPU) == "float32"
    for chosen in ("float32", "bfloat16"):  # a choice is kept on either device
        assert compute_dtype(chosen, CUDA) == chosen == compute_dtype(chosen, CPU)


def test_a_run_saved_before_auto_loads_as_float32():
    assert from_saved({})["dtype"] == "float32"
    assert from_saved({"dtype": "bfloat16"})["dtype"] == "bfloat16"


def test_auto_on_the_cpu_autocasts_nothing():
    with autocast(CPU, "auto"):
        assert not torch.is_autocast_enabled("cpu")
    with autocast(CPU, "bfloat16"):
        assert torch.is_autocast_enabled("cpu")


MC = dataclasses.replace(
    PRESETS["tiny"], d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64
)


def train_on_the_cpu(**settings) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = resolve_config(TrainConfig(batch_size=4, seq_len=16, steps=2, warmup_steps=1, **settings))
    configure_torch(cfg)
    engine = OneProcessEngine(cfg, MC, CPU)
    gen = torch.Generator().manual_seed(0)
    batches = iter([torch.randint(0, 64, (4, 17), generator=gen) for _ in range(2)])
    losses = []
    engine.run_steps(2, lambda: next(batches), lambda stats: losses.append(stats.loss))
    return losses, engine.named_weights()


def test_the_defaults_leave_a_cpu_run_bitwise_as_float32_without_tf32(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    before = torch.get_float32_matmul_precision()
    losses, weights = train_on_the_cpu()  # dtype=auto, tf32=true
    assert torch.get_float32_matmul_precision() == before  # no TF32 asked of oneDNN either
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    losses_f32, weights_f32 = train_on_the_cpu(dtype="float32", tf32=False)
    assert losses == losses_f32
    for name, weight in weights_f32.items():
        assert torch.equal(weights[name], weight), name


@pytest.fixture
def matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def test_cuda_gets_expandable_segments_and_tf32(matmul_precision):
    environ: dict[str, str] = {}
    configure_cuda(TrainConfig(), environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": ALLOC_CONF}
    assert torch.get_float32_matmul_precision() == "high"


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_users_allocator_settings_win(name, matmul_precision):
    environ = {name: "max_split_size_mb:128"}
    configure_cuda(TrainConfig(tf32=False), environ)
    assert environ == {name: "max_split_size_mb:128"}
    assert torch.get_float32_matmul_precision() == "highest"  # tf32=false: torch's default


def test_the_closing_line_of_a_cuda_run_says_its_precision():
    assert precision(TrainConfig(), CUDA) == "bfloat16 autocast, TF32 float32 matmuls"
    assert precision(TrainConfig(dtype="float32", tf32=False), CUDA) == (
        "float32, float32 matmuls without TF32"
    )
    summary = {
        "steps": 3,
        "wall_s": 2.0,
        "final_val_loss": 1.0,
        "final_val_bpb": 1.0,
        "tokens_per_s": 10.0,
        "mfu": 0.4,
        "precision": precision(TrainConfig(), CUDA),
    }
    line = summary_line(summary, Path("/runs/a"), 1, MC)
    assert "MFU 40.0% in bfloat16 autocast, TF32 float32 matmuls |" in line
    del summary["precision"]  # a CPU run's summary has none: its line is as it was
    assert "MFU 40.0% |" in summary_line(summary, Path("/runs/a"), 1, MC)


def test_tf32_on_the_cpu_is_named_as_unused():
    cfg = build_config({"tf32": False, "device": "cpu"})
    facts = RunFacts(moe=False, torchrun=False)
    assert "device=cpu" in unused_settings(cfg, ["tf32"], facts)["tf32"]
    assert unused_settings(build_config({"tf32": False}), ["tf32"], facts) == {}


# -- the torch.distributed names nobubble calls -------------------------------------------------


def distributed_names() -> dict[str, set[str]]:
    """Every dotted name under torch.distributed that nobubble's source uses (``dist.isend``,
    ``dist.group.WORLD``, ``from torch.distributed.device_mesh import init_device_mesh``), with
    the files that use it: the one list of what the oldest allowed torch must have."""
    used: dict[str, set[str]] = {}
    root = Path(nobubble.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for name in _names_in(ast.parse(path.read_text())):
            used.setdefault(name, set()).add(str(path.relative_to(root)))
    return used


def _names_in(tree: ast.AST) -> set[str]:
    aliases = {
        alias.asname or alias.name: alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name.startswith("torch.distributed")
    }
    imported = {
        alias.asname or alias.name: f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed")
        for alias in node.names
    }
    names, aliases = set(imported.values()), aliases | imported
    for node in ast.walk(tree):
        chain = _dotted(node) if isinstance(node, ast.Attribute) else None
        if chain and chain[0] in aliases:
            names.add(".".join([aliases[chain[0]], *chain[1:]]))
    return names


def _dotted(node: ast.Attribute) -> list[str] | None:
    parts = [node.attr]
    while isinstance(node.value, ast.Attribute):
        node = node.value
        parts.append(node.attr)
    return [node.value.id, *reversed(parts)] if isinstance(node.value, ast.Name) else None


def resolves(name: str) -> bool:
    """Whether ``name`` (a module, or an attribute chain below one) exists."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(found, attr):
                return False
            found = getattr(found, attr)
        return True
    return False


def test_every_torch_distributed_name_nobubble_uses_exists_in_this_torch():
    """Run by CI on every torch it installs, the oldest that pyproject allows included: a
    collective newer than that torch fails here, not on a GPU cluster."""
    used = distributed_names()
    # the scan finds what the pipeline is built on (if it found nothing, it would pass anything)
    core = ("isend", "irecv", "all_reduce", "new_group", "barrier", "init_process_group")
    assert {f"torch.distributed.{name}" for name in core} <= used.keys()
    if not dist.is_nccl_available():  # a CPU build has no NCCL classes: a CUDA build's CI checks
        used = {name: files for name, files in used.items() if "NCCL" not in name.upper()}
    missing = {name: files for name, files in used.items() if not resolves(name)}
    assert not missing, f"torch {torch.__version__} lacks: {missing}"


def test_a_configuration_holds_dtype_auto_resolved(monkeypatch):
    """config.json says what a run trains in: auto is resolved when the configuration is built,
    by the device setting (a named device is not checked for here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert build_config({}).dtype == "float32"
    assert build_config({"device": "cuda"}).dtype == "bfloat16"
    assert build_config({"dtype": "bfloat16"}).dtype == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert build_config({}).dtype == "bfloat16"
    assert build_config({"device": "cpu"}).dtype == "float32"


def test_a_resume_on_a_gpu_keeps_the_dtype_a_cpu_run_trained_in(tmp_path, monkeypatch):
    out = tmp_path / "run"
    assert main(["train", "--no-progress", "--out", str(out), *SMALL, "steps=1"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the same folder, on a GPU
    assert resumed_config(out, {"steps": 2}).dtype == "float32"
    # a folder saved while auto was kept unresolved (it re-resolved on every resume) still resumes
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**saved, "dtype": "auto"}))
    assert resumed_config(out, {"steps": 2}).dtype == "bfloat16"


def test_a_run_saved_with_auto_is_the_run_a_grid_plans_with_its_resolution():
    """The sweep finds a run done and the report groups it with its repeats whether its folder
    says auto (saved unresolved) or what auto resolved to on this machine."""
    on_this_machine = build_config({}).to_dict()
    assert result_settings({**on_this_machine, "dtype": "auto"}) == result_settings(on_this_machine)
    other = "bfloat16" if on_this_machine["dtype"] == "float32" else "float32"
    assert result_settings({**on_this_machine, "dtype": other}) != result_settings(on_this_machine)
