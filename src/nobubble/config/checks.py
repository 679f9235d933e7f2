"""What the schema alone can check: numbers in their ranges, words among their choices, loggers,
the profiled steps, that the batch divides into microbatches and replicas, and whether sharded
state has replicas to be shared over."""

from __future__ import annotations

from nobubble.config.fields import ConfigError, check_choice
from nobubble.config.logging import chosen_loggers
from nobubble.config.parallel import ParallelSettings
from nobubble.config.schema import FIELDS, TrainConfig


def check_schema(cfg: TrainConfig) -> None:
    """Refuse a value the schema says no to, naming the key and what it takes."""
    for key, spec in FIELDS.items():
        if spec.metadata["choices"] is not None:
            check_choice(key, getattr(cfg, key), spec.metadata["choices"])
    chosen_loggers(cfg)
    _check_numbers(cfg)
    profile_range(cfg)
    if cfg.batch_size % cfg.microbatches:
        raise ConfigError(
            f"batch_size {cfg.batch_size} is not divisible by microbatches {cfg.microbatches}; "
            "pick a batch size that is a multiple of the microbatch count"
        )
    if cfg.group_timeout_s < cfg.p2p_timeout_s:
        raise ConfigError(
            f"group_timeout_s={cfg.group_timeout_s:g} is below p2p_timeout_s="
            f"{cfg.p2p_timeout_s:g}: the backend would abort a stage's wait for a peer before "
            "the stage gives up on it with its error; raise group_timeout_s (default 1800) or "
            "lower p2p_timeout_s"
        )
    if cfg.microbatch_size() % cfg.dp:
        raise ConfigError(
            f"each of the {cfg.microbatches} microbatches of batch_size {cfg.batch_size} holds "
            f"{cfg.microbatch_size()} sequences, which dp={cfg.dp} replicas cannot share equally; "
            f"batch_size must be a multiple of microbatches x dp = {cfg.microbatches * cfg.dp}"
        )


def zero_problem(parallel: ParallelSettings) -> str | None:
    """Why ``parallel.zero`` has nothing to shard (one replica), or None. The planner and the
    bench, asked to predict or measure sharded state, refuse it; a training run warns that it
    does not read ``zero`` at dp=1 (:data:`nobubble.settings_read.READ_WHEN`) and trains as with
    0."""
    if parallel.zero and parallel.dp == 1:
        return (
            f"zero={parallel.zero} shares the optimizer state out over the data-parallel "
            "replicas, and dp=1 has none to share it with; set dp to 2 or more, or zero to 0"
        )
    return None


def _check_numbers(cfg: TrainConfig) -> None:
    """Every number (each item of a list) finite and within its field's declared range."""
    for key, spec in FIELDS.items():
        accepted = spec.metadata["range"]
        if accepted is None:
            continue
        value = getattr(cfg, key)
        for number in value if isinstance(value, list) else [value]:
            refusal = None if number is None else accepted.refusal(number)
            if refusal:
                raise ConfigError(f"{key} {refusal}")


def profile_range(cfg: TrainConfig) -> range | None:
    """The steps (numbered from 1) ``profile_steps`` names, or None; checked."""
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
