"""Atomic, checksummed checkpoints made of one shard per pipeline stage.

Layout of ``checkpoints/step_NNNNNN``::

    manifest.json            step, shards, SHA-256 of every file (written last)
    shard_0/weights.safetensors   every weight version the shard holds, ``v{version}/{name}``
    shard_0/state.pt              optimizer (and error-feedback) state, step
    shard_0/meta.json             data position, config, anything else JSON
    shard_1/...                   (pipeline: one shard per stage; simulator: a single shard)

Shards are written into ``.tmp-step_NNNNNN``; when all are there, the manifest is written and the
folder renamed into place, so a ``step_*`` folder with a manifest is complete, and the checksums
catch corruption that happens later.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from nobubble.runfolder import write_json_atomic

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoint_step(folder: Path) -> int:
    return int(folder.name.split("_")[1])


def staging_dir(root: Path, step: int) -> Path:
    return root / f".tmp-{checkpoint_name(step)}"


def shard_name(index: int) -> str:
    return f"shard_{index}"


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def write_shard(
    staging: Path, index: int, tensors: dict[str, torch.Tensor], state: dict[str, Any], meta: dict
) -> None:
    """Write one stage's shard into the staging folder of a checkpoint."""
    folder = staging / shard_name(index)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(cpu, folder / "weights.safetensors")
    torch.save(state, folder / "state.pt")
    write_json_atomic(folder / "meta.json", meta)
    for path in folder.iterdir():
        _fsync(path)


def publish(staging: Path, final: Path, step: int, shards: int) -> Path:
    """Seal a staging folder whose ``shards`` shards are all written; rename it to ``final``."""
    files: dict[str, str] = {}
    for index in range(shards):
        folder = staging / shard_name(index)
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint of step {step}: shard {index} was not written")
        for path in sorted(folder.iterdir()):
            files[f"{folder.name}/{path.name}"] = sha256(path)
    write_json_atomic(staging / MANIFEST, {"step": step, "shards": shards, "files": files})
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    return final


def verify_checkpoint(folder: Path) -> dict:
    """Return the manifest; raise :class:`CheckpointError` unless every file matches it."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {folder} has no {MANIFEST}: it is incomplete")
    try:
        manifest = json.loads(manifest_path.read_text())
        files: dict[str, str] = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {folder} has an unreadable manifest ({exc})") from None
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {folder} is missing {name}")
        if sha256(path) != expected:
            raise CheckpointError(f"checkpoint {folder}: {name} does not match its checksum")
    return manifest


def load_shard(folder: Path, index: int) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict]:
    """(tensors, state, meta) of one shard of a checkpoint (verify the checkpoint first)."""
    shard = folder / shard_name(index)
    tensors = load_file(shard / "weights.safetensors")
    state = torch.load(shard / "state.pt", weights_only=False)
    return tensors, state, read_meta(folder, index)


def read_meta(folder: Path, index: int = 0) -> dict:
    """The JSON metadata of one shard (data position, config, tokenizer checksum, time)."""
    return json.loads((folder / shard_name(index) / "meta.json").read_text())


def newest_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The newest weight version of every parameter across all shards (for inspection/tests)."""
    manifest = verify_checkpoint(folder)
    out: dict[str, torch.Tensor] = {}
    for index in range(manifest["shards"]):
        tensors, _, _ = load_shard(folder, index)
        newest: dict[str, int] = {}
        for key in tensors:
            version, name = key.split("/", 1)
            newest[name] = max(newest.get(name, -1), int(version[1:]))
        out.update({name: tensors[f"v{v}/{name}"] for name, v in newest.items()})
    return out


def prune(root: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest complete checkpoints."""
    complete = sorted(p for p in root.glob("step_*") if (p / MANIFEST).is_file())
    for old in complete[:-keep]:
        shutil.rmtree(old)
