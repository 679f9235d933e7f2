"""A run's checkpoint as a Hugging Face ``LlamaForCausalLM`` folder (``nobubble export``).

What is written (see docs/export.md)::

    model.safetensors        the weights under Llama names, float32 (no lm_head when tied)
    config.json              LlamaForCausalLM, the shape of the run's model
    generation_config.json   end-of-text token
    tokenizer.json           the run's tokenizer, as trained with
    tokenizer_config.json    so that ``AutoTokenizer`` loads it as a fast tokenizer
    nobubble.json            where it came from: run folder, checkpoint, step, weight version

Weight versions: ``v{N}`` of a checkpoint are the weights after N optimizer updates. Every
checkpoint of step t holds ``v{t}``, the newest (what the run continues from and what its
evaluation at step t used); 2bw also holds ``v{t-1}``, the stashed version the next step's
gradient is computed at, and pipedream holds ``v{t-d}``..``v{t}`` on a stage of delay d. Any
version that every parameter holds can be exported.

The folder is written into a hidden sibling and renamed into place when complete: ``OUT`` is
either absent or a whole export. An ``OUT`` that holds anything is refused, never replaced.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizerModel

from nobubble import __version__
from nobubble.checkpoint.files import (
    CheckpointError,
    CheckpointReader,
    checkpoint_name,
    read_meta,
    verify_checkpoint,
)
from nobubble.config import ConfigError
from nobubble.data.tokenizer import TOKENIZER_FILE, load_tokenizer
from nobubble.hf.convert import CONFIG, hf_config, hf_name, parameter_shapes
from nobubble.json_files import write_json_atomic
from nobubble.model.presets import ModelConfig
from nobubble.model.resolve import model_config
from nobubble.runfolder.folder import RunFolder, holds_files
from nobubble.runfolder.reading import (
    checkpoint_config,
    checkpoints,
    latest_valid_checkpoint,
    saved_config,
    tokenizer_digest,
    tokenizer_path,
)

Version = int | Literal["newest"]
WEIGHTS = "model.safetensors"
PROVENANCE = "nobubble.json"


def unexportable(mc: ModelConfig) -> str | None:
    """Why the export cannot write a run of the model ``mc``, or None if it can."""
    if mc.moe_experts:
        return (
            "a mixture-of-experts model, and the export writes the Hugging Face Llama format, "
            "which holds dense models only"
        )
    return None


def export_hf(
    run_dir: Path, out: Path, *, step: int | None = None, version: Version = "newest"
) -> Path:
    """Write the weights of ``run_dir``'s checkpoint (its newest valid one, or that of
    ``step``) at weight ``version`` (``"newest"`` or a version number every parameter holds)
    as a Hugging Face Llama folder ``out``; return ``out``.

    Raises :class:`ConfigError` (not a run folder, ``out`` not empty, no such step or version)
    or :class:`CheckpointError` (no complete checkpoint, weights that do not fit the config).
    """
    run_dir, out = Path(run_dir), Path(out)
    if out.exists() and (not out.is_dir() or holds_files(out)):
        raise ConfigError(
            f"{out} already exists and is not an empty folder; nothing was written. Export into "
            "a new folder (or remove this one first)"
        )
    saved_config(run_dir)  # a clear error if run_dir is no run folder
    checkpoint = find_checkpoint(run_dir, step)
    meta = read_meta(checkpoint)
    cfg = checkpoint_config(run_dir, meta)
    if meta.get("tokenizer_sha256") not in (None, tokenizer_digest(run_dir)):
        raise CheckpointError(
            f"{tokenizer_path(run_dir)} is not the tokenizer {checkpoint.name} was trained with; "
            "restore the run's original tokenizer.json"
        )
    tokenizer = load_tokenizer(run_dir)
    mc = model_config(cfg, tokenizer.vocab_size)
    why_not = unexportable(mc)
    if why_not:
        raise ConfigError(f"{run_dir} trained {why_not}; nothing was written (docs/moe.md)")
    reader = CheckpointReader(checkpoint)
    chosen = resolve_version(reader, version, checkpoint)
    weights = _version_weights(reader, chosen)
    _check_shapes(weights, mc, checkpoint)
    provenance = {
        "run": str(run_dir.resolve()),
        "checkpoint": checkpoint.name,
        "step": reader.step,
        "version": chosen,
        "newest_version": reader.step,
        "schedule": cfg.schedule,
        "nobubble": __version__,
    }
    eos = HFTokenizerModel.from_file(str(run_dir / TOKENIZER_FILE)).id_to_token(tokenizer.eos_id)

    def write(folder: Path) -> None:
        hf_weights = {hf_name(name): t.contiguous() for name, t in sorted(weights.items())}
        save_file(hf_weights, folder / WEIGHTS, metadata={"format": "pt"})
        write_json_atomic(folder / CONFIG, hf_config(mc, tokenizer.eos_id))
        write_json_atomic(
            folder / "generation_config.json",
            {"bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id},
        )
        shutil.copyfile(run_dir / TOKENIZER_FILE, folder / TOKENIZER_FILE)
        write_json_atomic(
            folder / "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": eos,
                "model_max_length": mc.max_seq_len,
                "clean_up_tokenization_spaces": False,
            },
        )
        write_json_atomic(folder / PROVENANCE, provenance)

    return _publish(out, write)


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The verified checkpoint of ``step`` in ``run_dir``, or its newest valid one."""
    steps = [p.name for p in checkpoints(run_dir)]
    if step is None:
        found = latest_valid_checkpoint(run_dir) if steps else None
        if found is None:
            why = f"{len(steps)} failed verification" if steps else "it has none"
            raise CheckpointError(
                f"{run_dir} holds no complete checkpoint to export ({why}); a run saves one at "
                "its end and every checkpoint_every steps"
            )
        return found[0]
    folder = RunFolder(run_dir).checkpoints / checkpoint_name(step)
    if not folder.is_dir():
        held = ", ".join(str(int(name.split("_")[1])) for name in steps) or "none"
        raise ConfigError(
            f"{run_dir} has no checkpoint of step {step} (steps with one: {held}); pick one of "
            "those, or drop --step for the newest"
        )
    verify_checkpoint(folder)
    return folder


def resolve_version(reader: CheckpointReader, version: Version, checkpoint: Path) -> int:
    """The version number ``version`` stands for, if every parameter holds it."""
    held = reader.versions()
    common = sorted(set.intersection(*(set(v) for v in held.values())))
    if version == "newest":
        return common[-1]
    if not isinstance(version, int) or version not in common:
        some = sorted({v for versions in held.values() for v in versions} - set(common))
        partly = f", and some parameters also {_listed(some)}" if some else ""
        raise ConfigError(
            f"checkpoint {checkpoint.name} holds weight version(s) {_listed(common)} of every "
            f"parameter{partly}; version {version!r} is not one that every parameter holds "
            "(version N: the weights after N updates; 'newest' is the default)"
        )
    return version


def _listed(versions: list[int]) -> str:
    return ", ".join(map(str, versions))


def _version_weights(reader: CheckpointReader, version: int) -> dict[str, torch.Tensor]:
    """``version`` of every parameter, by name."""
    tensors = reader.weights(reader.index, versions={version})
    return {key.split("/", 1)[1]: tensor for key, tensor in tensors.items()}


def _check_shapes(weights: dict[str, torch.Tensor], mc: ModelConfig, checkpoint: Path) -> None:
    expected = parameter_shapes(mc)
    if weights.keys() != expected.keys():
        odd = sorted(weights.keys() ^ expected.keys())
        raise CheckpointError(
            f"checkpoint {checkpoint} and the run's config disagree on the parameters (e.g. "
            f"{odd[0]}): the config does not describe these weights"
        )
    for name, tensor in weights.items():
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"checkpoint {checkpoint} holds {name} of shape {tuple(tensor.shape)}, the run's "
                f"config gives {expected[name]}: the config does not describe these weights"
            )


def _publish(out: Path, write) -> Path:
    """Run ``write(folder)`` on a hidden sibling of ``out``, then rename it to ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    umask = os.umask(0)
    os.umask(umask)
    try:
        write(staging)
        for path in staging.iterdir():
            os.chmod(path, 0o666 & ~umask)  # safetensors writes 0600, mkdtemp makes 0700
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(staging, 0o777 & ~umask)
        os.rename(staging, out)  # replaces an empty folder, never one that holds anything
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if out.exists() and holds_files(out):
            raise ConfigError(f"{out} was filled while exporting; nothing was written") from None
        raise CheckpointError(f"cannot write the export {out}: {exc}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def provenance(out: Path) -> dict:
    """What ``nobubble.json`` of an export says about its source."""
    return json.loads((out / PROVENANCE).read_text())
