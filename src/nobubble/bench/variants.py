"""What the benchmark runs: the variants, their settings and their torchrun command lines."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from nobubble.config import ConfigError
from nobubble.corrections.registry import REGISTRY as CORRECTIONS
from nobubble.schedules.registry import schedule_spec

NOBUBBLE, TORCH = "nobubble", "torch"
BASELINE = "torch-1f1b"  # the ratios of the report are to this variant


@dataclass(frozen=True)
class Variant:
    name: str
    schedule: str  # our --schedule, or the torch schedule the worker runs
    backend: str = NOBUBBLE
    extra: tuple[str, ...] = ()  # key=value settings of this variant only
    plain: str | None = None  # with --options: the variant it adds options to
    worker: str | None = None  # a torch variant: the torch schedule, if not ``schedule``


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("gpipe", "gpipe"),
        Variant("1f1b", "1f1b"),
        Variant("2bw", "2bw"),
        Variant("2bw+ef", "2bw", extra=("correction=ef",)),
        Variant("pipedream", "pipedream"),
        Variant("zb-h1", "zb-h1"),
        Variant("zb-h2", "zb-h2"),
        Variant("interleaved-1f1b", "interleaved-1f1b"),  # 2 model stages per process
        Variant("torch-gpipe", "gpipe", TORCH),
        Variant(BASELINE, "1f1b", TORCH),
        # several stages per rank (torch's ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble);
        # synchronous, so their config says 1f1b
        Variant("torch-interleaved-1f1b", "1f1b", TORCH, worker="interleaved-1f1b"),
        Variant("torch-interleaved-zb", "1f1b", TORCH, worker="interleaved-zb"),
    )
}
DEFAULT_VARIANTS = tuple(VARIANTS)  # what --schedules runs when not given
# each delay correction under 2bw (docs/corrections.md), on request: what a correction costs
# per step beside plain 2bw and 2bw+ef (spike refuses optimizers other than SGD and AdamW)
VARIANTS.update(
    (f"2bw+{name}", Variant(f"2bw+{name}", "2bw", extra=(f"correction={name}",)))
    for name in (*(c for c in CORRECTIONS if c != "ef"), "ef+predict")
)


def twin(variant: Variant) -> str | None:
    """Our variant that runs a torch baseline's order (None for ours, or for an order we do not
    run): torch's runtime reports no per-action times, so the cost model borrows that variant's
    measured split of each process's time over its model stages and action kinds."""
    if variant.backend == NOBUBBLE:
        return None
    order = variant.worker or variant.schedule
    return order if order in VARIANTS and VARIANTS[order].backend == NOBUBBLE else None


# --options: the speed and memory options a variant can be measured with, and their settings
OPTIONS = {"compile": "compile=true", "ac": "activation_checkpointing=true"}
OPTION_ALIASES = {"activation_checkpointing": "ac"}


def option_sets(spec: str) -> list[tuple[str, ...]]:
    """``compile,ac,compile+ac`` as option sets; a :class:`ConfigError` names unknown ones."""
    sets = []
    for entry in (e.strip() for e in spec.split(",") if e.strip()):
        names = [OPTION_ALIASES.get(n.strip(), n.strip()) for n in entry.split("+")]
        unknown = [n for n in names if n not in OPTIONS]
        if unknown or len(set(names)) != len(names):
            raise ConfigError(
                f"--options entry {entry!r}: each entry is one or more of {', '.join(OPTIONS)} "
                "(ac: activation_checkpointing) joined by +, e.g. compile,ac,compile+ac"
            )
        sets.append(tuple(names))
    if not sets:
        raise ConfigError("--options is empty; e.g. --options compile,ac,compile+ac")
    return sets


def with_options(variants: list[Variant], sets: list[tuple[str, ...]]) -> list[Variant]:
    """Each of our variants, followed by itself with every option set (torch's baselines run
    as they are: the options are nobubble's)."""
    if not any(v.backend == NOBUBBLE for v in variants):
        raise ConfigError("--options measures nobubble's variants: select at least one")
    expanded = []
    for variant in variants:
        expanded.append(variant)
        if variant.backend != NOBUBBLE:
            continue
        for names in sets:
            expanded.append(
                Variant(
                    f"{variant.name}+{'+'.join(names)}",
                    variant.schedule,
                    variant.backend,
                    variant.extra + tuple(OPTIONS[n] for n in names),
                    plain=variant.name,
                )
            )
    return expanded


ZERO_SUFFIX = "+zero"  # a variant run with sharded state: "2bw+zero1"


def with_zero(variants: list[Variant], levels: list[int]) -> list[Variant]:
    """Each of our variants, followed by itself at every sharded level (``zero=N``); torch's
    baselines run as they are (their replicas hold everything)."""
    expanded = []
    for variant in variants:
        expanded.append(variant)
        if variant.backend != NOBUBBLE or variant.plain is not None:
            continue
        for level in levels:
            expanded.append(
                Variant(
                    f"{variant.name}{ZERO_SUFFIX}{level}",
                    variant.schedule,
                    variant.backend,
                    (*variant.extra, f"zero={level}"),
                    plain=variant.name,
                )
            )
    return expanded


@dataclass(frozen=True)
class Shape:
    """The training shape every variant shares: P stages, M microbatches, and ``dp``
    data-parallel replicas of the pipeline (``stages * dp`` processes), each reading 1/dp of
    every microbatch of the global batch ``batch_size``."""

    stages: int
    microbatches: int
    steps: int
    batch_size: int
    dp: int = 1

    @property
    def processes(self) -> int:
        return self.stages * self.dp

    def settings(self, variant: Variant) -> list[str]:
        """The shape as ``key=value`` settings for ``variant``.

        PipeDream steps after every microbatch, so it runs microbatch-sized steps, M times as
        many: the same microbatches and the same tokens as the other variants.
        """
        micro, steps, batch = self.microbatches, self.steps, self.batch_size
        if schedule_spec(variant.schedule).step_per_microbatch:
            micro, steps, batch = 1, steps * micro, batch // micro
        return [
            f"schedule={variant.schedule}",
            f"stages={self.stages}",
            f"microbatches={micro}",
            f"steps={steps}",
            f"batch_size={batch}",
            f"dp={self.dp}",
            *variant.extra,
        ]


# One segment (no evaluation or checkpoint inside the run): the final evaluation and checkpoint
# come after the training time that throughput is measured on.
FIXED_SETTINGS = ("eval_every=0", "eval_batches=1", "checkpoint_every=0", "log_every=1")


def command(variant: Variant, processes: int, out: Path, settings: list[str]) -> list[str]:
    """The torchrun command line of one run (``processes`` = stages x dp): ``nobubble train``
    or the torch baseline worker."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += [f"--nproc-per-node={processes}", "-m"]
    if variant.backend == TORCH:
        program = ["nobubble.bench.torch_worker", "--schedule", variant.worker or variant.schedule]
    else:
        program = ["nobubble", "train", "--no-progress", "--overwrite"]
    return [*launcher, *program, "--out", str(out), *settings]
