"""``nobubble corrections``: each delay correction's source, its response to a unit update, and
the whole delayed step's mean delay and largest stable step on a quadratic, for one optimizer
and schedule (the theory of docs/corrections.md, "Impulse responses"), and what
``correction=auto`` takes there."""

from __future__ import annotations

import argparse

from nobubble.config import ConfigError, Range, TrainConfig, parse_overrides
from nobubble.config.flags import whole
from nobubble.configure import build_config
from nobubble.corrections.auto import choose
from nobubble.corrections.registry import REGISTRY, chosen, step_response
from nobubble.corrections.response import Response, largest_stable_step, momentum
from nobubble.layout import ParallelLayout
from nobubble.schedules.registry import schedule_spec

TERMS = 6  # impulse-response terms shown
# every row of every delay's table prints them (1,000 make a row about 7,000 characters wide);
# the mean, step and stable columns take the whole response, whatever is shown
TERMS_RANGE = Range(
    1, 1000, high_open=False, why="a row shows them; the other columns take the whole response"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="the run's settings (default: optim=adamw schedule=2bw), e.g. optim=muon "
        "schedule=pipedream stages=4 microbatches=1 ef_gamma=1.5",
    )
    parser.add_argument(
        "--terms",
        type=whole(TERMS_RANGE),
        default=TERMS,
        help=f"impulse-response terms shown, {TERMS_RANGE} (default: {TERMS})",
    )
    parser.add_argument(
        "--sources", action="store_true", help="also list each correction's source and rule"
    )


def variants() -> list[str]:
    """Every correction alone, then each update or gradient one with predict."""
    single = ["none", *REGISTRY]
    wrappers = [name for name, c in REGISTRY.items() if c.wrap is not None]
    return single + [f"{name}+predict" for name in wrappers]


def _terms(response: Response, count: int) -> str:
    """The first ``count`` terms (a finite response: all of them)."""
    if response.den == (1.0,):
        count = min(count, len(response.num))
    lag = f"from lag {response.shift}: " if response.shift else ""
    return lag + ", ".join(f"{h:.3g}" for h in response.terms(count))


def _label(cfg: TrainConfig, name: str) -> str:
    """The variant and the strengths it reads, those at 0 left out."""
    keys = [key for part in chosen(cfg) for key in REGISTRY[part].settings]
    return " ".join([name, *(f"{k}={getattr(cfg, k)}" for k in keys if getattr(cfg, k))])


def _row(base: dict, name: str, delay: int, terms: int, linear: bool) -> list[str]:
    try:
        cfg = build_config({**base, "correction": name})
    except ConfigError as exc:
        return [name, f"refused: {str(exc).split(';')[0]}"]
    own = Response((1.0,))
    for part in chosen(cfg):
        own = own.then(REGISTRY[part].response(cfg, delay))
    whole = step_response(cfg, delay)
    return [
        _label(cfg, name),
        _terms(own, terms),
        f"{own.mean_delay():+.2f}",
        f"{delay + own.mean_delay():.2f}",
        f"{whole.mean_delay():.2f}",
        f"{largest_stable_step(whole):.3g}" if linear else "—",
    ]


HEADER = ["correction", "its response to a unit update", "mean", "left", "step", "stable"]


def delay_table(base: dict, delay: int, terms: int, linear: bool) -> list[str]:
    """One row per correction for a stage with gradient ``delay``."""
    rows = [_row(base, name, delay, terms, linear) for name in variants()]
    full = [HEADER, *(r for r in rows if len(r) == len(HEADER))]
    widths = [max(len(r[i]) for r in full) for i in range(len(HEADER))]
    lines = []
    for row in [HEADER, *rows]:
        if len(row) == 2:  # refused
            lines.append(f"  {row[0]:<{widths[0]}}  {row[1]}")
            continue
        cells = [f"{row[0]:<{widths[0]}}", f"{row[1]:<{widths[1]}}"]
        cells += [
            f"{cell:>{max(width, 6)}}" for cell, width in zip(row[2:], widths[2:], strict=True)
        ]
        lines.append("  " + "  ".join(cells))
    return lines


def describe(overrides: dict, terms: int) -> str:
    base = {"optim": "adamw", "schedule": "2bw", **overrides}
    base.pop("correction", None)
    cfg = build_config({**base, "correction": "none"})
    view = momentum(cfg)
    delays = schedule_spec(cfg.schedule).delays(ParallelLayout.of(cfg).model_stages)
    lines = [
        f"{cfg.optim}: {view.what}; the momentum's own mean delay "
        f"{view.response.mean_delay():.2f} steps"
        + ("" if view.linear else " (its step is not linear in the gradient: no stable step)"),
        f"{cfg.schedule}: gradient delay per model stage {delays}",
        f"auto: {choose(cfg).why}",  # (its strengths replace the ones given here)
    ]
    if view.linear:
        sync = build_config({**base, "schedule": "sync", "stages": 1, "correction": "none"})
        limit = largest_stable_step(step_response(sync, 0))
        lines.append(f"stable step without a delay (sync): {limit:.3g}")
    for delay in sorted(set(delays)):
        stages = [s for s, d in enumerate(delays) if d == delay]
        lines += ["", f"delay {delay} (model stages {', '.join(map(str, stages))}):"]
        lines += delay_table(base, delay, terms, view.linear)
    lines += ["", LEGEND]
    return "\n".join(lines)


LEGEND = """mean: the correction's own mean delay (steps an update is moved; negative: ahead); \
left: the delay plus it; step: the whole step's mean delay (the delay, the optimizer's momentum \
and the correction); stable: the largest step a = η·h (per unit steady-state gain) at which the \
whole step converges on a quadratic of curvature h. A gradient or weights correction's response \
is where the gradient is taken, relative to the delay, on a quadratic (predict: [1+D, -D]; dc: \
none while λ·g² is far below the curvature). docs/corrections.md, "Impulse responses"."""


def sources() -> str:
    return "\n".join(
        f"{name} ({c.acts_on}): {c.rule}\n  {c.source}" for name, c in REGISTRY.items()
    )


def run(args: argparse.Namespace) -> int:
    print(describe(parse_overrides(args.overrides), args.terms))
    if args.sources:
        print("\n" + sources())
    return 0
