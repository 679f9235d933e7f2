"""``nobubble plan --optim``'s output: the time-to-target table and lines, and their JSON."""

from __future__ import annotations

import argparse
import dataclasses

from nobubble.markdown import markdown_table
from nobubble.planning.estimate import ClusterPlan
from nobubble.planning.target import (
    FIT_COMMAND,
    LEVEL,
    TOKENS_PER_PARAMETER,
    Row,
    TimeToTarget,
)


def no_law(args: argparse.Namespace) -> str:
    where = args.laws or "the shipped laws"
    return (
        f"time to target: no fitted law of the delay's extra steps exists yet for {args.optim} "
        f"(none in {where}); `{FIT_COMMAND}` fits one from the scaling ladder's runs, "
        "--laws reads it"
    )


def _count(x: float) -> str:
    """``x`` in three significant figures with a k, M, B or T."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g} {unit}"
    return f"{x:.3g}"


def _beyond(x: float) -> str:
    return f"{x:,.0f}x" if x >= 100 else f"{x:.3g}x"


# an axis the ladder held fixed has exponent 0: the law's value there is assumed, not fitted
UNFITTED = (
    "one {axis} measured, no exponent fitted: assumes the penalty does not change with {axis}"
)


def _tokens_rule(args: argparse.Namespace) -> str:
    if args.tokens:
        return "--tokens"
    return f"{TOKENS_PER_PARAMETER} per non-embedding parameter, the default; --tokens sets it"


def extrapolation(target: TimeToTarget, row: Row) -> str:
    """Where ``row``'s law was measured, and how far beyond that the plan lies."""
    law = row.law
    assert law is not None
    (p_lo, p_hi), (t_lo, t_hi) = law.params_range, law.tokens_range
    measured = (
        f"{row.setup}: law of {law.points} runs at {_count(p_lo)}-{_count(p_hi)} non-embedding "
        f"parameters, {_count(t_lo)}-{_count(t_hi)} tokens"
    )
    size, tokens = target.outside(row)
    beyond = [
        f"{_beyond(x)} beyond the measured {axis}"
        + (f" ({UNFITTED.format(axis=axis)})" if key in law.not_measured else "")
        for x, axis, key in ((size, "size", "params"), (tokens, "tokens", "tokens"))
        if x > 1
    ]
    return f"{measured}; " + (f"extrapolated: {', '.join(beyond)}" if beyond else "inside it")


def _assumed(target: TimeToTarget, setup: str) -> list[str]:
    """The axes ``setup``'s law did not fit along which the plan lies beyond the measured point."""
    row = next(r for r in target.rows if r.setup == setup)
    assert row.law is not None
    beyond = dict(zip(("params", "tokens"), target.outside(row), strict=True))
    return [
        f"assumed, not measured: the penalty at another {axis}"
        for key, axis in (("params", "size"), ("tokens", "tokens"))
        if key in row.law.not_measured and beyond[key] > 1
    ]


def verdict_lines(target: TimeToTarget, limit: float) -> list[str]:
    best = target.best_sync
    if best is None:
        return ["no synchronous schedule can run this shape: nothing to compare with"]
    against = best.setup if best.fits else f"{best.setup}, none fits in {limit:g} GB per GPU"
    lines = []
    for v in target.verdicts():
        low, mid, high = v.speedup
        speed = f"{mid:.3f}x its speed to target ({LEVEL:.0%} interval {low:.3f}-{high:.3f}x)"
        if v.answer == "undecided":
            line = f"{v.setup} against the best synchronous schedule ({against}): undecided: "
            line += f"the interval straddles it; {speed}"
        else:
            line = f"{v.setup} reaches the synchronous loss {v.answer} than the best "
            line += f"synchronous schedule ({against}): {speed}"
        line += "" if v.fits else f"; {v.setup} does not fit in {limit:g} GB"
        lines.append(line + "".join(f"; {note}" for note in _assumed(target, v.setup)))
    return lines


def target_lines(
    args: argparse.Namespace, plan: ClusterPlan, target: TimeToTarget | None, limit: float
) -> list[str]:
    """The time-to-target table under the throughput plan, or why there is none."""
    if target is None:
        return [no_law(args)]
    lines = [
        f"time to the synchronous final loss with {target.optim}: {_count(target.params)} "
        f"non-embedding parameters, {_count(target.tokens)} tokens ({_tokens_rule(args)}): "
        f"{target.steps:,} synchronous steps of {plan.tokens_per_step:,} tokens",
    ]
    header = [
        "schedule", "step (ms)", "steps", f"steps, {LEVEL:.0%} interval", "time to target (h)",
        f"time, {LEVEL:.0%} interval (h)", "fits",
    ]  # fmt: skip
    rows = []
    for r in target.rows:
        (s_lo, s_mid, s_hi), (t_lo, t_mid, t_hi) = r.steps, [t / 3600 for t in r.time_s]
        steps_band = f"{s_lo:,.0f}-{s_hi:,.0f}" if r.law else "-"
        time_band = f"{t_lo:,.2f}-{t_hi:,.2f}" if r.law else "-"
        rows.append([
            r.setup, f"{r.step_s * 1e3:.1f}", f"{s_mid:,.0f}", steps_band, f"{t_mid:,.2f}",
            time_band, "yes" if r.fits else "no",
        ])  # fmt: skip
    lines.append(markdown_table(header, rows, align="lrrrrrl"))
    lines += [extrapolation(target, r) for r in target.rows if r.law]
    lines += [f"{name}: no time to target: {why}" for name, why in target.uncovered.items()]
    if target.missing:
        lines.append(f"no fitted law yet for {', '.join(target.missing)} with {target.optim}")
    return lines + verdict_lines(target, limit)


def _row_json(target: TimeToTarget, r: Row) -> dict:
    row = {"setup": r.setup, "step_s": r.step_s, "fits": r.fits, "steps": r.steps,
           "time_s": r.time_s, "fitted": r.law is not None, "outside_measured": None}  # fmt: skip
    if r.law is not None:
        size, tokens = target.outside(r)
        row["outside_measured"] = {"params": size, "tokens": tokens}
        row["not_measured"] = list(r.law.not_measured)  # axes whose exponent is assumed 0
    return row


def target_json(args: argparse.Namespace, plan: ClusterPlan, target: TimeToTarget | None) -> dict:
    """The time to target for ``--json``: seconds, steps (low, central, high) and tokens."""
    if target is None:
        return {"optim": args.optim, "note": no_law(args)}
    return {
        "optim": target.optim, "non_embedding_params": target.params, "tokens": target.tokens,
        "tokens_rule": _tokens_rule(args), "sync_steps": target.steps,
        "tokens_per_step": plan.tokens_per_step, "level": LEVEL,
        "rows": [_row_json(target, r) for r in target.rows],
        "uncovered": target.uncovered, "missing_laws": target.missing,
        "best_sync": target.best_sync.setup if target.best_sync else None,
        "verdicts": [dataclasses.asdict(v) for v in target.verdicts()],
    }  # fmt: skip
