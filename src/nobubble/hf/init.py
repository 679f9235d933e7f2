"""``init_from=PATH``: a new run starts from the weights of a Hugging Face Llama checkpoint.

``PATH`` is a local folder as ``save_pretrained`` (or ``huggingface-cli download``) leaves it:
``config.json`` and ``model.safetensors``, or shards listed by ``model.safetensors.index.json``.
:func:`check_init_from` compares it with the run's model and tokenizer up front and refuses any
difference with the settings that remove it; :func:`load_init_from` then gives every process the
weights of its own parameters only, read lazily from the safetensors files (a pipeline stage
never holds the rest of the model). The optimizer starts fresh, as in any new run. A resumed run
continues from its checkpoint, whatever ``init_from`` says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer as HFTokenizerModel

from nobubble.config import ConfigError, TrainConfig
from nobubble.data.errors import DataError
from nobubble.data.tokenizer import TOKENIZER_FILE, Tokenizer
from nobubble.engine import Engine
from nobubble.hf.convert import (
    CONFIG,
    Mismatch,
    describe,
    differences,
    hf_name,
    parameter_shapes,
)
from nobubble.json_files import read_json_object
from nobubble.model.presets import ModelConfig

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
HUB_HINT = (
    "to start from a Hugging Face Hub model, download it first (`huggingface-cli download NAME "
    "--local-dir DIR`) and pass init_from=DIR"
)


def init_source(cfg: TrainConfig, checkpoint: Path | None) -> Path | None:
    """The folder a run starts from: ``cfg.init_from`` for a new run; None for a run that
    continues from ``checkpoint`` (or has no ``init_from``)."""
    if checkpoint is not None or not cfg.init_from:
        return None
    return Path(cfg.init_from)


def init_note(source: Path | None) -> str:
    """What the run-folder line adds for a run that starts from ``source``."""
    return f" (weights from init_from={source})" if source else ""


@contextlib.contextmanager
def _opened(path: Path, where: str) -> Iterator[Any]:
    """``safe_open(path)``, with a damaged file (cut short, overwritten, unreadable) as one
    :class:`ConfigError` that names it."""
    try:
        with safe_open(path, "pt") as fh:
            yield fh
    except (SafetensorError, OSError) as exc:
        raise ConfigError(
            f"{where}: {path} is damaged or cannot be read ({exc}); download the model again"
        ) from None


class HFCheckpoint:
    """A local Hugging Face checkpoint folder: its config and where each tensor is stored."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        where = f"init_from={folder}"
        if not folder.is_dir():
            raise ConfigError(
                f"{where} is not a folder; give a local checkpoint folder ({HUB_HINT})"
            )
        config_path = folder / CONFIG
        if not config_path.exists():
            raise ConfigError(
                f"{where} has no {CONFIG}: it is not a Hugging Face model folder ({HUB_HINT})"
            )
        fix = "download the model again"
        self.config: dict[str, Any] = read_json_object(config_path, fix)
        self.files = self._locate(where)

    def _locate(self, where: str) -> dict[str, Path]:
        """HF tensor name -> the safetensors file that holds it."""
        index = self.folder / INDEX
        if index.is_file():
            weight_map = read_json_object(index, "download the model again").get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                isinstance(file, str) for file in weight_map.values()
            ):
                raise ConfigError(
                    f"{index} is damaged (no weight_map of tensor names to files); download the "
                    "model again"
                )
            files = {name: self.folder / file for name, file in weight_map.items()}
            for path in sorted(set(files.values())):
                if not path.is_file():
                    raise ConfigError(f"{where}: {index.name} lists {path.name}, which is missing")
            return files
        single = self.folder / SINGLE
        if single.is_file():
            with _opened(single, where) as fh:
                return {name: single for name in fh.keys()}  # noqa: SIM118
        if any(self.folder.glob("*.bin")):
            raise ConfigError(
                f"{where} holds pickled PyTorch weights (*.bin), which nobubble does not read "
                "(unpickling can run arbitrary code); convert them to safetensors with "
                "transformers: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR)"
            )
        raise ConfigError(f"{where} holds no {SINGLE} and no {INDEX}: no weights to start from")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the safetensors headers (no tensor is read)."""
        out: dict[str, tuple[int, ...]] = {}
        for path, names in self._by_file(self.files).items():
            with _opened(path, f"init_from={self.folder}") as fh:
                held = set(fh.keys())
                lost = sorted(set(names) - held)
                if lost:
                    raise ConfigError(
                        f"init_from={self.folder}: {path.name} lacks {lost[0]}, which the index "
                        "places there; download the model again"
                    )
                out.update({name: tuple(fh.get_slice(name).get_shape()) for name in names})
        return out

    def read(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` and no others."""
        out: dict[str, torch.Tensor] = {}
        for path, mine in self._by_file(names).items():
            with _opened(path, f"init_from={self.folder}") as fh:
                out.update({name: fh.get_tensor(name) for name in mine})
        return out

    def _by_file(self, names: Collection[str]) -> dict[Path, list[str]]:
        grouped: dict[Path, list[str]] = {}
        for name in names:
            grouped.setdefault(self.files[name], []).append(name)
        return grouped


def _vocabulary(json_text: str, source: str) -> dict[str, int]:
    try:
        return HFTokenizerModel.from_str(json_text).get_vocab(with_added_tokens=True)
    except Exception as exc:  # the Rust loader raises a bare Exception
        raise DataError(
            f"{source} is not a valid Hugging Face tokenizer.json ({exc}); download the model again"
        ) from None


def _file_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path} ({exc}); download the model again") from None


def tokenizer_mismatches(
    ckpt: HFCheckpoint, mc: ModelConfig, tokenizer: Tokenizer
) -> list[Mismatch]:
    """The run's tokenizer against the checkpoint's vocabulary: its size and, where the folder
    carries a ``tokenizer.json``, every token's id (the run's may add tokens after them)."""
    theirs_file = ckpt.folder / TOKENIZER_FILE
    use_theirs = f"tokenizer={theirs_file}"
    out = []
    same_tokens = True
    if theirs_file.is_file():
        ours = _vocabulary(tokenizer.to_json(), f"the run's tokenizer {tokenizer.spec}")
        theirs = _vocabulary(_file_text(theirs_file), str(theirs_file))
        same_tokens = all(ours.get(token) == index for token, index in theirs.items())
        if not same_tokens:
            why = "token ids would stand for other tokens than the checkpoint was trained on"
            out.append(Mismatch("tokenizer", theirs_file.name, tokenizer.spec, use_theirs, why))
    vocab = ckpt.config.get("vocab_size")
    if vocab != mc.vocab_size:
        why = "the model's vocabulary is the preset's, else the tokenizer's rounded up to 64"
        if not theirs_file.is_file():
            fix = "tokenizer=PATH/tokenizer.json"
            why += "; PATH/tokenizer.json: the tokenizer the checkpoint was trained with"
        else:
            # the run's tokens are the checkpoint's: only the embedding's row count differs
            fix = f"vocab_size={vocab}" if same_tokens else use_theirs
        out.append(Mismatch("vocab_size", vocab, mc.vocab_size, fix, why))
    return out


def check_init_from(folder: Path, mc: ModelConfig, tokenizer: Tokenizer) -> None:
    """Refuse (:class:`ConfigError`) a checkpoint whose architecture, vocabulary or tensors are
    not those of the model ``mc`` trained with ``tokenizer``; the message lists every difference
    and the settings that remove them."""
    ckpt = HFCheckpoint(folder)
    mismatches = differences(ckpt.config, mc) + tokenizer_mismatches(ckpt, mc, tokenizer)
    if mismatches:
        raise ConfigError(
            f"init_from={folder} does not fit the model: {describe(mismatches, ckpt.config)}"
        )
    expected = {hf_name(name): shape for name, shape in parameter_shapes(mc).items()}
    held = ckpt.shapes()
    missing = sorted(expected.keys() - held.keys())
    if missing:
        raise ConfigError(
            f"init_from={folder} lacks {missing[0]} ({len(missing)} of the {len(expected)} "
            "tensors of this Llama missing): the checkpoint is incomplete"
        )
    ignored = {"lm_head.weight"} if mc.tie_embeddings else set()  # a tied head may be saved too
    extra = sorted(
        name
        for name in held.keys() - expected.keys() - ignored
        if not name.endswith("rotary_emb.inv_freq")  # a buffer older checkpoints saved
    )
    if extra:
        raise ConfigError(
            f"init_from={folder} holds {extra[0]} ({len(extra)} tensor(s) a plain Llama has no "
            "place for): it is not a LlamaForCausalLM checkpoint nobubble can train"
        )
    for name, shape in expected.items():
        if held[name] != shape:
            raise ConfigError(
                f"init_from={folder} holds {name} of shape {held[name]}, and its config.json "
                f"gives {shape}: the checkpoint contradicts its own config"
            )


def load_init_from(engine: Engine, folder: Path) -> None:
    """Set the step-0 weights of this process's parameters to the checkpoint's (checked with
    :func:`check_init_from` first); the optimizer state stays the fresh one."""
    if engine.step != 0:
        raise RuntimeError("init_from applies to a new run, before its first step")
    ckpt = HFCheckpoint(folder)
    own = engine.checkpoint_tensors()  # v0/{name} of every parameter this process holds
    wanted = {key: hf_name(key.split("/", 1)[1]) for key in own}
    tensors = ckpt.read(set(wanted.values()))
    weights = {}
    for key, current in own.items():
        tensor = tensors[wanted[key]]
        if tensor.shape != current.shape:
            raise ConfigError(
                f"init_from={folder}: {wanted[key]} has shape {tuple(tensor.shape)}, the model "
                f"needs {tuple(current.shape)}"
            )
        if not torch.isfinite(tensor).all():
            raise ConfigError(
                f"init_from={folder}: {wanted[key]} in {ckpt.files[wanted[key]].name} holds "
                "non-finite values (NaN or inf): the file is damaged, or the model diverged; "
                "download the model again"
            )
        weights[key] = tensor.to(current.dtype)
    engine.restore(weights, engine.checkpoint_state())
