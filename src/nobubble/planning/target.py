"""``nobubble plan --optim``: each schedule's time to the synchronous run's final loss.

A synchronous schedule reaches its final loss in ``steps = ceil(tokens / tokens per step)``
steps. A schedule with a one-step delay on every stage (2bw) needs ``(1 + excess_steps)`` times
as many to reach that loss, ``excess_steps`` being the fitted law of :mod:`nobubble.delay_law`
for the optimizer and the setup (``2bw``, ``2bw+auto``) at the plan's non-embedding parameters
and tokens, with the law's bootstrap interval. Time to target is those steps times the step time
the cost model predicts. A schedule whose delay differs by stage (pipedream) is not covered by
a law fitted on one-step delays, and is said to be so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from nobubble import delay_law
from nobubble.config import ConfigError
from nobubble.delay_law import Law, find_law, load_laws
from nobubble.planning.costs import non_embedding_parameters
from nobubble.planning.estimate import ClusterPlan, Estimate
from nobubble.schedules.registry import schedule_spec

QUANTITY = "excess_steps"
LEVEL = 0.9  # the interval's share of the bootstrap samples
TOKENS_PER_PARAMETER = 20  # the default budget (Hoffmann et al. 2022's compute-optimal ratio)
SHIPPED_LAWS = Path(delay_law.__file__).with_name("delay_laws.json")
FIT_COMMAND = "nobubble report --scaling"
CORRECTIONS = ("", "+auto")  # the delayed setups a law is fitted for: name, name+auto


def has_law(laws: list[Law] | None, optim: str) -> bool:
    """Whether ``laws`` hold any law of the delay's extra steps for ``optim``."""
    return any(law.quantity == QUANTITY and law.optim == optim for law in laws or ())


def read_laws(path: Path | None) -> list[Law] | None:
    """The laws in ``path`` (default: the shipped file; None if that does not exist yet)."""
    if path is None:
        if not SHIPPED_LAWS.exists():
            return None
        path = SHIPPED_LAWS
    if not path.is_file():
        raise ConfigError(f"--laws {path}: no such file")
    try:
        return load_laws(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # JSON, fields
        raise ConfigError(
            f"--laws {path}: not a laws file as {FIT_COMMAND} writes it ({type(exc).__name__}: "
            f"{exc})"
        ) from None


@dataclass(frozen=True)
class Row:
    """One schedule (or delayed setup) on its way to the synchronous final loss."""

    setup: str  # a schedule, or a delayed one with its correction ("2bw+auto")
    step_s: float
    fits: bool  # in the memory limit
    steps: tuple[float, float, float]  # low, central, high
    law: Law | None = None  # None: synchronous, the steps are the budget's

    @property
    def time_s(self) -> tuple[float, float, float]:
        low, mid, high = self.steps
        return low * self.step_s, mid * self.step_s, high * self.step_s


@dataclass(frozen=True)
class Verdict:
    """Whether a delayed setup reaches the synchronous final loss before the best synchronous
    schedule does."""

    setup: str
    against: str  # the best synchronous schedule
    answer: str  # "sooner", "later" or "undecided" (the interval straddles)
    speedup: tuple[float, float, float]  # its time over the setup's: low, central, high
    fits: bool


@dataclass(frozen=True)
class TimeToTarget:
    optim: str
    params: int  # non-embedding
    tokens: float
    steps: int  # the synchronous run's
    rows: list[Row]  # by central time to target
    uncovered: dict[str, str]  # schedule -> why no law applies
    missing: list[str]  # delayed setups the laws have no entry for
    best_sync: Row | None  # the fastest synchronous that fits (the fastest if none fits)

    def outside(self, row: Row) -> tuple[float, float]:
        """How many times beyond its law's measured size and tokens the plan lies."""
        assert row.law is not None
        return row.law.outside(self.params, self.tokens)

    def verdicts(self) -> list[Verdict]:
        best = self.best_sync
        if best is None:
            return []
        target = best.time_s[1]
        out = []
        for row in (r for r in self.rows if r.law is not None):
            low, mid, high = row.time_s
            answer = "sooner" if high < target else "later" if low > target else "undecided"
            speedup = (target / high, target / mid, target / low)
            out.append(Verdict(row.setup, best.setup, answer, speedup, row.fits))
        return out


def _delayed_rows(
    estimate: Estimate, fits: bool, laws: list[Law], optim: str, params: int, tokens: float,
    steps: int,
) -> tuple[list[Row], list[str]]:  # fmt: skip
    rows, missing = [], []
    for correction in CORRECTIONS:
        setup = estimate.schedule + correction
        law = find_law(laws, QUANTITY, optim, setup)
        if law is None:
            missing.append(setup)
            continue
        low, high = law.interval(params, tokens, LEVEL)
        central = law.value(params, tokens)
        needed = tuple(steps * (1 + e) for e in (low, central, high))
        rows.append(Row(setup, estimate.step_s, fits, needed, law))
    return rows, missing


def time_to_target(
    plan: ClusterPlan, estimates: list[Estimate], laws: list[Law], optim: str, tokens: float,
    limit_gb: float,
) -> TimeToTarget:  # fmt: skip
    """Every estimated schedule's time to the synchronous final loss at ``tokens``."""
    params = non_embedding_parameters(plan.model)
    steps = math.ceil(tokens / plan.tokens_per_step)
    rows, uncovered, missing = [], {}, []
    for e in estimates:
        spec = schedule_spec(e.schedule)
        fits = e.peak_memory_gb <= limit_gb
        if spec.flushes:
            rows.append(Row(e.schedule, e.step_s, fits, (steps, steps, steps)))
            continue
        delays = spec.delays(plan.parallel.stages)
        if set(delays) != {1} or spec.step_per_microbatch:
            uncovered[e.schedule] = (
                f"its delay is {min(delays)} to {max(delays)} steps by stage"
                + (", a step per microbatch" if spec.step_per_microbatch else "")
                + "; the laws are fitted on a one-step delay on every stage"
            )
            continue
        more, lacking = _delayed_rows(e, fits, laws, optim, params, tokens, steps)
        rows += more
        missing += lacking
    rows.sort(key=lambda r: r.time_s[1])
    sync = [r for r in rows if r.law is None]
    best = next((r for r in sync if r.fits), sync[0] if sync else None)
    return TimeToTarget(optim, params, tokens, steps, rows, uncovered, missing, best)
