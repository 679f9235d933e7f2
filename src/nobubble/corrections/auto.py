"""``correction=auto``: the best correction measured for an optimizer and a schedule, and its
strength, from the corrections study (docs/results.md, sections 9-15): one table, each entry
with the run set it came from.

:func:`resolve` replaces ``auto`` by the choice when the configuration is built
(:func:`nobubble.configure.build_config`), so that config.json records the real settings and a
resumed run compares them. Where the study measured nothing for an optimizer, ``auto`` says so
and takes error feedback at γ = 1, the one correction measured for every optimizer; where no
stage has a gradient delay there is nothing to correct.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nobubble.config import FIELDS, ConfigError, TrainConfig, correction_names
from nobubble.layout import ParallelLayout
from nobubble.schedules.registry import schedule_spec

AUTO = "auto"


@dataclass(frozen=True)
class Measured:
    """A correction and its settings, with what it measured and where (the grid's phases in
    experiments/corrections.toml and the section of docs/results.md)."""

    correction: str
    settings: dict[str, float]  # every strength its corrections read (and nothing else)
    closes: str
    runs: str


# (optim, schedule) -> the best measured, by final validation loss at 300 steps, 3 seeds
CHOICES: dict[tuple[str, str], Measured] = {
    ("adamw", "2bw"): Measured(
        "ef",
        {"ef_gamma": 2.0},
        "closes 68% of the 2bw gap at 300 steps, 70% again in round two (against its machine's "
        "references) and 64% on unseen seeds; at 1,200 steps 79%, and 82% on unseen seeds "
        "(γ = 1.5: 64-67%; predict: 60%, and 71% at 1,200 steps)",
        "phases ef_gamma, ef_strong, gamma_all and longer_gamma, docs/results.md sections 12 "
        "and 15",
    ),
    ("muon", "2bw"): Measured(
        "ef",
        {"ef_gamma": 1.5},
        "closes 57% of the 2bw gap at 300 steps, 52% in round two (against its machine's "
        "references) and 58% on unseen seeds; 49% at 1,200 steps on unseen seeds (γ = 1.25-1.75 "
        "within 2 points of each other at 300 steps, γ = 1.75 65% at 1,200 on the tuning seeds; "
        "γ = 2: 46-50%; ef+predict: 55%)",
        "phases ef_gamma, ef_strong, gamma_all and longer_gamma, docs/results.md sections 12 "
        "and 15",
    ),
    ("mars", "2bw"): Measured(
        "ef+predict",
        {"ef_gamma": 1.0},
        "closes 65% of the 2bw gap at 300 steps (EF alone: 53%; at γ = 1.5 and 2: 63% and 64% "
        "on round two's machine, where EF alone closes 54%)",
        "phases main, corrections and gamma_others, docs/results.md sections 9 and 15",
    ),
    ("soap", "2bw"): Measured(
        "ef+predict",
        {"ef_gamma": 1.0},
        "closes 58% of the 2bw gap at 300 steps (EF alone: 41%; at γ = 1.5: 47%, at 2: 46% on "
        "round two's machine, where EF alone closes 45%)",
        "phases main, corrections and gamma_others, docs/results.md sections 9 and 15",
    ),
    ("adan", "2bw"): Measured(
        "ef",
        {"ef_gamma": 1.5},
        "closes 47% of the 2bw gap at 300 steps (predict: 43%, EF at γ = 1: 42-43%, at γ = 2: "
        "39%; all within the seeds' noise of each other)",
        "phases main, corrections and gamma_others, docs/results.md sections 9 and 15",
    ),
    ("nadamw", "2bw"): Measured(
        "ef",
        {"ef_gamma": 1.0},
        "closes 37% of the 2bw gap at 300 steps (predict the same; γ = 0.5, 0.9, 1.5 no better)",
        "phases main, corrections and ef_gamma, docs/results.md sections 9 and 12",
    ),
    ("lion", "2bw"): Measured(
        "ef",
        {"ef_gamma": 1.0},
        "closes 26% of the 2bw gap at 300 steps, 34% on round two's machine (predict: 20%; EF at "
        "γ = 1.5: 12%, at 2: 15%)",
        "phases main, corrections and gamma_others, docs/results.md sections 9 and 15",
    ),
    ("adamw", "pipedream"): Measured(
        "spike+predict",
        {},
        "closes 26% of PipeDream's gap on 4 stages and 11% on 8 (spike alone: 12% on both)",
        "phases pipedream and pipedream_corr, docs/results.md section 13",
    ),
    ("muon", "pipedream"): Measured(
        "predict",
        {},
        "closes 29% of PipeDream's gap on 4 stages and 5% on 8",
        "phases pipedream and pipedream_corr, docs/results.md section 13",
    ),
}
FALLBACK = Measured("ef", {"ef_gamma": 1.0}, "", "")
NONE = Measured("none", {}, "", "")


@dataclass(frozen=True)
class Choice:
    """What ``auto`` takes for one configuration, and why."""

    measured: Measured
    why: str  # one line: what was chosen, from what


def choose(cfg: TrainConfig) -> Choice:
    """The choice for ``cfg``'s optimizer and schedule (its other settings are not looked at)."""
    delays = schedule_spec(cfg.schedule).delays(ParallelLayout.of(cfg).model_stages)
    where = f"{cfg.optim} under {cfg.schedule}"
    if max(delays) == 0:
        why = f"{where} with stages={cfg.stages}: no stage has a gradient delay, nothing to correct"
        return Choice(NONE, f"correction=auto for {why}: none")
    found = CHOICES.get((cfg.optim, cfg.schedule))
    if found is None:
        return Choice(
            FALLBACK,
            f"correction=auto for {where}: nothing was measured for it (docs/results.md, "
            f"sections 9-15); falling back to {_label(FALLBACK)}, which closed part of the gap "
            "for every optimizer the study measured",
        )
    why = f"{_label(found)}, the best measured: {found.closes} ({found.runs})"
    return Choice(found, f"correction=auto for {where}: {why}")


def _label(measured: Measured) -> str:
    settings = " ".join(f"{k}={v}" for k, v in measured.settings.items())
    return f"{measured.correction} ({settings})" if settings else measured.correction


def requested(cfg: TrainConfig) -> bool:
    """Whether ``cfg`` asks for ``auto`` (alone: it chooses the whole correction)."""
    names = correction_names(cfg)
    if AUTO not in names:
        return False
    if names != (AUTO,):
        raise ConfigError(
            f"correction=auto chooses the whole correction and combines with nothing; got "
            f"{'+'.join(names)}: use correction=auto alone, or name the corrections"
        )
    return True


def resolve(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with ``auto`` replaced by its choice (unchanged if it does not ask for it). A
    strength given beside ``auto`` that is neither its default nor the choice is refused."""
    if not requested(cfg):
        return cfg
    measured = choose(cfg).measured
    for key, value in measured.settings.items():
        given = getattr(cfg, key)
        if given not in (FIELDS[key].default, value):
            raise ConfigError(
                f"correction=auto chooses {key}={value} for {cfg.optim} under {cfg.schedule}, "
                f"and {key}={given} was given: drop {key}, or name the correction yourself "
                f"(correction={measured.correction} {key}={given})"
            )
    return dataclasses.replace(cfg, correction=measured.correction, **measured.settings)
