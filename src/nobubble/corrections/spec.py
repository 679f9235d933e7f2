"""What a delay correction is: the facts every correction module declares about itself.

A correction acts at one of three points of a step (:data:`ACTS_ON`):

- ``update``: changes the step from w[t] to w[t+1] given the base optimizer's result (ef,
  nesterov, spike);
- ``gradient``: changes the gradient the optimizer receives, after the stage's clip (dc);
- ``weights``: changes the weights a step's forwards and backwards run at (predict).

Each also declares its *response* (:mod:`nobubble.corrections.response`): how it spreads a unit
update over the following steps, as a factor of the whole step's response (an update correction's
on the update, a gradient or weights one's on where the gradient is computed, relative to the
stage's delay; on a quadratic, where the gradient is linear in the weights, the two are one).

The first two wrap the stage's optimizer (:class:`nobubble.corrections.base.UpdateCorrection`), so
both backends run them unchanged; a run takes at most one of them. A ``weights`` correction is
where the stage's steps run (:class:`nobubble.corrections.predict.StepWeights`) and combines with
any one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nobubble.config import TrainConfig
from nobubble.corrections.response import Response
from nobubble.optim.composite import OptimizerLike

ACTS_ON = ("update", "gradient", "weights")
# (the stage's optimizer, the config, the stage's gradient delay) -> the corrected optimizer
Wrap = Callable[[OptimizerLike, TrainConfig, int], OptimizerLike]
# (the config, the stage's gradient delay) -> the correction's own response to a unit update
ResponseOf = Callable[[TrainConfig, int], Response]
PUBLISHED, GENERALISATION = "published", "our generalisation"


@dataclass(frozen=True)
class Source:
    """Where a correction comes from: ``method`` is PUBLISHED (the paper's method, as the paper
    states it) or GENERALISATION (ours, built on the paper's idea); ``ours`` says what nobubble
    added or changed (required for a generalisation; for a published method, its extensions)."""

    method: str
    paper: str  # authors, title or venue, year, arXiv id
    ours: str = ""

    def __post_init__(self) -> None:
        if self.method not in (PUBLISHED, GENERALISATION):
            raise ValueError(f"a source is {PUBLISHED!r} or {GENERALISATION!r}")
        if self.method == GENERALISATION and not self.ours:
            raise ValueError("a generalisation says what is ours")

    def __str__(self) -> str:
        text = f"{self.method}: {self.paper}"
        return f"{text}; ours: {self.ours}" if self.ours else text


@dataclass(frozen=True)
class Correction:
    """One correction's facts (docs/corrections.md is the long form)."""

    name: str
    acts_on: str  # one of ACTS_ON
    rule: str  # in the notation of docs/corrections.md
    memory: str  # extra memory per parameter
    needs: str  # what it needs from the optimizer
    schedules: str  # the schedules it is meant for
    source: Source  # the paper, and whether this is its method or our generalisation of it
    response: ResponseOf  # its own response to a unit update (docs/corrections.md)
    settings: tuple[str, ...] = ()  # the config keys it reads (its strength)
    refuses: Callable[[TrainConfig], str | None] = lambda cfg: None  # why not, or None
    wrap: Wrap | None = None  # update and gradient ones: optimizer -> corrected optimizer

    def __post_init__(self) -> None:
        if self.acts_on not in ACTS_ON:
            raise ValueError(f"{self.name}: acts_on must be one of {ACTS_ON}")
        if (self.wrap is None) != (self.acts_on == "weights"):
            raise ValueError(f"{self.name}: update and gradient corrections wrap the optimizer")
