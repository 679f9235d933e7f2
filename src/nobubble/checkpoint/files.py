"""Atomic, checksummed checkpoints keyed by parameter name, one shard per pipeline stage.

Layout of ``checkpoints/step_NNNNNN`` (format 2)::

    manifest.json                 format, step, shard count, the shard of every parameter,
                                  SHA-256 of every file (written last)
    shard_0/weights.safetensors   every weight version the shard holds, ``v{version}/{name}``
    shard_0/state.safetensors     optimizer and delay-correction tensors by parameter name
                                  (``optim/{name}/{key}``, ``{correction}/{name}``: ``ef/{name}``,
                                  ``nesterov/{name}``...) and the torch RNG state
    shard_0/state.json            step, the shard's parameter names, the optimizer's scalars and
                                  param-group hyperparameters by name (named_state.py)
    shard_0/meta.json             data position, config, tokenizer checksum, time so far, the
                                  metrics lines of its step
    shard_1/...                   pipeline: one shard per stage, written by the rank that holds
                                  it (replica 0 of the stage); one process: a single shard

Nothing is pickled. A shard is still written per stage (a large model is never gathered on one
rank), but everything in it is keyed by name, so a reader takes the parameters it needs from
whichever shards hold them (the manifest maps names to shards): the one-process engine reads
every shard of a pipeline checkpoint, stage 1 of two reads shards 2 and 3 of a four-stage one,
and so on.

Shards are written into ``.tmp-step_NNNNNN``; when all are there, the manifest is written and the
folder renamed into place, so a ``step_*`` folder with a manifest is complete, and the checksums
catch corruption that happens later.

Format 1 (no ``format`` in the manifest; before named checkpoints) kept the optimizer state in a
pickled ``shard_k/state.pt`` keyed by parameter position. It is still read, without unpickling
arbitrary objects (``weights_only=True``), and converted by the parameter names its param groups
carry, so old runs resume in any layout too.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file as _save_file

from nobubble.checkpoint.named_state import NamedState, decode, encode, from_state_dict
from nobubble.json_files import DamagedFile, read_json_object, write_json_atomic

MANIFEST = "manifest.json"
FORMAT = 2  # the checkpoint format this version writes (and the newest it reads)
RNG_KEY = "rng/torch"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


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


_CHECKPOINT_NAME = re.compile(r"step_\d+")


def checkpoint_folders(root: Path) -> list[Path]:
    """The ``step_N`` folders under ``root``, oldest first (other entries are not checkpoints)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _CHECKPOINT_NAME.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=checkpoint_step)


def staging_dir(root: Path, step: int) -> Path:
    return root / f".tmp-{checkpoint_name(step)}"


def shard_name(index: int) -> str:
    return f"shard_{index}"


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _weight_name(key: str) -> str:
    """The parameter name of a ``v{version}/{name}`` key."""
    return key.split("/", 1)[1]


def _weight_version(key: str) -> int:
    """The version of a ``v{version}/{name}`` key."""
    return int(key.split("/", 1)[0][1:])


def _for_safetensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, none sharing memory with another (safetensors refuses that)."""
    out, seen = {}, set()
    for key, tensor in tensors.items():
        cpu = tensor.detach().contiguous().cpu()
        if cpu.numel():
            ptr = cpu.untyped_storage().data_ptr()
            if ptr in seen:
                cpu = cpu.clone()
            seen.add(cpu.untyped_storage().data_ptr())
        out[key] = cpu
    return out


def save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' ``save_file``; an I/O error of its write (it reports one as a
    ``SafetensorError`` naming the OS error) is raised as the :class:`OSError` it is."""
    try:
        _save_file(tensors, path)
    except SafetensorError as exc:
        found = re.search(r"\(os error (\d+)\)", str(exc))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


def write_shard(
    staging: Path,
    index: int,
    weights: dict[str, torch.Tensor],
    step: int,
    optimizer: NamedState,
    rng: torch.Tensor,
    meta: dict,
) -> None:
    """Write one stage's shard into the staging folder of a checkpoint."""
    folder = staging / shard_name(index)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    save_file(_for_safetensors(weights), folder / "weights.safetensors")
    tensors, doc = encode(optimizer)
    save_file(_for_safetensors({**tensors, RNG_KEY: rng}), folder / "state.safetensors")
    params = sorted({_weight_name(key) for key in weights})
    write_json_atomic(folder / "state.json", {"step": step, "params": params, "optimizer": doc})
    write_json_atomic(folder / "meta.json", meta)
    for path in folder.iterdir():
        _fsync(path)


def publish(staging: Path, final: Path, step: int, shards: int) -> Path:
    """Seal a staging folder whose ``shards`` shards are all written; rename it to ``final``."""
    files: dict[str, str] = {}
    params: dict[str, int] = {}
    for index in range(shards):
        folder = staging / shard_name(index)
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint of step {step}: shard {index} was not written")
        for path in sorted(folder.iterdir()):
            files[f"{folder.name}/{path.name}"] = sha256(path)
        for name in json.loads((folder / "state.json").read_text())["params"]:
            params.setdefault(name, index)  # a tied copy held by two stages: the first one
    manifest = {"format": FORMAT, "step": step, "shards": shards, "params": params, "files": files}
    write_json_atomic(staging / MANIFEST, manifest)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    return final


def _manifest_problem(manifest: dict) -> str | None:
    """What is wrong with the structure of a manifest (None: nothing)."""
    files, shards = manifest.get("files"), manifest.get("shards")
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in files.items()
    ):
        return "no file checksums"
    if any(Path(name).is_absolute() or ".." in Path(name).parts for name in files):
        return "a file outside the checkpoint"
    if not isinstance(manifest.get("step"), int) or not isinstance(shards, int) or shards < 1:
        return "no step or shard count"
    if manifest.get("format", 1) != 1 and not isinstance(manifest.get("params"), dict):
        return "no parameter index"
    return None


def verify_checkpoint(folder: Path) -> dict:
    """Return the manifest; raise :class:`CheckpointError` unless every file matches it."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {folder} has no {MANIFEST}: it is incomplete")
    try:
        manifest = read_json_object(manifest_path, "")
    except DamagedFile as exc:
        raise CheckpointError(f"checkpoint {folder} has a damaged manifest ({exc})") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"checkpoint {folder} has a damaged manifest: it names {problem}")
    files: dict[str, str] = manifest["files"]
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {folder} is missing {name}")
        if sha256(path) != expected:
            raise CheckpointError(f"checkpoint {folder}: {name} does not match its checksum")
    return manifest


def check_format(folder: Path, manifest: dict) -> int:
    """The format of a checkpoint; a :class:`CheckpointError` if this version cannot read it."""
    fmt = manifest.get("format", 1)
    if not isinstance(fmt, int) or not 1 <= fmt <= FORMAT:
        raise CheckpointError(
            f"checkpoint {folder} has format {fmt!r}, and this nobubble reads formats 1 to "
            f"{FORMAT}: it was written by a newer nobubble; upgrade nobubble to continue the run"
        )
    return fmt


@dataclass
class Loaded:
    """What a process needs from a checkpoint to continue: its parameters' share of it."""

    step: int
    weights: dict[str, torch.Tensor]  # every version held, ``v{version}/{name}``
    optimizer: NamedState


class CheckpointReader:
    """Reads a checkpoint by parameter name, from however many shards it has."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._format1: dict[int, dict[str, Any]] = {}
        self.manifest = json.loads((folder / MANIFEST).read_text())
        self.format = check_format(folder, self.manifest)
        self.shards: int = self.manifest["shards"]
        self.step: int = self.manifest["step"]
        self.index: dict[str, int] = (
            self.manifest["params"] if self.format >= 2 else self._index_from_weights()
        )

    def shard(self, index: int) -> Path:
        return self.folder / shard_name(index)

    def _index_from_weights(self) -> dict[str, int]:
        """Format 1 has no index in its manifest: read the names from the safetensors headers."""
        index: dict[str, int] = {}
        for shard in range(self.shards):
            with safe_open(self.shard(shard) / "weights.safetensors", "pt") as fh:
                for key in fh.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    index.setdefault(_weight_name(key), shard)
        return index

    def by_shard(self, names: Collection[str]) -> dict[int, set[str]]:
        """The shards that hold ``names``, each with the names taken from it."""
        missing = sorted(set(names) - self.index.keys())
        if missing:
            raise CheckpointError(
                f"checkpoint {self.folder} holds no {missing[0]} ({len(missing)} parameter(s) of "
                "this model missing): it was saved for another model"
            )
        out: dict[int, set[str]] = {}
        for name in names:
            out.setdefault(self.index[name], set()).add(name)
        return dict(sorted(out.items()))

    def weights(
        self, names: Collection[str], versions: Collection[int] | None = None
    ) -> dict[str, torch.Tensor]:
        """The saved versions (every one, or those in ``versions``) of the parameters ``names``,
        as ``v{version}/{name}``."""
        out: dict[str, torch.Tensor] = {}
        for shard, mine in self.by_shard(names).items():
            with safe_open(self.shard(shard) / "weights.safetensors", "pt") as fh:
                for key in fh.keys():  # noqa: SIM118
                    if _weight_name(key) in mine and (
                        versions is None or _weight_version(key) in versions
                    ):
                        out[key] = fh.get_tensor(key)
        return out

    def versions(self) -> dict[str, list[int]]:
        """The weight versions saved of every parameter, read from the safetensors headers."""
        held: dict[str, list[int]] = {}
        for shard, mine in self.by_shard(self.index).items():
            with safe_open(self.shard(shard) / "weights.safetensors", "pt") as fh:
                for key in fh.keys():  # noqa: SIM118
                    if _weight_name(key) in mine:
                        held.setdefault(_weight_name(key), []).append(_weight_version(key))
        return {name: sorted(versions) for name, versions in held.items()}

    def optimizer(self, names: Collection[str]) -> NamedState:
        """The optimizer (and error-feedback) state of the parameters ``names``."""
        parts = []
        for shard, mine in self.by_shard(names).items():
            if self.format == 1:
                sd = self._format1_state(shard)["engine"]["optimizer"]
                parts.append(from_state_dict(sd).select(mine))
                continue
            doc = json.loads((self.shard(shard) / "state.json").read_text())["optimizer"]
            with safe_open(self.shard(shard) / "state.safetensors", "pt") as fh:
                parts.append(decode(doc, fh.get_tensor, mine))
        return NamedState.merge(parts)

    def rng(self, shard: int) -> torch.Tensor:
        """The torch RNG state saved with ``shard`` (shard 0 if there are fewer shards)."""
        shard = shard if shard < self.shards else 0
        if self.format == 1:
            return self._format1_state(shard)["torch_rng"]
        with safe_open(self.shard(shard) / "state.safetensors", "pt") as fh:
            return fh.get_tensor(RNG_KEY)

    def _format1_state(self, shard: int) -> dict[str, Any]:
        if shard in self._format1:
            return self._format1[shard]
        path = self.shard(shard) / "state.pt"
        try:
            # weights_only=True: tensors and plain containers only, no arbitrary objects
            self._format1[shard] = torch.load(path, weights_only=True)
            return self._format1[shard]
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"{path} (checkpoint format 1, before checkpoints were keyed by name) holds "
                f"objects nobubble will not unpickle ({exc}); continue the run with the nobubble "
                "version that wrote it, or start it over"
            ) from None

    def load(self, names: Collection[str] | None = None, complete: bool = False) -> Loaded:
        """Weights and optimizer state of ``names`` (default: every parameter). ``complete``:
        the caller holds the whole model, so parameters it does not know are an error too."""
        wanted = set(self.index) if names is None else set(names)
        extra = sorted(self.index.keys() - wanted)
        if complete and extra:
            raise CheckpointError(
                f"checkpoint {self.folder} holds {extra[0]} ({len(extra)} parameter(s) this "
                "model does not have): it was saved for another model"
            )
        return Loaded(self.step, self.weights(wanted), self.optimizer(wanted))


def read_meta(folder: Path, index: int = 0) -> dict:
    """The JSON metadata of one shard (data position, config, tokenizer checksum, time)."""
    return json.loads((folder / shard_name(index) / "meta.json").read_text())


def newest_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The newest weight version of every parameter, from all shards (for inspection/tests)."""
    verify_checkpoint(folder)
    reader = CheckpointReader(folder)
    tensors = reader.weights(reader.index)
    newest: dict[str, int] = {}
    for key in tensors:
        version, name = key.split("/", 1)
        newest[name] = max(newest.get(name, -1), int(version[1:]))
    return {name: tensors[f"v{v}/{name}"] for name, v in newest.items()}


def prune(root: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest complete checkpoints."""
    complete = [p for p in checkpoint_folders(root) if (p / MANIFEST).is_file()]
    for old in complete[:-keep]:
        shutil.rmtree(old)
