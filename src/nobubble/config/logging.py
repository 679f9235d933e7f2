"""What a run reports: metrics lines, the progress bar, loggers, MFU and profiler traces."""

from __future__ import annotations

from dataclasses import dataclass

from nobubble.config.fields import FREE, NON_NEGATIVE, POSITIVE, ConfigError, setting

LOGGERS = ("tensorboard", "wandb")
WANDB_MODES = ("online", "offline")


@dataclass
class LoggingSettings:
    log_every: int = setting(1, "write a metrics line every N steps", POSITIVE, resume=FREE)
    staleness_every: int = setting(
        0,
        "every N steps, the cosine between each delayed stage's gradient and the fresh one (at "
        "the newest weights, same batch; one more forward and backward) in metrics.jsonl; 0 = "
        "never (docs/corrections.md)",
        NON_NEGATIVE,
        resume=FREE,
    )
    applied_error_every: int = setting(
        0,
        "every N steps, each stage's applied update against the one its optimizer state would "
        "apply from the fresh gradient (at the newest weights, same batch; one more forward and "
        "backward, and an optimizer step on copies): their relative error and cosine in "
        "metrics.jsonl; 0 = never (docs/corrections.md)",
        NON_NEGATIVE,
        resume=FREE,
    )
    progress: bool = setting(True, "show a progress bar", resume=FREE)
    logger: str = setting(
        "none",
        "loggers beside metrics.jsonl: none | tensorboard | wandb | tensorboard,wandb",
        resume=FREE,
    )
    wandb_project: str = setting("nobubble", "Weights & Biases project (logger=wandb)", resume=FREE)
    wandb_mode: str = setting(
        "online",
        "Weights & Biases mode (offline: no network; sync later)",
        choices=WANDB_MODES,
        resume=FREE,
    )
    peak_tflops: float | None = setting(
        None,
        "peak dense TFLOP/s of one device for MFU; default: looked up for known GPUs, none on CPU",
        POSITIVE,
        resume=FREE,
    )
    profile_steps: str | None = setting(
        None,
        "A:B: write a torch.profiler trace of steps A..B (from 1) into the run folder",
        resume=FREE,
    )


def chosen_loggers(settings: LoggingSettings) -> list[str]:
    """The loggers ``logger`` names (comma-separated; "none" or empty for none), checked."""
    names = [n.strip() for n in settings.logger.split(",") if n.strip()]
    names = [] if names == ["none"] else names
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(
                f"unknown logger {name!r}; choose none or any of: {', '.join(LOGGERS)}"
            )
    return names
