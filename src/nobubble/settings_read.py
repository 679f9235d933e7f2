"""Settings a run never reads: when each setting that only some runs read is read, and which of
the settings a user chose this run will not read.

The facts come from the modules that read the settings: the optimizer registry (which optimizer
reads which hyperparameter), the learning-rate schedules, the corrections (the strength each one
reads), the model (the mixture-of-experts keys), the schedule registry (chunks), the data sources;
here they are gathered into one condition per setting (:data:`READ_WHEN`), which ``nobubble
train`` warns by and its ``--help`` shows.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nobubble.config import FIELDS, NobubbleWarning, TrainConfig, chosen_loggers
from nobubble.corrections.registry import REGISTRY as CORRECTIONS
from nobubble.corrections.registry import chosen
from nobubble.data.sources import BIN_SUFFIX, DATA_SUFFIXES
from nobubble.layout import ParallelLayout
from nobubble.model.resolve import MOE_SETTINGS, model_config
from nobubble.optim.lr_schedule import SETTINGS_READ as LR_SCHEDULE_SETTINGS
from nobubble.optim.registry import OPTIMIZER_SETTINGS, OPTIMIZERS, settings_read
from nobubble.schedules.registry import schedule_spec


class UnusedSettingWarning(NobubbleWarning):
    """A setting the user gave that the run never reads (:func:`unused_settings`)."""


@dataclass(frozen=True)
class RunFacts:
    """What decides whether some settings are read, besides the config itself."""

    moe: bool  # the model has mixture-of-experts blocks (a preset's, or moe_experts > 0)
    torchrun: bool  # the pipeline runtime runs it (a process per stage), not the one process

    @classmethod
    def of(cls, cfg: TrainConfig, torchrun: bool) -> RunFacts:
        """The facts of the run of ``cfg``, launched under torchrun or not."""
        return cls(moe=bool(model_config(cfg, tokenizer_vocab=1).moe_blocks()), torchrun=torchrun)


Condition = Callable[[TrainConfig, RunFacts], bool]


@dataclass(frozen=True)
class ReadWhen:
    """The condition under which a run reads a setting that not every run reads."""

    when: str  # the condition in words: "it is read only when ..."
    holds: Condition
    now: Callable[[TrainConfig, RunFacts], str]  # what this run has instead


def _optimizer(key: str) -> ReadWhen:
    readers = [name for name in OPTIMIZERS if key in settings_read(name, momentum=1.0)]
    sgd_needs_momentum = "sgd" in readers and key not in settings_read("sgd", momentum=0.0)
    when = " or ".join(readers) + (" (sgd: with momentum > 0)" if sgd_needs_momentum else "")
    return ReadWhen(
        f"optim is {when}",
        lambda cfg, _: key in settings_read(cfg.optim, cfg.momentum),
        lambda cfg, _: f"optim={cfg.optim}" + (" with momentum=0" if cfg.optim == "sgd" else ""),
    )


def _lr_schedule(key: str) -> ReadWhen:
    readers = [name for name, keys in LR_SCHEDULE_SETTINGS.items() if key in keys]
    return ReadWhen(
        f"lr_schedule is {' or '.join(readers)}",
        lambda cfg, _: cfg.lr_schedule in readers,
        lambda cfg, _: f"lr_schedule={cfg.lr_schedule}",
    )


def _correction(name: str) -> ReadWhen:
    return ReadWhen(
        f"correction includes {name}",
        lambda cfg, _: name in chosen(cfg),
        lambda cfg, _: f"correction={cfg.correction}",
    )


def _data_is(kinds: str, suffixes: tuple[str, ...], hf: bool) -> ReadWhen:
    """Read for data of these file suffixes (and ``hf:`` datasets if ``hf``); said to be unread
    only for data that surely is none of them (a folder or glob of other files is not)."""

    def holds(cfg: TrainConfig, _: RunFacts) -> bool:
        if cfg.data == "builtin":
            return False
        if cfg.data.startswith("hf:"):
            return hf
        return not cfg.data.endswith(tuple(s for s in DATA_SUFFIXES if s not in suffixes))

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
    lambda *_: "one process (the one-process engine)",
)
_WANDB = ReadWhen(
    "logger includes wandb",
    lambda cfg, _: "wandb" in chosen_loggers(cfg),
    lambda cfg, _: f"logger={cfg.logger}",
)


def _delayed(cfg: TrainConfig) -> bool:
    return any(schedule_spec(cfg.schedule).delays(ParallelLayout.of(cfg).model_stages))


_STALENESS = ReadWhen(
    "the one-process engine trains with a gradient delay (2bw; pipedream on 2 or more stages): "
    "the pipeline measures the weight drift only",
    lambda cfg, facts: not facts.torchrun and _delayed(cfg),
    lambda cfg, facts: (
        "the pipeline under torchrun"
        if facts.torchrun
        else f"schedule={cfg.schedule} with stages={cfg.stages}: no stage has a gradient delay"
    ),
)

_ONE_PROCESS = ReadWhen(
    "the one-process engine trains (the pipeline does not measure it)",
    lambda _, facts: not facts.torchrun,
    lambda *_: "the pipeline under torchrun",
)


def _split_by_rule(cfg: TrainConfig) -> bool:
    return cfg.stage_layers is None and ParallelLayout.of(cfg).model_stages > 1


def _split(cfg: TrainConfig) -> str:
    return f"stage_layers={cfg.stage_layers}" if cfg.stage_layers else "one model stage"


READ_WHEN: dict[str, ReadWhen] = {
    **dict.fromkeys(MOE_SETTINGS, _MOE),
    "data_field": _data_is(".jsonl, .parquet or hf:NAME", (".jsonl", ".parquet"), hf=True),
    "bpe_vocab_size": ReadWhen(
        "tokenizer is bpe",
        lambda cfg, _: cfg.tokenizer == "bpe",
        lambda cfg, _: f"tokenizer={cfg.tokenizer}",
    ),
    "bin_dtype": _data_is(f"{BIN_SUFFIX} shards", (BIN_SUFFIX,), hf=False),
    **{key: _optimizer(key) for key in sorted(OPTIMIZER_SETTINGS)},
    **{
        key: _lr_schedule(key)
        for keys in LR_SCHEDULE_SETTINGS.values()
        for key in keys  # each key once: the same condition
    },
    **{key: _correction(c.name) for c in CORRECTIONS.values() for key in c.settings},
    "chunks": ReadWhen(
        "the schedule is interleaved (interleaved-1f1b)",
        lambda cfg, _: schedule_spec(cfg.schedule).interleaved,
        lambda cfg, _: f"schedule={cfg.schedule}",
    ),
    "zero": ReadWhen(
        "dp > 1 (replicas to shard the state over)",
        lambda cfg, _: cfg.dp > 1,
        lambda cfg, _: f"dp={cfg.dp}",
    ),
    "tp": _TORCHRUN,  # one process computes what the tp ranks compute together
    "p2p_timeout_s": _TORCHRUN,
    "p2p_routes": _TORCHRUN,
    "group_timeout_s": _TORCHRUN,
    "p2p_warmup": _TORCHRUN,
    "p2p_dtype": _TORCHRUN,
    "dist_backend": _TORCHRUN,
    "emulate_nccl": _TORCHRUN,
    "partition": ReadWhen(
        "the blocks are split over several model stages by a rule (stage_layers not given)",
        lambda cfg, _: _split_by_rule(cfg),
        lambda cfg, _: _split(cfg),
    ),
    **dict.fromkeys(
        ("embed_cost", "head_cost"),
        ReadWhen(
            "the blocks are split over several model stages by cost in blocks (stage_layers "
            "not given, partition=blocks)",
            lambda cfg, _: _split_by_rule(cfg) and cfg.partition == "blocks",
            lambda cfg, _: "partition=flops" if _split_by_rule(cfg) else _split(cfg),
        ),
    ),
    "name": ReadWhen(
        "out is not given (it names the default folder runs/<name>-<time>)",
        lambda cfg, _: cfg.out is None,
        lambda cfg, _: f"out={cfg.out}",
    ),
    "tf32": ReadWhen(
        "the run may train on a GPU (device is cuda or auto): the CPU has no TF32",
        lambda cfg, _: cfg.device != "cpu",
        lambda cfg, _: f"device={cfg.device}",
    ),
    "staleness_every": _STALENESS,
    "applied_error_every": _ONE_PROCESS,
    "wandb_project": _WANDB,
    "wandb_mode": _WANDB,
}


def unused_settings(cfg: TrainConfig, given: Iterable[str], facts: RunFacts) -> dict[str, str]:
    """The settings among ``given`` (the keys the user set) that this run never reads, each
    with why: its condition in :data:`READ_WHEN` does not hold. Keys not given are never named."""
    given, unused = set(given), {}
    for key in FIELDS:
        when = READ_WHEN.get(key) if key in given else None
        if when is not None and not when.holds(cfg, facts):
            unused[key] = (
                f"{key}={json.dumps(getattr(cfg, key))} does nothing in this run: it is read "
                f"only when {when.when}, and this run has {when.now(cfg, facts)}; leave it out "
                "or change that"
            )
    return unused


def never_read(cfg: TrainConfig) -> list[str]:
    """The settings the run of ``cfg`` reads neither in one process nor under torchrun: whatever
    their values, they change nothing in it (``zero`` at dp=1, a hyperparameter its optimizer
    does not have)."""
    launches = [RunFacts.of(cfg, torchrun) for torchrun in (False, True)]
    return [key for key, when in READ_WHEN.items() if not any(when.holds(cfg, f) for f in launches)]
