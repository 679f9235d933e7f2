"""The scaling ladder's runs paired and measured: what the one-step delay costs against model
size and tokens, fitted as laws (``nobubble report --scaling``), and the study's table to check
them against.

Every delayed run is paired with the synchronous run (no correction) with the same settings and
seed but for how the pipeline runs (:data:`nobubble.reporting.groups.PIPELINE_KEYS`: the same
size, length, optimizer and learning rate); where several qualify, the one of the same shape.
A delayed run without its partner is listed, never dropped silently; so is a pair with a
diverged run (an infinite gap has no place on a log scale), and a pair whose two runs were made
on different machines or by different code versions (float rounding differs between CPUs, so
such a gap mixes the delay with the machine; ``allow_mixed`` keeps it). Different pairs may come
from different machines: each gap is a difference on one machine, and the report lists the
machines and code versions behind its pairs.

A run's *setup* is its schedule and corrections (``2bw``, ``2bw+ef``); ``2bw+auto`` when its
corrections and their strengths are those ``correction=auto`` chooses for its optimizer and
schedule (:func:`nobubble.corrections.auto.choose`). config.json holds only the resolved
correction, so a run is recognised by the table as it is now: one made with an earlier choice
reads as the correction it ran.

Its size is its non-embedding parameters (:func:`nobubble.planning.costs.non_embedding_parameters`,
the size the planner reads the laws at), its tokens ``steps x batch_size x seq_len``. A *ladder
point* is an optimizer, a setup, a size and a length, its pairs one per seed; its runs must agree
on every other setting (pass ``--where`` to choose, e.g. one learning rate).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from nobubble.config import TrainConfig
from nobubble.corrections import auto
from nobubble.corrections.registry import chosen
from nobubble.delay_law import QUANTITIES, Law, find_law
from nobubble.model.presets import PRESETS
from nobubble.model.resolve import model_config
from nobubble.planning.costs import non_embedding_parameters
from nobubble.reporting.groups import PIPELINE_KEYS, corrections_of
from nobubble.reporting.law_fit import LEVEL, Fit, Point, fit_law
from nobubble.reporting.penalty import Penalty, penalty
from nobubble.reporting.runs import RecordedRun, ReportError
from nobubble.schedules.registry import SYNCHRONOUS_SCHEDULES

SYNC = "sync"
SHAPE_KEYS = ("stages", "dp", "microbatches", "stage_layers")


def chosen_by_auto(settings: dict) -> bool:
    """Whether a run's corrections and strengths are what ``correction=auto`` chooses for it."""
    cfg = TrainConfig(**settings)
    measured = auto.choose(cfg).measured
    if measured.correction == auto.NONE.correction:
        return False
    wanted = chosen(TrainConfig(correction=measured.correction))
    same_strength = all(settings[k] == v for k, v in measured.settings.items())
    return corrections_of(settings) == wanted and same_strength


def setup_of(settings: dict) -> str:
    """``sync`` (any synchronous schedule, no correction), ``2bw``, ``2bw+auto``, ``2bw+ef``..."""
    corrections = corrections_of(settings)
    schedule = settings["schedule"]
    if not corrections:
        return SYNC if schedule in SYNCHRONOUS_SCHEDULES else schedule
    if schedule not in SYNCHRONOUS_SCHEDULES and chosen_by_auto(settings):
        return f"{schedule}+{auto.AUTO}"
    return "+".join([schedule, *corrections])


def size_and_tokens(settings: dict) -> tuple[int, int]:
    """A run's non-embedding parameters and the tokens it trains on."""
    mc = model_config(TrainConfig(**settings), tokenizer_vocab=1)  # the vocabulary is not counted
    tokens = settings["steps"] * settings["batch_size"] * settings["seq_len"]
    return non_embedding_parameters(mc), tokens


def curve(run: RecordedRun) -> list[tuple[float, float]]:
    return [(p.step, p.val_loss) for p in run.evals]


@dataclass(frozen=True)
class Pair:
    """A delayed run and its synchronous partner."""

    sync: RecordedRun
    delayed: RecordedRun
    setup: str
    params: int
    tokens: int

    @property
    def optim(self) -> str:
        return self.delayed.settings["optim"]

    @property
    def seed(self) -> int:
        return self.delayed.settings["seed"]

    @property
    def gap(self) -> float:
        return self.delayed.final_loss - self.sync.final_loss

    @cached_property
    def penalty(self) -> Penalty:
        return penalty(curve(self.sync), curve(self.delayed))

    def value(self, quantity: str) -> float | None:
        """``gap``, ``relative_gap`` or ``excess_steps`` (None: a run that beats sync)."""
        if quantity == "gap":
            return self.gap
        if quantity == "relative_gap":
            return self.gap / self.sync.final_loss
        return self.penalty.excess_steps


@dataclass(frozen=True)
class Ladder:
    pairs: list[Pair]
    unpaired: list[str]  # delayed runs without a partner, and why
    excluded: list[str]  # pairs with a diverged run; runs that are no part of a ladder


def pair_runs(runs: Sequence[RecordedRun], allow_mixed: bool = False) -> Ladder:
    """Each delayed run with its synchronous partner (see the module's docstring)."""
    setups = {id(run): setup_of(run.settings) for run in runs}
    syncs = [r for r in runs if setups[id(r)] == SYNC]
    pairs, unpaired, excluded = [], [], []
    for run in runs:
        setup, settings = setups[id(run)], run.settings
        if setup == SYNC:
            continue
        if settings["schedule"] in SYNCHRONOUS_SCHEDULES:
            excluded.append(f"{run.path}: {setup} is a correction without a delay, not a rung")
            continue
        key = {k: v for k, v in settings.items() if k not in PIPELINE_KEYS}
        found = [s for s in syncs if _without_pipeline(s) == key]
        if len(found) > 1:
            found = [s for s in found if all(s.settings[k] == settings[k] for k in SHAPE_KEYS)]
        if len(found) != 1:
            why = "no" if not found else f"{len(found)} equally good"
            unpaired.append(
                f"{run.path} ({setup}): {why} synchronous run(s) with the same settings and seed"
            )
            continue
        if run.diverged or found[0].diverged:
            which = "it" if run.diverged else f"its sync partner {found[0].path}"
            excluded.append(f"{run.path} ({setup}): {which} diverged; the gap is infinite")
            continue
        if not allow_mixed and (mixed := _mixed_origins(found[0], run)):
            excluded.append(f"{run.path} ({setup}): {mixed} (--allow-mixed-references keeps it)")
            continue
        pairs.append(Pair(found[0], run, setup, *size_and_tokens(settings)))
    return Ladder(pairs, unpaired, excluded)


def _mixed_origins(sync: RecordedRun, delayed: RecordedRun) -> str | None:
    """Why a pair's gap is not one machine's and one code version's (None: it is)."""
    for what, mine, theirs in (
        ("machine", delayed.machine, sync.machine),
        ("code", delayed.code, sync.code),
    ):
        if mine != theirs:
            return (
                f"its {what} is {mine} and its sync partner's ({sync.path}) {theirs}: a gap "
                f"across {what}s measures more than the delay"
            )
    return None


def origins(pairs: Sequence[Pair]) -> dict[tuple[str, str], int]:
    """How many pairs each (machine, code version) made."""
    counts: dict[tuple[str, str], int] = {}
    for pair in pairs:
        key = (pair.delayed.machine, pair.delayed.code)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _without_pipeline(run: RecordedRun) -> dict:
    return {k: v for k, v in run.settings.items() if k not in PIPELINE_KEYS}


PointKey = tuple[str, str, int, int]  # optim, setup, params, tokens


def ladder_points(pairs: Sequence[Pair]) -> dict[PointKey, list[Pair]]:
    """The pairs by ladder point, each point's by seed; a point whose runs differ in another
    setting than the seed is refused (it would average two experiments)."""
    points: dict[PointKey, list[Pair]] = {}
    for pair in sorted(pairs, key=lambda p: (p.optim, p.setup, p.params, p.tokens, p.seed)):
        points.setdefault((pair.optim, pair.setup, pair.params, pair.tokens), []).append(pair)
    for (optim, setup, params, tokens), members in points.items():
        kinds = {json.dumps(_without_seed(p.sync), sort_keys=True) for p in members}
        if len(kinds) > 1:
            settings = [_without_seed(p.sync) for p in members]
            varied = sorted(k for k in settings[0] if len({repr(s[k]) for s in settings}) > 1)
            raise ReportError(
                f"the ladder point {optim} {setup} at {params:,} parameters and {tokens:,} "
                f"tokens holds runs that differ in {', '.join(varied)}, not only in the seed; "
                f"choose one with --where (e.g. --where {varied[0]}=...)"
            )
    return points


def _without_seed(run: RecordedRun) -> dict:
    return {k: v for k, v in run.settings.items() if k != "seed"}


def fit_laws(points: dict[PointKey, list[Pair]]) -> list[Fit]:
    """Every quantity's law for every optimizer and delayed setup among ``points``."""
    by_setup: dict[tuple[str, str], list[tuple[int, int, list[Pair]]]] = {}
    for (optim, setup, params, tokens), members in points.items():
        by_setup.setdefault((optim, setup), []).append((params, tokens, members))
    fits = []
    for (optim, setup), rungs in sorted(by_setup.items()):
        for quantity in QUANTITIES:
            measured = []
            for params, tokens, members in rungs:
                values = [v for p in members if (v := p.value(quantity)) is not None]
                if values:
                    measured.append(Point(params, tokens, tuple(values)))
            fits.append(fit_law(quantity, optim, setup, measured))
    return fits


# --- the study's table ----------------------------------------------------------------------

PAPER = (
    "Zmushko, Petrov, Abdullaev, Khrushchev and Horváth (2026), One-Step Gradient Delay is Not "
    "a Barrier for Large-Scale Asynchronous Pipeline Parallel LLM Pretraining, arXiv:2606.30634"
)
# The study's dense 360 M model has SmolLM2-360M's shape (model/presets.py); the fit's size axis
# is its non-embedding parameters. Its token count is not in this table: --paper-tokens.
PAPER_PRESET = "smollm2-360m"


@dataclass(frozen=True)
class PaperFigure:
    """One of the study's figures at 360 M parameters, and the setup of ours it stands for."""

    optim: str
    setup: str
    gap: float
    sync_loss: float | None  # None: the study's figure we quote is the gap alone
    row: str  # what the study reports

    @property
    def relative_gap(self) -> float | None:
        return None if self.sync_loss is None else self.gap / self.sync_loss


PAPER_FIGURES = (
    PaperFigure("muon", "2bw", 2.590 - 2.578, 2.578, "Muon: sync 2.578, 2bw 2.590"),
    # the study's correction is EF; correction=auto takes EF for Muon under 2bw (γ = 1.5)
    PaperFigure("muon", "2bw+auto", 2.583 - 2.578, 2.578, "Muon: sync 2.578, 2bw+EF 2.583"),
    PaperFigure("adamw", "2bw", 0.28, None, "AdamW: 2bw's gap about 0.28"),
)


def paper_params() -> int:
    return non_embedding_parameters(PRESETS[PAPER_PRESET])


@dataclass(frozen=True)
class Check:
    """A law's prediction at the study's setting beside the study's figure."""

    figure: PaperFigure
    law: Law
    paper: float
    predicted: float
    band: tuple[float, float]  # the law's LEVEL bootstrap interval
    beyond: tuple[float, float]  # how many times outside the measured size and tokens

    @property
    def inside(self) -> bool:
        return self.band[0] <= self.paper <= self.band[1]

    @property
    def ratio(self) -> float:
        """Predicted over the study's: above 1 the law overestimates."""
        return self.predicted / self.paper

    @property
    def miss(self) -> float:
        """How many times the study's figure lies outside the band (1.0: inside)."""
        low, high = self.band
        if self.paper > high:
            return self.paper / high
        return low / self.paper if self.paper < low else 1.0


def paper_checks(laws: Sequence[Law], tokens: float) -> tuple[list[Check], list[str]]:
    """Each of the study's figures against the law of its optimizer, setup and quantity at
    the study's size and ``tokens``; and the figures no law covers."""
    params = paper_params()
    checks, missing = [], []
    for figure in PAPER_FIGURES:
        for quantity, paper in (("gap", figure.gap), ("relative_gap", figure.relative_gap)):
            if paper is None:
                continue
            law = find_law(list(laws), quantity, figure.optim, figure.setup)
            if law is None:
                missing.append(f"{figure.optim} {figure.setup} {quantity}")
                continue
            band = law.interval(params, tokens, LEVEL)
            value = law.value(params, tokens)
            checks.append(Check(figure, law, paper, value, band, law.outside(params, tokens)))
    return checks, missing
