"""``nobubble report --scaling RUNS_DIR... --out DIR``: the delay's cost against model size and
tokens, its fitted laws and the study's table as their check.

Writes ``DIR/scaling.md`` (the ladder's points, the penalty in steps, the laws, the check),
``DIR/laws.json`` (:func:`nobubble.delay_law.save_laws`, read by ``nobubble plan --optim``) and
the log-log plots (:mod:`nobubble.reporting.scaling_plots`).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from nobubble.delay_law import QUANTITIES, save_laws
from nobubble.destinations import make_output_folder
from nobubble.markdown import markdown_table
from nobubble.reporting.groups import Stat
from nobubble.reporting.law_fit import (
    BOOTSTRAP_SAMPLES,
    BOOTSTRAP_SEED,
    LEVEL,
    PARAMS,
    TOKENS,
    Fit,
)
from nobubble.reporting.runs import ReportError, discover, matches, parse_filter
from nobubble.reporting.scaling import (
    PAPER,
    PAPER_PRESET,
    Check,
    Ladder,
    Pair,
    PointKey,
    fit_laws,
    ladder_points,
    origins,
    pair_runs,
    paper_checks,
    paper_params,
)
from nobubble.reporting.table import fmt_stat

QUANTITY_NOTE = """Each delayed run is set against the synchronous run with the same settings and \
seed (size, length, optimizer, learning rate). *gap*: its final validation loss minus sync's; \
*relative gap*: the gap over sync's final loss; mean ± standard deviation over seeds. *left by \
auto*, for a `+auto` row: its mean gap over the mean gap of the plain delayed runs at the same \
point (100% closes nothing, 0% everything). A setup reads `+auto` when its corrections and \
strengths are those `correction=auto` chooses now (corrections/auto.py)."""

PENALTY_NOTE = """*S*: the delayed run's last step. *s*: the steps sync needed to reach the \
delayed run's final loss (interpolated between evaluations). *excess steps* = S / s − 1, the \
share of extra steps the delay costs. *its steps to sync's loss*: the inverse, the steps the \
delayed run needed to reach sync's final loss, over the seeds that reached it. A delayed run \
that ends below sync's final loss *beats sync*: sync never reaches that loss, and the run has no \
excess steps (it is counted, never fitted)."""

FIT_NOTE = f"""Each law is `y = coef · (params / 1e6)^a · (tokens / 1e6)^b`, params counting \
non-embedding parameters, fitted by least squares on the logarithm of each point's mean over \
seeds; a point whose mean is at or below 0 has no logarithm and is left out (*left out*). An \
axis that does not vary among the points is *not measured* (exponent 0); one that varies only \
together with the other (every point on one line) cannot be told apart from it, and the whole \
trend goes to params. *interval*: the central {LEVEL:.0%} of {BOOTSTRAP_SAMPLES} bootstrap refits \
(seeds resampled within each point; generator seed {BOOTSTRAP_SEED}); with few seeds a \
bootstrap understates the spread (with n seeds the resampled means' variance is (n − 1) / n of \
the seeds' own). *scatter*: exp of the root-mean-square log residual around the law (×1.10: \
points 10% off the line), where the points outnumber the law's numbers."""

PAPER_NOTE = """The study's figures at 360 M parameters as published, the `+auto` rows \
standing for its error feedback. Predicted: the law at the \
study's non-embedding parameters and tokens; *band*: the law's bootstrap interval there; \
*ratio*: predicted / study's; *outside by*: how many times the study's figure lies beyond the \
band (1: inside); *beyond the ladder*: how many times the study's size and tokens exceed the \
largest measured ones. A law that misses is a finding about how far the ladder's trend carries, \
not a failure of the fit."""


def fmt_count(n: float) -> str:
    return f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M"


def fmt_signed(stat: Stat, scale: float = 1.0, digits: int = 4, unit: str = "") -> str:
    mean = f"{scale * stat.mean:+.{digits}f}{unit}"
    return mean if math.isnan(stat.std) else f"{mean} ± {scale * stat.std:.{digits}f}{unit}"


def _point_head(key: PointKey, members: Sequence[Pair]) -> list[str]:
    optim, setup, params, tokens = key
    return [optim, setup, fmt_count(params), fmt_count(tokens), str(len(members))]


def loss_table(points: dict[PointKey, list[Pair]]) -> str:
    rows = []
    for key, members in points.items():
        optim, setup, params, tokens = key
        gap = Stat.of([p.gap for p in members])
        left = "—"
        plain = points.get((optim, setup.removesuffix("+auto"), params, tokens))
        if setup.endswith("+auto") and plain:
            plain_gap = Stat.of([p.gap for p in plain]).mean
            left = f"{100 * gap.mean / plain_gap:.0f}%" if plain_gap > 0 else "— (no gap)"
        rows.append(
            [
                *_point_head(key, members),
                fmt_stat(Stat.of([p.sync.final_loss for p in members])),
                fmt_signed(gap),
                fmt_signed(Stat.of([p.value("relative_gap") for p in members]), 100, 2, "%"),
                left,
            ]
        )
    header = ["optimizer", "setup", "params", "tokens", "seeds", "sync loss", "gap"]
    return markdown_table([*header, "relative gap", "left by auto"], rows)


def penalty_table(points: dict[PointKey, list[Pair]]) -> str:
    rows = []
    for key, members in points.items():  # by optimizer, setup, size, tokens
        penalties = [p.penalty for p in members]
        s = Stat.of_known([q.sync_steps for q in penalties])
        excess = Stat.of_known([q.excess_steps for q in penalties])
        inverse = Stat.of_known([q.delayed_steps for q in penalties])
        reached = inverse.n if inverse else 0
        beats = sum(q.beats_sync for q in penalties)
        rows.append(
            [
                *_point_head(key, members),
                f"{max(q.steps for q in penalties):.0f}",
                fmt_stat(s, 0) if s else "—",
                fmt_signed(excess, digits=3) if excess else "—",
                f"{fmt_stat(inverse, 0)} ({reached} of {len(members)})" if inverse else "never",
                f"{beats} of {len(members)}",
            ]
        )
    header = ["optimizer", "setup", "params", "tokens", "seeds", "S", "s", "excess steps"]
    return markdown_table([*header, "its steps to sync's loss", "beats sync"], rows)


def _exponent(fit: Fit, axis: str) -> str:
    law = fit.law
    assert law is not None
    if axis in law.not_measured:
        return "not measured (varies only with params)" if fit.confounded else "not measured"
    value = law.params_exp if axis == PARAMS else law.tokens_exp
    interval = fit.exponent_interval(axis)
    return f"{value:+.3f} [{interval[0]:+.3f}, {interval[1]:+.3f}]" if interval else f"{value:+.3f}"


def laws_table(fits: Sequence[Fit]) -> str:
    rows = []
    for fit in fits:
        law = fit.law
        if law is None:
            continue
        runs = law.points
        scatter = f"×{fit.scatter:.3f}" if fit.scatter is not None else "— (exact)"
        rows.append(
            [
                law.optim,
                law.setup,
                law.quantity,
                f"{law.coef:.4g}",
                _exponent(fit, PARAMS),
                _exponent(fit, TOKENS),
                f"{len(fit.used)} ({runs} runs)",
                str(len(fit.dropped)),
                scatter,
                "–".join(fmt_count(v) for v in sorted(set(law.params_range))),
                "–".join(fmt_count(v) for v in sorted(set(law.tokens_range))),
            ]
        )
    header = ["optimizer", "setup", "quantity", "coef", "params exponent", "tokens exponent"]
    header += ["points", "left out", "scatter", "params measured", "tokens measured"]
    return markdown_table(header, rows)


def unfitted(fits: Sequence[Fit]) -> list[str]:
    """A line for each fit without a law, and each with skipped bootstrap samples."""
    lines = []
    for fit in fits:
        if fit.law is None:
            lines.append(f"no law: {fit.why_none}")
        elif fit.skipped_samples:
            lines.append(
                f"{fit.law.optim} {fit.law.setup} {fit.law.quantity}: {fit.skipped_samples} of "
                f"{BOOTSTRAP_SAMPLES} bootstrap samples did not determine the fit (skipped)"
            )
    return lines


def transfer_sentences(fits: Sequence[Fit]) -> list[str]:
    """For each optimizer and setup, which of the absolute and the relative gap lies closer to
    its power law across the ladder (the smaller scatter)."""
    by_key = {(f.law.optim, f.law.setup, f.law.quantity): f for f in fits if f.law is not None}
    lines = []
    for (optim, setup, quantity), fit in by_key.items():
        other = by_key.get((optim, setup, "relative_gap"))
        if quantity != "gap" or other is None or fit.scatter is None or other.scatter is None:
            continue
        absolute, relative = fit.scatter, other.scatter
        closer = (
            "both equally"
            if round(absolute, 3) == round(relative, 3)
            else "the relative gap"
            if relative < absolute
            else "the absolute gap"
        )
        lines.append(
            f"{optim} {setup}: around its law the absolute gap scatters by ×{absolute:.3f}, the "
            f"relative gap by ×{relative:.3f} over {len(fit.used)} points: {closer} follows a "
            "power law more closely across the ladder."
        )
    return lines


def _beyond(check: Check) -> str:
    """How far beyond the ladder, each axis whose exponent was not measured said so."""
    cells = []
    for axis, times in zip((PARAMS, TOKENS), check.beyond, strict=True):
        unmeasured = " (not measured)" if axis in check.law.not_measured else ""
        cells.append(f"×{times:.3g} {axis}{unmeasured}")
    return ", ".join(cells)


def checks_table(checks: Sequence[Check]) -> str:
    rows = []
    for c in checks:
        relative = c.law.quantity == "relative_gap"
        fmt = (lambda v: f"{100 * v:.3g}%") if relative else (lambda v: f"{v:.3g}")
        rows.append(
            [
                c.figure.optim,
                c.figure.setup,
                c.law.quantity,
                f"{fmt(c.paper)} ({c.figure.row})",
                fmt(c.predicted),
                f"{fmt(c.band[0])} – {fmt(c.band[1])}",
                "yes" if c.inside else "no",
                f"{c.ratio:.3g}",
                f"×{c.miss:.3g}",
                _beyond(c),
            ]
        )
    header = ["optimizer", "setup", "quantity", "study", "predicted", f"{LEVEL:.0%} band"]
    header += ["inside", "ratio", "outside by", "beyond the ladder"]
    return markdown_table(header, rows)


def paper_section(fits: Sequence[Fit], tokens: float | None) -> list[str]:
    parts = ["## The study's table as a check"]
    if tokens is None:
        return [
            *parts,
            "Not run: pass `--paper-tokens N`, the number of tokens the study trained its 360 M "
            'models on (docs/experiments.md, "The scaling report").',
        ]
    laws = [f.law for f in fits if f.law is not None]
    checks, missing = paper_checks(laws, tokens)
    parts.append(
        f"At {fmt_count(paper_params())} non-embedding parameters (preset `{PAPER_PRESET}`, the "
        f"study's 360 M shape) and {fmt_count(tokens)} tokens (`--paper-tokens`). Source: {PAPER}."
    )
    if checks:
        parts += [checks_table(checks), PAPER_NOTE]
    if missing:
        parts.append(f"No law for: {', '.join(missing)}.")
    return parts


def origins_line(pairs: Sequence[Pair]) -> str:
    """Which machines and code versions made the pairs (each pair is one of them)."""
    found = origins(pairs)
    listed = "; ".join(f"{n} on {machine}, {code}" for (machine, code), n in found.items())
    return f"Each pair's two runs share a machine and a code version. Pairs: {listed}."


def render(
    title: str, inputs: Sequence[str], ladder: Ladder, points: dict[PointKey, list[Pair]],
    fits: Sequence[Fit], figures: Sequence[str], paper_tokens: float | None,
    warnings: Sequence[str],
) -> str:  # fmt: skip
    parts = [
        f"# {title}",
        f"{len(ladder.pairs)} delayed runs with their synchronous partners, in {len(points)} "
        f"ladder points, from: {', '.join(f'`{p}`' for p in inputs)}",
        origins_line(ladder.pairs),
        "## The ladder: loss and gap",
        loss_table(points),
        QUANTITY_NOTE,
        "## The penalty in steps, against size",
        penalty_table(points),
        PENALTY_NOTE,
        "## The laws",
        laws_table(fits),
        FIT_NOTE,
    ]
    notes = unfitted(fits)
    if notes:
        parts.append("\n".join(f"- {line}" for line in notes))
    transfer = transfer_sentences(fits)
    if transfer:
        parts += ["### Absolute or relative gap", "\n".join(f"- {line}" for line in transfer)]
    parts += paper_section(fits, paper_tokens)
    parts.append("## Plots")
    parts += [f"![{name.removesuffix('.png')}]({name})" for name in figures]
    if ladder.unpaired:
        parts += ["## Unpaired", "\n".join(f"- {line}" for line in ladder.unpaired)]
    left_out = [*ladder.excluded, *warnings]
    if left_out:
        parts += ["## Left out", "\n".join(f"- {line}" for line in left_out)]
    return "\n\n".join(parts) + "\n"


def run_scaling(args: argparse.Namespace) -> int:
    if args.vs or args.reference or args.time_to_target:
        raise ReportError(
            "--scaling takes RUNS_DIR..., --out, --where, --title, --paper-tokens, "
            "--allow-mixed-references"
        )
    filters = [parse_filter(text) for text in args.where]
    runs, warnings = discover([Path(p) for p in args.runs])
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    ladder = pair_runs([run for run in runs if matches(run, filters)], args.allow_mixed_references)
    for line in ladder.unpaired:
        print(f"warning: unpaired: {line}", file=sys.stderr)
    if not ladder.pairs:
        raise ReportError(f"no delayed run with its synchronous partner in {' '.join(args.runs)}")
    points = ladder_points(ladder.pairs)
    fits = fit_laws(points)
    out = make_output_folder(args.out, "--out")
    save_laws([f.law for f in fits if f.law is not None], out / "laws.json")
    from nobubble.reporting.scaling_plots import draw_scaling_plots  # matplotlib: only to draw

    figures = draw_scaling_plots(fits, QUANTITIES, out)
    text = render(args.title, args.runs, ladder, points, fits, figures, args.paper_tokens, warnings)
    (out / "scaling.md").write_text(text)
    print(laws_table(fits))
    print(f"\nscaling report: {out / 'scaling.md'}; laws: {out / 'laws.json'}")
    return 0
