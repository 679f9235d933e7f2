"""The delay correction (docs/corrections.md) and the strength of each."""

from __future__ import annotations

from dataclasses import dataclass

from nobubble.config.fields import DECAY, NON_NEGATIVE, ConfigError, setting


@dataclass
class CorrectionSettings:
    correction: str = setting(
        "none",
        "delay correction: none, one name, a combination with + (e.g. ef+predict), or auto (the "
        "best measured for the optimizer and schedule, resolved into config.json); see "
        "docs/corrections.md",
        registry="correction",
    )
    ef: bool = setting(False, "error-feedback delay correction (the same as correction=ef)")
    ef_gamma: float = setting(
        1.0, "error-feedback strength γ (γ = β on a momentum base: Nesterov)", NON_NEGATIVE
    )
    nesterov_gamma: float = setting(
        0.9, "correction=nesterov: look-ahead momentum γ (gradient step scaled by 1 - γ)", DECAY
    )
    dc_lambda: float = setting(
        0.04, "correction=dc: λ of g + λ·g⊙g⊙(w_now - w_stale)", NON_NEGATIVE
    )
    dc_mean_square_decay: float = setting(
        0.0,
        "correction=dc: 0 keeps λ constant (DC-ASGD-c); m > 0 divides it by √(ms + 1e-7), ms "
        "the gradient's running mean square with decay m (DC-ASGD-a)",
        DECAY,
    )


def correction_names(settings: CorrectionSettings) -> tuple[str, ...]:
    """The names ``correction`` lists (``ef=true`` adds ``ef``), as written: "none" or empty for
    none; a name given twice is refused. Which names exist is the correction registry's to say
    (:func:`nobubble.corrections.registry.chosen`)."""
    names = [n.strip() for n in settings.correction.split("+") if n.strip()]
    names = [] if names == ["none"] else names
    if len(set(names)) != len(names):
        raise ConfigError(f"correction {settings.correction!r} names a correction twice")
    if settings.ef and "ef" not in names:
        names.append("ef")
    return tuple(names)
