"""Training configuration: one flat dataclass, TOML files, ``key=value`` overrides, validation.

Precedence (lowest to highest): field defaults, ``--config FILE.toml``, command-line flags,
``key=value`` overrides. Every error names the offending key or value and how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nobubble.schedules.registry import SCHEDULES as PIPELINE_SCHEDULES
from nobubble.schedules.registry import schedule_spec

SYNC = "sync"  # no pipeline schedule: plain gradient accumulation (the pipeline runs it as 1f1b)
SCHEDULES = (SYNC, *PIPELINE_SCHEDULES)
SYNC_SCHEDULES = (SYNC, *(name for name, spec in PIPELINE_SCHEDULES.items() if spec.flushes))
LR_SCHEDULES = ("cosine", "wsd", "constant")
DTYPES = ("float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
P2P_ROUTES = ("auto", "shared", "per-edge")  # nobubble.pipeline.routes
LOGGERS = ("tensorboard", "wandb")
# Delay corrections: what each one does lives in nobubble.corrections; here only the names and
# which act on the update (at most one of those) rather than on the weights a step runs at.
UPDATE_CORRECTIONS = ("ef", "nesterov", "spike", "dc")
CORRECTIONS = (*UPDATE_CORRECTIONS, "predict")


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message says how."""


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: ``low`` to ``high``, each bound open or closed."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = True

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            if self.low == 0 and self.low_open:
                return "positive (> 0)"
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        opening, closing = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {opening}{_number(self.low)}, {_number(self.high)}{closing}"


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
FRACTION = Range(0, 1, high_open=False)  # [0, 1]
MAX_THREADS = 1024  # threads=: more than any machine's cores (the OS would refuse the threads)
DECAY = Range(0, 1)  # [0, 1): a decay of 1 never forgets (and Adam divides by 1 - beta^t)


class UnusedSettingWarning(UserWarning):
    """A setting the user gave that the run never reads (:func:`unused_settings`)."""


@dataclass(frozen=True)
class RunFacts:
    """What decides whether some settings are read, besides the config itself."""

    moe: bool  # the model has mixture-of-experts blocks (a preset's, or moe_experts > 0)
    torchrun: bool  # the pipeline runtime runs it (a process per stage), not the one process


@dataclass(frozen=True)
class ReadWhen:
    """The condition under which a run reads a setting that not every run reads."""

    when: str  # the condition in words: "it is read only when ..."
    holds: Callable[[TrainConfig, RunFacts], bool]
    now: Callable[[TrainConfig, RunFacts], str]  # what this run has instead


def _opt(
    default: Any, help: str, range: Range | None = None, read_when: ReadWhen | None = None
) -> Any:
    """A config field; every numeric field gives ``range``, which :func:`validate` enforces;
    a field that only some runs read says which in ``read_when`` (:func:`unused_settings`)."""
    return field(default=default, metadata={"help": help, "range": range, "read_when": read_when})


def _optim(*names: str) -> ReadWhen:
    return ReadWhen(
        f"optim is {' or '.join(names)}",
        lambda cfg, _: cfg.optim in names,
        lambda cfg, _: f"optim={cfg.optim}",
    )


def _correction(name: str) -> ReadWhen:
    return ReadWhen(
        f"correction includes {name}",
        lambda cfg, _: name in chosen_corrections(cfg),
        lambda cfg, _: f"correction={cfg.correction}",
    )


def _lr_schedule(*names: str) -> ReadWhen:
    return ReadWhen(
        f"lr_schedule is {' or '.join(names)}",
        lambda cfg, _: cfg.lr_schedule in names,
        lambda cfg, _: f"lr_schedule={cfg.lr_schedule}",
    )


def _data_is(kinds: str, suffixes: tuple[str, ...], hf: bool) -> ReadWhen:
    """Read for data of these file suffixes (and ``hf:`` datasets if ``hf``); said to be unread
    only for data that surely is none of them (a folder or glob of other files is not)."""

    def holds(cfg: TrainConfig, _: RunFacts) -> bool:
        if cfg.data == "builtin":
            return False
        if cfg.data.startswith("hf:"):
            return hf
        others = tuple(s for s in (".txt", ".jsonl", ".parquet", ".bin") if s not in suffixes)
        return not cfg.data.endswith(others)

    return ReadWhen(f"data is {kinds}", holds, lambda cfg, _: f"data={cfg.data}")


_MOE = ReadWhen(
    "the model has mixture-of-experts blocks (moe_experts > 0, or a MoE preset)",
    lambda _, facts: facts.moe,
    lambda cfg, _: (
        "a dense model"
        + (" (moe_experts=0)" if cfg.moe_experts == 0 else f" (preset {cfg.preset} has no experts)")
    ),
)
_TORCHRUN = ReadWhen(
    "the pipeline runs under torchrun (a process per stage)",
    lambda _, facts: facts.torchrun,
    lambda *_: "one process (the single-process engine)",
)
_WANDB = ReadWhen(
    "logger includes wandb",
    lambda cfg, _: "wandb" in chosen_loggers(cfg),
    lambda cfg, _: f"logger={cfg.logger}",
)
_INTERLEAVED = ReadWhen(
    "the schedule is interleaved (interleaved-1f1b)",
    lambda cfg, _: cfg.schedule != SYNC and schedule_spec(cfg.schedule).interleaved,
    lambda cfg, _: f"schedule={cfg.schedule}",
)
_BALANCED_SPLIT = ReadWhen(
    "the blocks are split over several model stages by cost (stage_layers not given)",
    lambda cfg, _: cfg.stage_layers is None and cfg.model_stages() > 1,
    lambda cfg, _: f"stage_layers={cfg.stage_layers}" if cfg.stage_layers else "one model stage",
)
_NESTEROV = ReadWhen(
    "optim is muon, or sgd with momentum > 0",
    lambda cfg, _: cfg.optim == "muon" or (cfg.optim == "sgd" and cfg.momentum > 0),
    lambda cfg, _: f"optim={cfg.optim}" + (" with momentum=0" if cfg.optim == "sgd" else ""),
)
_NO_OUT = ReadWhen(
    "out is not given (it names the default folder runs/<name>-<time>)",
    lambda cfg, _: cfg.out is None,
    lambda cfg, _: f"out={cfg.out}",
)
_ADAM_BETAS = _optim("adamw", "nadamw", "muon", "lion", "adan", "soap", "mars")  # muon: AdamW part


@dataclass
class TrainConfig:
    # --- model ---
    preset: str = _opt("tiny", "model preset (see `nobubble.model.PRESETS`)")
    n_layers: int | None = _opt(None, "override the preset's number of blocks", POSITIVE)
    d_model: int | None = _opt(None, "override the preset's hidden size", POSITIVE)
    n_heads: int | None = _opt(None, "override the preset's attention heads", POSITIVE)
    n_kv_heads: int | None = _opt(None, "override the preset's key/value heads (GQA)", POSITIVE)
    d_ff: int | None = _opt(None, "override the preset's MLP hidden size", POSITIVE)
    max_seq_len: int | None = _opt(None, "override the preset's maximum sequence length", POSITIVE)
    tie_embeddings: bool | None = _opt(None, "override whether the head shares the embedding")
    rope_theta: float | None = _opt(None, "override the preset's RoPE base", POSITIVE)
    norm_eps: float | None = _opt(None, "override the RMSNorm epsilon (default 1e-5)", POSITIVE)
    moe_experts: int | None = _opt(
        None, "routed experts of each MoE block (0: dense model; docs/moe.md)", NON_NEGATIVE
    )
    moe_top_k: int | None = _opt(None, "experts each token is routed to", POSITIVE, read_when=_MOE)
    moe_shared_experts: int | None = _opt(
        None,
        "shared experts every token passes through, besides its routed ones",
        NON_NEGATIVE,
        read_when=_MOE,
    )
    moe_d_ff: int | None = _opt(
        None, "each expert's hidden size (default d_ff)", POSITIVE, read_when=_MOE
    )
    moe_layers: list[int] | None = _opt(
        None,
        "the blocks that are MoE, e.g. [1, 2, 3] (default: every block)",
        NON_NEGATIVE,
        read_when=_MOE,
    )
    moe_capacity_factor: float | None = _opt(
        None,
        "an expert takes at most this factor times its even share of a microbatch's "
        "assignments, dropping the rest (0: dropless, the default)",
        NON_NEGATIVE,
        read_when=_MOE,
    )
    moe_aux_coef: float | None = _opt(
        None,
        "coefficient of the load-balancing auxiliary loss (default 0.01)",
        NON_NEGATIVE,
        read_when=_MOE,
    )
    moe_bias_rate: float | None = _opt(
        None,
        "auxiliary-loss-free balancing: the per-step update of the routing bias (DeepSeek-V3 "
        "used 0.001; default 0, off)",
        NON_NEGATIVE,
        read_when=_MOE,
    )
    vocab_size: int | None = _opt(
        None,
        "override the vocabulary size (default: the preset's, else the tokenizer's rounded up to "
        "64); at least the tokenizer's",
        POSITIVE,
    )
    init_from: str | None = _opt(
        None,
        "start from the weights of a local Hugging Face Llama checkpoint folder (config.json + "
        "safetensors); the shape must match the model's (see docs/export.md)",
    )
    activation_checkpointing: bool = _opt(
        False, "recompute each block's activations in the backward instead of keeping them"
    )
    compile: bool = _opt(False, "torch.compile each stage (see docs/training.md for parity)")

    # --- data ---
    data: str = _opt(
        "builtin", "builtin | FILE/GLOB (.txt .jsonl .parquet .bin) | hf:NAME[:CONFIG]"
    )
    data_field: str = _opt(
        "text",
        "text field of .jsonl/.parquet/HF records",
        read_when=_data_is(".jsonl, .parquet or hf:NAME", (".jsonl", ".parquet"), hf=True),
    )
    val_fraction: float = _opt(
        0.05, "share of documents held out for validation", Range(0, 1, low_open=True)
    )
    tokenizer: str = _opt("byte", "byte | bpe | PATH/tokenizer.json | hf:NAME")
    bpe_vocab_size: int = _opt(
        4096,
        "vocabulary size of a locally trained BPE tokenizer",
        POSITIVE,
        read_when=ReadWhen(
            "tokenizer is bpe",
            lambda cfg, _: cfg.tokenizer == "bpe",
            lambda cfg, _: f"tokenizer={cfg.tokenizer}",
        ),
    )
    bin_dtype: str = _opt(
        "uint16",
        "token dtype of .bin shards: uint16 | uint32",
        read_when=_data_is(".bin shards", (".bin",), hf=False),
    )
    seq_len: int = _opt(256, "tokens per training sequence", POSITIVE)
    batch_size: int = _opt(16, "sequences per optimizer step (split into microbatches)", POSITIVE)

    # --- optimizer ---
    optim: str = _opt("adamw", "optimizer (see `nobubble.optim.OPTIMIZERS`)")
    lr: float = _opt(3e-3, "peak learning rate", POSITIVE)
    weight_decay: float = _opt(
        0.1, "decoupled weight decay (matrices only; never norms)", NON_NEGATIVE
    )
    beta1: float = _opt(
        0.9, "first-moment decay (Adam-family, Lion, SOAP, MARS)", DECAY, read_when=_ADAM_BETAS
    )
    beta2: float = _opt(0.95, "second-moment decay", DECAY, read_when=_ADAM_BETAS)
    beta3: float = _opt(0.99, "third beta (Adan only)", DECAY, read_when=_optim("adan"))
    eps: float = _opt(
        1e-8,
        "denominator epsilon",
        POSITIVE,
        read_when=_optim("adamw", "nadamw", "muon", "adan", "soap", "mars"),
    )
    nadam_momentum_decay: float = _opt(
        0.0,
        "nadamw: NAdam's momentum warm-up ψ, μ_t = β1·(1 - 0.5·0.96^(tψ)); 0 = none, β1 from the "
        "first step (torch's and Ajanthan et al.'s default is 0.004)",
        NON_NEGATIVE,
        read_when=_optim("nadamw"),
    )
    momentum: float = _opt(
        0.95, "momentum (muon, signum, sgd)", DECAY, read_when=_optim("muon", "signum", "sgd")
    )
    nesterov: bool = _opt(True, "Nesterov momentum (muon, sgd)", read_when=_NESTEROV)
    muon_adjust_lr: str = _opt(
        "match_rms_adamw", "muon LR scaling: match_rms_adamw | original", read_when=_optim("muon")
    )
    muon_ns_dtype: str = _opt(
        "auto",
        "muon: dtype of the Newton–Schulz orthogonalization: auto (bfloat16 on CUDA and on CPUs "
        "with bfloat16 matrix instructions, else float32; docs/optimizers.md) | float32 | bfloat16",
        read_when=_optim("muon"),
    )
    lr_schedule: str = _opt("cosine", "cosine | wsd | constant (all after a linear warmup)")
    warmup_steps: int = _opt(20, "linear warmup steps", NON_NEGATIVE)
    decay_frac: float = _opt(
        0.2,
        "WSD: share of steps spent decaying at the end",
        FRACTION,
        read_when=_lr_schedule("wsd"),
    )
    min_lr_ratio: float = _opt(
        0.1,
        "final LR as a share of the peak (cosine, wsd)",
        FRACTION,
        read_when=_lr_schedule("cosine", "wsd"),
    )
    grad_clip: float = _opt(
        1.0, "max gradient norm per pipeline stage; 0 disables clipping", NON_NEGATIVE
    )
    nonfinite_patience: int = _opt(
        3,
        "abort after this many steps in a row whose update was skipped for a non-finite gradient",
        POSITIVE,
    )
    correction: str = _opt(
        "none",
        "delay correction: none | ef | predict | nesterov | spike | dc, or a combination with + "
        "(e.g. ef+predict); see docs/corrections.md",
    )
    ef: bool = _opt(False, "error-feedback delay correction (the same as correction=ef)")
    ef_gamma: float = _opt(
        1.0,
        "error-feedback strength γ (γ = β on a momentum base: Nesterov)",
        NON_NEGATIVE,
        read_when=_correction("ef"),
    )
    nesterov_gamma: float = _opt(
        0.9,
        "correction=nesterov: look-ahead momentum γ (gradient step scaled by 1 - γ)",
        DECAY,
        read_when=_correction("nesterov"),
    )
    dc_lambda: float = _opt(
        0.04,
        "correction=dc: λ of g + λ·g⊙g⊙(w_now - w_stale)",
        NON_NEGATIVE,
        read_when=_correction("dc"),
    )
    dc_mean_square_decay: float = _opt(
        0.0,
        "correction=dc: 0 keeps λ constant (DC-ASGD-c); m > 0 divides it by √(ms + 1e-7), ms "
        "the gradient's running mean square with decay m (DC-ASGD-a)",
        DECAY,
        read_when=_correction("dc"),
    )

    # --- schedule ---
    schedule: str = _opt("sync", " | ".join(SCHEDULES))
    stages: int = _opt(
        1, "pipeline stages P (torchrun: one process per stage and replica)", POSITIVE
    )
    chunks: int | None = _opt(
        None,
        "model stages per pipeline stage (interleaved-1f1b's virtual stages): the model is cut "
        "into stages x chunks parts, part c·P + r on stage r; default: the schedule's (2 for "
        "interleaved-1f1b, else 1)",
        POSITIVE,
        read_when=_INTERLEAVED,
    )
    microbatches: int = _opt(1, "microbatches M per optimizer step", POSITIVE)
    dp: int = _opt(
        1,
        "data-parallel replicas of the pipeline (torchrun: stages x dp processes); each reads "
        "1/dp of every microbatch",
        POSITIVE,
    )
    stage_layers: list[int] | None = _opt(
        None, "explicit blocks per stage, e.g. [3, 3]", NON_NEGATIVE
    )
    p2p_timeout_s: float = _opt(
        300.0, "pipeline: fail if a stage waits longer for a peer", POSITIVE, read_when=_TORCHRUN
    )
    p2p_routes: str = _opt(
        "auto",
        "pipeline: process groups of the messages: shared (one group; gloo only: it pairs by "
        "tag) | per-edge (one per stage edge and channel, control on gloo: what NCCL needs) | "
        "auto (shared on gloo, per-edge otherwise)",
        read_when=_TORCHRUN,
    )
    embed_cost: float = _opt(
        1.0, "partition weight of the embedding, in blocks", NON_NEGATIVE, read_when=_BALANCED_SPLIT
    )
    head_cost: float = _opt(
        1.0,
        "partition weight of the final norm + head, in blocks",
        NON_NEGATIVE,
        read_when=_BALANCED_SPLIT,
    )

    # --- run ---
    steps: int = _opt(300, "optimizer steps", POSITIVE)
    seed: int = _opt(0, "seed for initialization and data order", Range(0, 2**32))
    eval_every: int = _opt(
        50, "evaluate every N steps (and at the end); 0 = only at the end", NON_NEGATIVE
    )
    eval_batches: int = _opt(8, "validation batches per evaluation", POSITIVE)
    log_every: int = _opt(1, "write a metrics line every N steps", POSITIVE)
    checkpoint_every: int = _opt(
        0, "save a checkpoint every N steps (and always at the end)", NON_NEGATIVE
    )
    keep_checkpoints: int = _opt(2, "how many of the newest checkpoints to keep", POSITIVE)
    out: str | None = _opt(None, "run folder (default runs/<name>-<time>)")
    name: str | None = _opt(
        None, "run name (default: derived from the settings)", read_when=_NO_OUT
    )
    device: str = _opt("auto", "auto | cpu | cuda")
    dtype: str = _opt("float32", "float32 | bfloat16 (autocast for matmuls)")
    threads: int = _opt(  # each is an OS thread, made at the first parallel operation
        0, "torch CPU threads; 0 keeps torch's default", Range(0, MAX_THREADS, high_open=False)
    )
    progress: bool = _opt(True, "show a progress bar")
    logger: str = _opt(
        "none", "loggers beside metrics.jsonl: none | tensorboard | wandb | tensorboard,wandb"
    )
    wandb_project: str = _opt(
        "nobubble", "Weights & Biases project (logger=wandb)", read_when=_WANDB
    )
    wandb_mode: str = _opt(
        "online",
        "Weights & Biases mode: online | offline (no network; sync later)",
        read_when=_WANDB,
    )
    peak_tflops: float | None = _opt(
        None,
        "peak dense TFLOP/s of one device for MFU; default: looked up for known GPUs, none on CPU",
        POSITIVE,
    )
    profile_steps: str | None = _opt(
        None, "A:B: write a torch.profiler trace of steps A..B (from 1) into the run folder"
    )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def run_name(self) -> str:
        if self.name:
            return self.name
        corrections = "".join(f"-{name}" for name in chosen_corrections(self))
        dp = f"-dp{self.dp}" if self.dp > 1 else ""
        return (
            f"{self.preset}-{self.optim}-{self.schedule}{corrections}-p{self.stages}{dp}"
            f"-s{self.seed}"
        )

    def is_sync(self) -> bool:
        return self.schedule in SYNC_SCHEDULES

    def microbatch_size(self) -> int:
        return self.batch_size // self.microbatches

    def stage_chunks(self) -> int:
        """Model stages per pipeline stage: ``chunks``, or the schedule's default."""
        if self.chunks is not None:
            return self.chunks
        return 1 if self.schedule == SYNC else schedule_spec(self.schedule).default_chunks

    def model_stages(self) -> int:
        """The parts the model is cut into (``stages`` x chunks): what partitions, per-stage
        delays, clipping and checkpoint names count; ``stages`` counts processes."""
        return self.stages * self.stage_chunks()


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)


def _suggest(name: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_key_error(key: str) -> ConfigError:
    return ConfigError(
        f"unknown config key {key!r}{_suggest(key, FIELDS)}; valid keys: {', '.join(FIELDS)}"
    )


def _base_type(hint: Any) -> tuple[Any, bool]:
    """Return (type without None, whether None is allowed)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def coerce(key: str, value: Any) -> Any:
    """Convert ``value`` (from TOML or a ``key=value`` string) to the type of field ``key``."""
    if key not in FIELDS:
        raise unknown_key_error(key)
    hint, nullable = _base_type(_HINTS[key])
    if isinstance(value, str):
        text = value.strip()
        if nullable and text.lower() in ("none", "null", ""):
            return None
        if hint is str:
            return value
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
    if value is None:
        if nullable:
            return None
        raise ConfigError(f"{key} cannot be empty; give a {hint.__name__}")
    return _check_type(key, hint, value)


def _check_type(key: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list like [3, 3], got {value!r}")
        return [_check_type(key, item, v) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key} must be a whole number, got {value!r}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {hint}")  # pragma: no cover - programming error


def parse_overrides(items: typing.Iterable[str]) -> dict[str, Any]:
    """Parse ``key=value`` strings (values in TOML syntax, bare strings allowed)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"expected key=value, got {item!r} (e.g. lr=1e-3 or optim=muon)")
        key, value = item.split("=", 1)
        key = key.strip().replace("-", "_")
        out[key] = coerce(key, value)
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config; sections (``[optim]``) are allowed and flattened."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):  # a [section]: no field is a table
            for sub, subvalue in value.items():
                flat[sub] = subvalue
        else:
            flat[key] = value
    return {key.replace("-", "_"): coerce(key.replace("-", "_"), v) for key, v in flat.items()}


def build_config(*layers: dict[str, Any]) -> TrainConfig:
    """Merge override layers over the defaults and validate the result."""
    values: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            values[key] = coerce(key, value)
    cfg = TrainConfig(**values)
    validate(cfg)
    return cfg


def _choice(key: str, value: str, options: typing.Iterable[str]) -> None:
    options = list(options)
    if value not in options:
        hint = _suggest(value, options)
        raise ConfigError(f"unknown {key} {value!r}{hint}; choose one of: {', '.join(options)}")


def _check_numbers(cfg: TrainConfig) -> None:
    """Every number (each item of a list) finite and within its field's declared range."""
    for key, spec in FIELDS.items():
        accepted = spec.metadata["range"]
        if accepted is None:
            continue
        value = getattr(cfg, key)
        for number in value if isinstance(value, list) else [value]:
            if number is not None and not (math.isfinite(number) and number in accepted):
                raise ConfigError(f"{key} must be {_accepted(key, accepted)}, got {number!r}")


def _accepted(key: str, accepted: Range) -> str:
    """The range in words; a float range open to infinity also says that inf is out."""
    if accepted.high == math.inf and _base_type(_HINTS[key])[0] is float:
        return f"{accepted} and finite"
    return str(accepted)


def validate(cfg: TrainConfig) -> None:
    """Check everything that can be checked without building the model or reading data."""
    from nobubble.model import PRESETS
    from nobubble.optim import OPTIMIZERS

    _choice("preset", cfg.preset, PRESETS)
    _choice("optim", cfg.optim, OPTIMIZERS)
    _choice("schedule", cfg.schedule, SCHEDULES)
    if cfg.chunks is not None:
        problem = (
            "sync runs one model stage per stage (chunks=1); interleaved-1f1b takes several"
            if cfg.schedule == SYNC and cfg.chunks != 1
            else cfg.schedule != SYNC and schedule_spec(cfg.schedule).chunk_problem(cfg.chunks)
        )
        if problem:
            raise ConfigError(f"chunks={cfg.chunks}: {problem}")
    _choice("lr_schedule", cfg.lr_schedule, LR_SCHEDULES)
    _choice("dtype", cfg.dtype, DTYPES)
    _choice("device", cfg.device, DEVICES)
    _choice("p2p_routes", cfg.p2p_routes, P2P_ROUTES)
    _choice("bin_dtype", cfg.bin_dtype, ("uint16", "uint32"))
    _choice("muon_adjust_lr", cfg.muon_adjust_lr, ("match_rms_adamw", "original"))
    _choice("muon_ns_dtype", cfg.muon_ns_dtype, ("auto", *DTYPES))
    _choice("wandb_mode", cfg.wandb_mode, ("online", "offline"))
    for name in chosen_loggers(cfg):
        _choice("logger", name, LOGGERS)
    from nobubble.corrections import check

    check(cfg)  # refuses a correction not implemented yet, or one that cannot serve cfg
    _check_numbers(cfg)
    if cfg.profile_steps is not None:
        profile_range(cfg)
    if cfg.batch_size % cfg.microbatches:
        raise ConfigError(
            f"batch_size {cfg.batch_size} is not divisible by microbatches {cfg.microbatches}; "
            "pick a batch size that is a multiple of the microbatch count"
        )
    if cfg.microbatch_size() % cfg.dp:
        raise ConfigError(
            f"each of the {cfg.microbatches} microbatches of batch_size {cfg.batch_size} holds "
            f"{cfg.microbatch_size()} sequences, which dp={cfg.dp} replicas cannot share equally; "
            f"batch_size must be a multiple of microbatches x dp = {cfg.microbatches * cfg.dp}"
        )
    if cfg.schedule != SYNC:
        spec = schedule_spec(cfg.schedule)
        problem = spec.microbatch_problem(cfg.stages, cfg.microbatches)
        if problem:
            raise ConfigError(problem)
        if spec.split_backward and (cfg.activation_checkpointing or cfg.compile):
            raise ConfigError(
                f"{spec.name} splits each backward in two with hooks on the stage's linear "
                "layers, which activation checkpointing's recomputation and torch.compile's "
                "graphs do not run as the forward did; set activation_checkpointing=false and "
                "compile=false, or use 1f1b"
            )
        if spec.step_per_microbatch and cfg.microbatches != 1:
            raise ConfigError(
                f"{spec.name} steps the optimizer after every microbatch, so each step is one "
                f"microbatch; set microbatches=1 (got {cfg.microbatches}) and choose batch_size "
                "as the microbatch size"
            )
    if cfg.stage_layers is not None and len(cfg.stage_layers) != cfg.model_stages():
        parts = (
            f"stages={cfg.stages}"
            if cfg.stage_chunks() == 1
            else f"stages x chunks = {cfg.stages} x {cfg.stage_chunks()} = {cfg.model_stages()}"
        )
        raise ConfigError(
            f"stage_layers lists {len(cfg.stage_layers)} stages but {parts}; give one block "
            "count per model stage"
        )
    _check_model(cfg)


def chosen_corrections(cfg: TrainConfig) -> tuple[str, ...]:
    """The delay corrections ``correction`` names (``ef=true`` adds ``ef``), validated, in the
    order of :data:`CORRECTIONS`."""
    names = [n.strip() for n in cfg.correction.split("+") if n.strip()]
    names = [] if names == ["none"] else names
    for name in names:
        _choice("correction", name, CORRECTIONS)
    if len(set(names)) != len(names):
        raise ConfigError(f"correction {cfg.correction!r} names a correction twice")
    chosen = set(names) | ({"ef"} if cfg.ef else set())
    update = [n for n in UPDATE_CORRECTIONS if n in chosen]
    if len(update) > 1:
        raise ConfigError(
            f"corrections {' and '.join(update)} both change the update; choose one of them "
            "(predict combines with any one, e.g. correction=ef+predict)"
            + (" (ef=true adds ef)" if cfg.ef and "ef" not in names else "")
        )
    return tuple(n for n in CORRECTIONS if n in chosen)


def chosen_loggers(cfg: TrainConfig) -> list[str]:
    """The loggers ``logger`` names (comma-separated; "none" or empty for none)."""
    names = [n.strip() for n in cfg.logger.split(",") if n.strip()]
    return [] if names == ["none"] else names


def unused_settings(
    cfg: TrainConfig, given: typing.Iterable[str], facts: RunFacts
) -> dict[str, str]:
    """The settings among ``given`` (the keys the user set) that this run never reads, each
    with why: its field's ``read_when`` does not hold. Keys not given are never named."""
    given = set(given)
    unused = {}
    for key, spec in FIELDS.items():
        when: ReadWhen | None = spec.metadata["read_when"]
        if key in given and when is not None and not when.holds(cfg, facts):
            unused[key] = (
                f"{key}={json.dumps(getattr(cfg, key))} does nothing in this run: it is read "
                f"only when {when.when}, and this run has {when.now(cfg, facts)}; leave it out "
                "or change that"
            )
    return unused


def profile_range(cfg: TrainConfig) -> range | None:
    """The steps (numbered from 1) ``profile_steps`` names, or None; validated."""
    if cfg.profile_steps is None:
        return None
    first, sep, last = cfg.profile_steps.partition(":")
    if not (sep and first.strip().isdigit() and last.strip().isdigit()):
        raise ConfigError(
            f"profile_steps must be A:B with whole step numbers, e.g. 5:7, got "
            f"{cfg.profile_steps!r}"
        )
    a, b = int(first), int(last)
    if not 1 <= a <= b:
        raise ConfigError(
            f"profile_steps {cfg.profile_steps!r} must satisfy 1 <= A <= B (steps count from 1)"
        )
    if b > cfg.steps:  # refused, not clipped: the run would trace fewer steps than asked
        raise ConfigError(
            f"profile_steps {cfg.profile_steps!r} reaches past the run's last step (steps="
            f"{cfg.steps}); choose steps between 1 and {cfg.steps}"
        )
    return range(a, b + 1)


def _check_model(cfg: TrainConfig) -> None:
    """The model's shape and its split over the stages, as training will resolve them (but for
    the vocabulary, which is only known once the tokenizer is read)."""
    from nobubble.model import model_config, partition

    mc = model_config(cfg, tokenizer_vocab=1)
    stages = cfg.model_stages()
    try:
        partition(mc.n_layers, stages, cfg.embed_cost, cfg.head_cost, cfg.stage_layers)
    except ConfigError as exc:
        if cfg.stage_chunks() == 1:
            raise
        raise ConfigError(
            f"{cfg.schedule} cuts the model into stages x chunks = {cfg.stages} x "
            f"{cfg.stage_chunks()} = {stages} stages, and {exc}, or fewer chunks"
        ) from None
    if mc.tie_embeddings and stages > 1 and cfg.schedule != SYNC:
        spec, last = schedule_spec(cfg.schedule), stages - 1
        if spec.delay(0, stages) != spec.delay(last, stages):
            raise ConfigError(
                f"the head is tied to the embedding (tie_embeddings), and {spec.name} trains the "
                f"embedding (stage 0) with gradient delay {spec.delay(0, stages)} and the "
                f"head (stage {last}) with delay {spec.delay(last, stages)}, so the two uses "
                "of the one tied weight would need different versions of it; set "
                "tie_embeddings=false, or use 2bw (delay 1 on every stage) or a synchronous "
                "schedule"
            )
