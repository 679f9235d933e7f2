"""``nobubble report RUN_FOLDERS... [--out DIR]``: tables and plots from finished runs.

A diverged run (stopped by the non-finite policy, or ended with a non-finite loss) is reported as
such and counts as an infinite loss. Unfinished run folders (no summary.json, not diverged) are
skipped with a warning, so a report can be drawn while a sweep is still running; a path that is
not a run folder and holds none is an error. Runs scored by ``nobubble eval`` also get a table of
their benchmark scores beside their losses.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nobubble.config import FIELDS, unknown_key_error
from nobubble.config.flags import real
from nobubble.destinations import check_output_folder, make_output_folder
from nobubble.reporting.groups import (
    CLEAR_GAP_SE,
    Comparison,
    Group,
    against_references,
    compare,
    controls,
    group_runs,
)
from nobubble.reporting.runs import ReportError, discover, matches, parse_filter
from nobubble.reporting.scaling_report import run_scaling
from nobubble.reporting.table import (
    STALENESS_MEASURES,
    controls_table,
    downstream_table,
    gap_during_training_table,
    quality_table,
    references_table,
    reverse_table,
    staleness_gap_correlation,
    staleness_table,
    target_table,
)
from nobubble.reporting.target import reverse_rows, target_rows

QUALITY_NOTE = f"""Final validation loss (mean token cross-entropy) and bits per byte: mean ± \
standard deviation over seeds. *gap vs sync*: mean final loss minus that of the synchronous run \
with the same settings (± the standard error of the difference). *gap closed*, for a run with a \
delay correction (EF, nesterov, spike, dc, predict; docs/corrections.md): (gap of the same run \
without a correction − its gap) / gap without; 100% means the correction matches sync, above 100% \
beats it, below 0% makes it worse. It is left out when the gap without the correction is not \
clearly positive (not above {CLEAR_GAP_SE:g} standard errors; with one seed, not above 0): a share \
of a gap that seed noise could explain means nothing."""

TARGET_NOTE = """Target: the synchronous baseline's mean final validation loss. Time to target: \
training time (evaluations excluded) until the validation loss first reaches it, interpolated \
between evaluations; mean ± std over the seeds that reached it. The baseline's own time is its \
full training time. Speed-up: baseline time / time to target.

The reverse question, for a delayed run that ends above the target: how long the baseline needs \
to reach the delayed run's own final loss (interpolated the same way), against the delayed run's \
full training time. A speed-up below 1 means the baseline gets to that quality first."""

DOWNSTREAM_NOTE = """Benchmark scores from `nobubble eval` (lm-evaluation-harness) of each run's \
newest evaluated checkpoint (*eval step*): mean ± standard deviation over seeds, or one seed's \
score with lm-eval's standard error (se). A column is one task, metric, number of shots and \
example limit; — marks runs not evaluated on it."""

GAP_NOTE = """Mean validation loss of each group minus its synchronous baseline's, at the \
evaluation nearest to a quarter, half and all of training (steps where every seed of both was \
evaluated). Read it beside the learning-rate schedule: a stale gradient costs more the larger \
the steps, so a gap may shrink as the learning rate decays rather than as training goes on."""

CONTROLS_NOTE = """Each delayed group with a correction beside its *control*, the same \
correction under a synchronous schedule (no delay). *cost without delay*: the control minus the \
synchronous baseline (what the correction costs, or gains, with nothing to correct). *delay's \
cost with it*: the group minus its control; *without it*: the plain delayed group's gap; *of \
which removed*: 1 − with/without, the share of the delay's cost the correction removes once its \
own cost is set apart (the *gap closed* column above mixes the two). dc and spike do nothing at \
delay 0 and predict is refused there (docs/corrections.md): their control is the baseline \
itself."""

STALENESS_NOTE = """*weight drift*: ‖w[t] − w[t−d]‖ / ‖w[t]‖ of each delayed stage at each \
evaluation (the distance from the weights its gradients are computed at to its newest ones), \
averaged over the model stages with a delay; *mean*: over a run's evaluations after the first \
update, *end*: at its last; mean ± std over the seeds that recorded it. *gradient cosine*: \
between the delayed gradient and the fresh one on the same batch, every `staleness_every` steps; \
*applied-step error* and *cosine*: ‖Δa − Δf‖ / ‖Δf‖ and cos(Δa, Δf) of the update a step \
applied, Δa = w[t+1] − w[t], and the one the same optimizer and correction state would have \
applied from the fresh gradient, Δf, every `applied_error_every` steps (zero under sync); \
*sync-step error* and *cosine*: Δa against Δs, the update the base optimizer alone (no update \
correction) would have applied from the fresh gradient and the same state, the synchronous \
step (equal to the applied-step columns without a correction); each in the one-process \
engine, averaged over the model stages and a run's measurements \
(docs/corrections.md, "Staleness you can see")."""

REFERENCES_NOTE = """Each delayed group whose settings differ from the reference values beside \
the synchronous and the plain delayed groups (no correction) at the reference values and \
otherwise its settings: *gap vs it*: its final loss minus the reference sync's (± the standard \
error of the difference); *gap closed*: (reference delayed gap − gap vs it) / reference delayed \
gap, the share of the gap a run at the reference values would have had that the changed \
settings (and its corrections) close. The *gap closed* of the table above compares with sync at \
the group's own values instead."""

REVERSE_HEADING = "### The reverse: the baseline's time to each delayed run's final loss"

NO_BASELINE = "No group has a synchronous baseline with the same settings to take a target from."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_FOLDER",
        help="run folders, or folders holding run folders (searched recursively)",
    )
    parser.add_argument(
        "--out", default="report", help="folder for report.md and the plots (default: report)"
    )
    parser.add_argument(
        "--where",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="keep only runs whose setting is one of the values (repeatable), e.g. "
        "--where optim=adamw,muon --where correction=none",
    )
    parser.add_argument(
        "--vs",
        nargs="+",
        default=[],
        metavar="KEY",
        help="also plot final loss against a setting; per optimizer, the first listed key that "
        "varies is used (e.g. --vs lr, or --vs momentum beta1)",
    )
    parser.add_argument(
        "--time-to-target",
        action="store_true",
        help="add a table of the training time each run needs to reach its synchronous "
        "baseline's final validation loss (meaningful for runs timed alone, e.g. under torchrun)",
    )
    parser.add_argument(
        "--reference",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="(repeatable) also set each delayed group whose KEY differs from VALUE against the "
        "sync and plain delayed groups at VALUE, e.g. --reference beta1=0.9: how much of the "
        "delay gap at the default does lowering beta1 close",
    )
    parser.add_argument(
        "--allow-mixed-references",
        action="store_true",
        help="show a share whose runs come from more than one machine (marked) instead of "
        "leaving it out; the same run differs between CPUs",
    )
    parser.add_argument("--title", default="Report", help="heading of report.md")
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="instead: the scaling ladder's report (scaling.md, laws.json and plots): the delay's "
        "gap and extra steps against model size and tokens, fitted as power laws",
    )
    parser.add_argument(
        "--paper-tokens",
        type=real(),
        metavar="N",
        help="with --scaling: the tokens the study trained its 360 M models on, to check the "
        "laws against its table (docs/experiments.md)",
    )


def draw_plots(groups: Sequence[Group], vs: Sequence[str], out: Path) -> list[tuple[str, str]]:
    """Write the PNGs; return (caption, file name) for each."""
    from nobubble.reporting.plots import plot_curves, plot_final_vs  # matplotlib: only when drawing

    plot_curves(groups, "step", out / "val_loss_vs_step.png")
    plot_curves(groups, "time", out / "val_loss_vs_time.png")
    figures = [
        ("Validation loss against steps", "val_loss_vs_step.png"),
        ("Validation loss against training time", "val_loss_vs_time.png"),
    ]
    if vs:
        name = f"final_loss_vs_{'_'.join(vs)}.png"
        if plot_final_vs(groups, vs, out / name):
            figures.append((f"Final validation loss against {' / '.join(vs)}", name))
        else:
            print(f"warning: no optimizer's runs vary {' or '.join(vs)}; no plot", file=sys.stderr)
    return figures


def render(
    title: str,
    inputs: Sequence[str],
    rows: Sequence[Comparison],
    downstream: str | None,
    target: str | None,
    figures: Sequence[tuple[str, str]],
    warnings: Sequence[str],
    reference: dict[str, Any] | None = None,
    allow_mixed: bool = False,
) -> str:
    runs = sum(len(r.group.runs) for r in rows)
    diverged = sum(r.group.diverged for r in rows)
    counted = f"{runs} runs ({diverged} diverged)" if diverged else f"{runs} runs"
    parts = [
        f"# {title}",
        f"{counted} in {len(rows)} groups, from: {', '.join(f'`{p}`' for p in inputs)}",
        "## Final validation loss",
        quality_table(rows, allow_mixed),
        QUALITY_NOTE,
    ]
    if downstream is not None:
        parts += ["## Downstream evaluation", downstream, DOWNSTREAM_NOTE]
    gaps = gap_during_training_table(rows)
    if gaps is not None:
        parts += ["## Delay gap during training", gaps, GAP_NOTE]
    if reference:
        values = ", ".join(f"{k}={v}" for k, v in reference.items())
        parts.append(f"## Against the references at {values}")
        referenced = against_references(rows, reference)
        if referenced:
            parts += [references_table(referenced, allow_mixed), REFERENCES_NOTE]
        else:
            parts.append(
                "No delayed group differs from these values with both references (sync and "
                "the plain delayed group at them) among the runs."
            )
    found = controls(rows)
    if found:
        table = controls_table(found, allow_mixed)
        parts += ["## Corrections against their controls without a delay", table]
        parts.append(CONTROLS_NOTE)
    staleness = staleness_table(rows)
    if staleness is not None:
        parts += ["## Staleness", staleness, STALENESS_NOTE]
        for name, measure in STALENESS_MEASURES.items():
            correlation = staleness_gap_correlation(rows, measure)
            if correlation is not None:
                rho, count = correlation
                parts.append(
                    f"Rank correlation (Spearman) between a group's {name} and its gap vs "
                    f"sync, over the {count} groups with both: {rho:+.2f}."
                )
    if target is not None:
        parts += ["## Time to target", target, TARGET_NOTE]
    parts.append("## Plots")
    parts += [f"![{caption}]({name})" for caption, name in figures]
    if warnings:
        parts += ["## Skipped", "\n".join(f"- {w}" for w in warnings)]
    return "\n\n".join(parts) + "\n"


def parse_reference(texts: Sequence[str]) -> dict[str, Any]:
    """``--reference KEY=VALUE`` options as settings (one value per key)."""
    reference: dict[str, Any] = {}
    for text in texts:
        key, values = parse_filter(text)
        if key not in FIELDS:
            raise unknown_key_error(key)
        if len(values) != 1 or key in reference:
            raise ReportError(
                f"--reference takes one value per setting, got {text!r}"
                + (f" after {key}={reference[key]}" if key in reference else "")
                + " (e.g. --reference beta1=0.9)"
            )
        reference[key] = values[0]
    return reference


def run(args: argparse.Namespace) -> int:
    check_output_folder(args.out, "--out")  # created once the report is ready to write
    if args.scaling:
        return run_scaling(args)
    if args.paper_tokens is not None:
        raise ReportError("--paper-tokens goes with --scaling")
    for key in args.vs:
        if key not in FIELDS:
            raise unknown_key_error(key)
    filters = [parse_filter(text) for text in args.where]
    reference = parse_reference(args.reference)
    runs, warnings = discover([Path(p) for p in args.runs])
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    runs = [run for run in runs if matches(run, filters)]
    if not runs:
        where = f" matching {' and '.join(args.where)}" if filters else ""
        raise ReportError(f"no finished runs{where} in {' '.join(args.runs)}")
    groups = group_runs(runs)
    rows = compare(groups)
    target = None
    if args.time_to_target:
        found = target_rows(rows)
        if found:
            reverse = reverse_table(reverse_rows(rows), groups)
            target = f"{target_table(found, groups)}\n\n{REVERSE_HEADING}\n\n{reverse}"
        else:
            target = NO_BASELINE
    out = make_output_folder(args.out, "--out")
    figures = draw_plots(groups, args.vs, out)
    downstream = downstream_table(rows)
    allow = args.allow_mixed_references
    text = render(
        args.title, args.runs, rows, downstream, target, figures, warnings, reference, allow
    )
    (out / "report.md").write_text(text)
    print(quality_table(rows, allow))
    if downstream is not None:
        print("\n" + downstream)
    if target is not None:
        print("\n" + target)
    print(f"\nreport: {out / 'report.md'}")
    return 0
