"""The delay correction (docs/corrections.md) and the strength of each.

``correction`` is the one home of error feedback (``correction=ef``). Earlier versions also
spelled it ``ef=true``; :func:`fold_ef` reads that spelling where settings enter (a TOML file,
``key=value`` words, a sweep's table, a layer given in code; a saved config.json or meta.json),
so that nothing past the configuration's boundary knows it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nobubble.config.fields import (
    DECAY,
    NON_NEGATIVE,
    ConfigError,
    NobubbleWarning,
    as_bool,
    setting,
)

OLD_EF = "ef"  # the old key: ef=true is correction=ef, ef=false is no error feedback


class OldSpellingWarning(NobubbleWarning):
    """A setting given in a spelling of an earlier version (read as its new one, named)."""


@dataclass
class CorrectionSettings:
    correction: str = setting(
        "none",
        "delay correction: none, one name, a combination with + (e.g. ef+predict), or auto (the "
        "best measured for the optimizer and schedule, resolved into config.json); see "
        "docs/corrections.md",
        registry="correction",
    )
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


def names_in(correction: str) -> tuple[str, ...]:
    """The names a ``correction`` value lists, as written: "none" or empty for none; a name given
    twice is refused. Which names exist is the correction registry's to say
    (:func:`nobubble.corrections.registry.chosen`)."""
    names = [n.strip() for n in correction.split("+") if n.strip()]
    names = [] if names == ["none"] else names
    if len(set(names)) != len(names):
        raise ConfigError(f"correction {correction!r} names a correction twice")
    return tuple(names)


def correction_names(settings: CorrectionSettings) -> tuple[str, ...]:
    """The names ``settings.correction`` lists (:func:`names_in`)."""
    return names_in(settings.correction)


def fold_ef(values: Mapping[str, Any], *, warn: bool) -> dict[str, Any]:
    """``values`` (one layer of settings, or a saved configuration) with the old spelling
    ``ef=true|false`` folded into ``correction``: ``ef=true`` adds ``ef`` to the layer's
    ``correction`` (``correction=ef`` if the layer sets none), ``ef=false`` adds nothing. With
    ``warn`` (settings given now, not a saved run's), an :class:`OldSpellingWarning` names the new
    spelling. The one reading of the old key."""
    if OLD_EF not in values:
        return dict(values)
    folded = {key: value for key, value in values.items() if key != OLD_EF}
    on = as_bool(OLD_EF, values[OLD_EF])
    if on:
        names = names_in(str(folded.get("correction", "none")))
        folded["correction"] = "+".join(names if "ef" in names else ("ef", *names))
    if warn:
        fix = (
            f"write correction={folded['correction']} instead"
            if on
            else "leave it out (error feedback is correction=ef)"
        )
        warnings.warn(
            f"ef={str(on).lower()} is the old spelling of error feedback: {fix}",
            OldSpellingWarning,
            stacklevel=3,
        )
    return folded
