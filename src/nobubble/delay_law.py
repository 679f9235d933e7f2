"""Fitted laws of what the one-step delay costs, against model size and tokens.

A :class:`Law` is a separable power law ``y = coef * (params / 1e6) ** params_exp *
(tokens / 1e6) ** tokens_exp`` with bootstrap samples of its three numbers, fitted by
``nobubble report --scaling`` on the scaling ladder's runs and read by ``nobubble plan``.
``params`` counts non-embedding parameters; ``tokens`` the tokens a run trains on. A law knows
the range it was measured on, so a reader can say how far outside it a prediction lies. An axis
the data did not measure (its value the same at every point, or varying only together with the
other axis) has exponent 0 and is listed in ``not_measured``: a prediction that moves along it
is not backed by the data.

The quantities (``QUANTITIES``) are measured per delayed run against the synchronous run with the
same settings and seed:

- ``gap``: final validation loss minus sync's;
- ``relative_gap``: ``gap`` divided by sync's final loss;
- ``excess_steps``: ``S / s - 1``, where the delayed run ends at step ``S`` and sync first reaches
  the delayed run's final loss at step ``s`` (interpolated): the share of extra steps the delay
  costs; undefined for a run that ends below sync's final loss (sync never reaches it). A delayed
  run that needs ``(1 + excess_steps)`` times sync's steps to reach a loss takes
  ``(1 + excess_steps) * steps * step_time`` to reach sync's final loss.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

QUANTITIES = ("gap", "relative_gap", "excess_steps")
UNIT = 1e6  # params and tokens are fitted in millions, so coef is the value at 1 M and 1 M


@dataclass(frozen=True)
class Law:
    """``y = coef * (params/1e6)**params_exp * (tokens/1e6)**tokens_exp``, with its samples."""

    quantity: str
    optim: str
    setup: str  # the delayed setup, e.g. "2bw" or "2bw+auto"
    coef: float
    params_exp: float
    tokens_exp: float
    samples: tuple[tuple[float, float, float], ...]  # bootstrap (coef, params_exp, tokens_exp)
    params_range: tuple[float, float]  # measured non-embedding parameters, min and max
    tokens_range: tuple[float, float]  # measured tokens, min and max
    points: int = 0  # runs the fit used
    not_measured: tuple[str, ...] = ()  # "params", "tokens": exponents set to 0, not fitted

    def value(self, params: float, tokens: float) -> float:
        return _power(self.coef, self.params_exp, self.tokens_exp, params, tokens)

    def interval(self, params: float, tokens: float, level: float = 0.9) -> tuple[float, float]:
        """The central ``level`` share of the bootstrap samples' predictions."""
        if not self.samples:
            v = self.value(params, tokens)
            return v, v
        values = sorted(_power(c, p, t, params, tokens) for c, p, t in self.samples)
        return _quantile(values, (1 - level) / 2), _quantile(values, (1 + level) / 2)

    def outside(self, params: float, tokens: float) -> tuple[float, float]:
        """How many times beyond the measured range each axis lies (1.0: inside)."""
        return _beyond(params, self.params_range), _beyond(tokens, self.tokens_range)


def _power(coef: float, p_exp: float, t_exp: float, params: float, tokens: float) -> float:
    return coef * (params / UNIT) ** p_exp * (tokens / UNIT) ** t_exp


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default method)."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _beyond(x: float, bounds: tuple[float, float]) -> float:
    lo, hi = bounds
    if x > hi:
        return x / hi
    if x < lo:
        return lo / x
    return 1.0


def save_laws(laws: list[Law], path: Path) -> None:
    path.write_text(json.dumps([asdict(law) for law in laws], indent=1) + "\n")


def load_laws(path: Path) -> list[Law]:
    """The laws in ``path`` (as :func:`save_laws` writes them)."""
    laws = []
    for entry in json.loads(path.read_text()):
        entry["samples"] = tuple(tuple(s) for s in entry["samples"])
        entry["params_range"] = tuple(entry["params_range"])
        entry["tokens_range"] = tuple(entry["tokens_range"])
        entry["not_measured"] = tuple(entry.get("not_measured", ()))
        laws.append(Law(**entry))
    return laws


def find_law(laws: list[Law], quantity: str, optim: str, setup: str) -> Law | None:
    for law in laws:
        if (law.quantity, law.optim, law.setup) == (quantity, optim, setup):
            return law
    return None
