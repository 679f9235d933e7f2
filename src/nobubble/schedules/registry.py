"""Every pipeline schedule's properties, in one place that every module reads.

A :class:`ScheduleSpec` says what a schedule promises (its gradient delay and the weight
versions it may hold per stage), what it needs (its rule on the number of microbatches, whether it
splits the backward or puts several stages on a rank) and where it runs. The generators build the
action lists; this module says what those lists must satisfy and what a configuration may ask
for. ``sync`` is an entry too: plain gradient accumulation, the semantics of 1f1b under
another name (``same_as``), which a pipeline runs in 1F1B order; listings of distinct pipeline
orders (:data:`PIPELINE_SCHEDULES`) leave it out.

A stage's gradient delay d says which weight version its gradients are computed at: the gradient
applied at step t was computed at version max(t - d, 0) (:func:`nobubble.versions.gradient_version`)
and version v is the weights after v optimizer steps. Both backends read the delays here: the
one-process engine keeps that many old versions per stage, the pipeline runtime's schedule
produces exactly these versions (its invariants are checked).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass

from nobubble.layout import LOOP, V
from nobubble.schedules.ir import ScheduleError
from nobubble.schedules.v_wave import wave_lag, wave_peak_activations


def _no_delay(stage: int, stages: int) -> int:
    return 0


def _one_step(stage: int, stages: int) -> int:
    return 1


def _downstream_stages(stage: int, stages: int) -> int:
    return stages - 1 - stage


def _one_f_one_b_activations(rank: int, ranks: int, microbatches: int, chunks: int) -> int:
    return ranks - rank  # P-1-r warm-up forwards and the one whose backward comes next


def _all_activations(rank: int, ranks: int, microbatches: int, chunks: int) -> int:
    return microbatches  # every forward of the step before the first backward


def _zero_bubble_activations(rank: int, ranks: int, microbatches: int, chunks: int) -> int:
    return ranks  # 1F1B's P-r, and up to r forwards whose W waits


def _zero_bubble_h2_activations(rank: int, ranks: int, microbatches: int, chunks: int) -> int:
    return min(2 * ranks, microbatches)  # 2(P-1-r)+1 warm-up, one more, up to 2r W's waiting


def _interleaved_activations(rank: int, ranks: int, microbatches: int, chunks: int) -> int:
    warmup = 2 * (ranks - 1 - rank) + (chunks - 1) * ranks  # counted per stage (1/v of a rank)
    return min(warmup + 1, microbatches * chunks)


def _zero_bubble_v_activations(rank: int, ranks: int, microbatches: int, chunks: int) -> int:
    """ZB-V: 2P forwards of its two stages at most (P of a whole rank's, 1F1B's first rank's, on
    every rank): its first stage's 2P-1 and one of its second at the end of the warm-up, then
    one freed (W) for each made (F). With fewer microbatches, the M of its first stage and r + 1
    of its second before its first W, and never more than all 2M."""
    return min(2 * ranks, microbatches + 1 + rank, 2 * microbatches)


def _dualpipev_activations(rank: int, ranks: int, microbatches: int, chunks: int) -> int:
    """DualPipeV: 2P forwards after its warm-up on every rank, then each I or B frees one and
    each F makes one; an overlapped F&B holds its forward's activations while its backward's
    are still there: 2P + 1 (half a rank's more than ZB-V)."""
    return 2 * ranks + 1


def _v_wave_activations(rank: int, ranks: int, microbatches: int, chunks: int) -> int:
    """2bw-v: the steady state's peak on the rank (nobubble.schedules.v_wave), never more than
    the 2M forwards of a step's two stages."""
    return min(wave_peak_activations(rank, ranks), 2 * microbatches)


def _any_microbatches(stages: int, microbatches: int) -> str | None:
    return None


def _multiple_of_stages(stages: int, microbatches: int) -> str | None:
    if microbatches % stages:
        return (
            f"interleaved-1f1b runs microbatches in groups of P through each rank's stages, so M "
            f"must be a multiple of P (got M={microbatches}, P={stages}); use "
            f"{-(-microbatches // stages) * stages} microbatches"
        )
    return None


def _twice_the_stages(stages: int, microbatches: int) -> str | None:
    if microbatches < 2 * stages:
        return (
            f"dualpipev needs microbatches >= 2 x stages (got M={microbatches}, P={stages}): "
            "the published schedule (DeepSeek's DualPipeV, torch's ScheduleDualPipeV) is "
            "defined from 2P on, its warm-up alone running 2P-1 forwards of the first stage and "
            "one of the last on the first rank, before M-2P+r+1 rounds of overlapped forwards "
            f"and backwards on rank r; use {2 * stages} or more microbatches"
        )
    return None


def _at_least_stages(stages: int, microbatches: int) -> str | None:
    if stages > 1 and microbatches < stages:
        return (
            f"2bw needs microbatches >= stages (got M={microbatches}, P={stages}): stage 0 runs "
            "P-1 forwards ahead of its backwards, so minibatch t+1 starts before minibatch t has "
            "finished there, and its forwards need the weight version made by minibatch t-1's "
            "step; with M < P-1 that version does not exist yet when they run. PipeDream-2BW and "
            f"nobubble require M >= P (one microbatch of slack); use {stages} or more microbatches"
        )
    return None


def _at_least_wave_lag(stages: int, microbatches: int) -> str | None:
    lag = wave_lag(stages)
    if stages > 1 and microbatches < lag:
        return (
            f"2bw-v needs microbatches >= {lag} on {stages} stages (got M={microbatches}): stage 0 "
            f"runs a microbatch's backward {lag} microbatches after its forward (the V's wave, "
            "nobubble.schedules.v_wave), and the forwards of step t+2 need the weight version "
            f"that step t's last backward makes; use {lag} or more microbatches"
        )
    return None


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    summary: str
    # microbatch order per rank: gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, dualpipev
    # (generators.py)
    order: str
    flushes: bool  # synchronous: every step's gradients are computed at the weights it updates
    # 2bw: every forward of step t uses version t-1, even once version t exists (double buffer);
    # otherwise a forward uses the newest version the stage holds
    forwards_use_previous_step: bool = False
    # every microbatch is its own optimizer step (pipedream): a training run's step is then one
    # microbatch, and a generated schedule of M microbatches per "step" runs M optimizer steps
    step_per_microbatch: bool = False
    delay_rule: Callable[[int, int], int] = _no_delay  # (stage, stages) -> delay in steps
    # (stages, M) -> why it cannot run, or None
    microbatch_rule: Callable[[int, int], str | None] = _any_microbatches
    # (rank, ranks, M, chunks) -> the most forwards a rank holds activations of (until their B,
    # or W), counted per stage
    activation_rule: Callable[[int, int, int, int], int] = _one_f_one_b_activations
    default_chunks: int = 1  # stages per rank; above 1, the schedule takes any number >= 2
    # which rank holds which model stage (nobubble.layout): loop, stage c·P + r on rank r; v,
    # stages r and 2P-1-r on rank r (exactly 2 per rank)
    placement: str = LOOP
    split_backward: bool = False  # backwards are I + W (zero-bubble), not B (or some of them)
    # another name for that schedule's semantics and order (sync: 1f1b); left out of listings
    same_as: str | None = None

    def delay(self, stage: int, stages: int) -> int:
        """How many versions older than the weights it updates a stage's applied gradient is."""
        return self.delay_rule(stage, stages)

    def delays(self, stages: int) -> list[int]:
        return [self.delay(s, stages) for s in range(stages)]

    def can_tie(self, stages: int) -> bool:
        """Whether a weight that the first and the last of ``stages`` model stages share (tied
        embeddings) is read at one version by both: their gradient delays are equal."""
        return self.delay(0, stages) == self.delay(stages - 1, stages)

    def pipeline_can_tie(self, stages: int) -> bool:
        """Whether the pipeline runtime (torchrun) trains tied embeddings on ``stages`` model
        stages: :meth:`can_tie`, and not under the V placement, whose one process holding the
        embedding and the head does not yet sum its two copies of the tied weight (the
        one-process engine runs it exactly: docs/pipeline.md)."""
        return self.can_tie(stages) and self.placement != V

    def version_budget(self, stage: int, stages: int) -> int:
        """The most weight versions the schedule may hold at a stage: the one it updates and
        every older one a gradient still to be applied was (or will be) computed at."""
        return self.delay(stage, stages) + 1

    def activation_budget(self, rank: int, ranks: int, microbatches: int, chunks: int = 1) -> int:
        """The most microbatches' activations the schedule may hold on a rank at once."""
        return self.activation_rule(rank, ranks, microbatches, chunks)

    def microbatch_problem(self, stages: int, microbatches: int) -> str | None:
        """Why ``microbatches`` per step cannot run on ``stages`` stages, or None."""
        return self.microbatch_rule(stages, microbatches)

    @property
    def interleaved(self) -> bool:
        """Several stages per rank."""
        return self.default_chunks > 1

    @property
    def takes_chunks(self) -> bool:
        """Whether the ``chunks`` setting picks its stages per rank (interleaved-1f1b); a V
        schedule always runs its own 2."""
        return self.interleaved and self.placement != V

    def chunk_problem(self, chunks: int) -> str | None:
        """Why ``chunks`` stages per rank cannot run, or None."""
        if self.placement == V and chunks != 2:
            return (
                f"{self.name} places exactly 2 stages on each rank (r and 2P-1-r, a V), got "
                f"chunks={chunks}; leave chunks to the schedule"
            )
        if self.interleaved and chunks < 2:
            return f"{self.name} needs at least 2 stages per rank (chunks), got {chunks}"
        if not self.interleaved and chunks != 1:
            return f"{self.name} runs one stage per rank; chunks={chunks} needs interleaved-1f1b"
        return None


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec(
            "sync",
            "no pipeline: plain gradient accumulation (the semantics of 1f1b; a pipeline runs it "
            "in 1F1B order)",
            order="1f1b",
            flushes=True,
            same_as="1f1b",
        ),
        ScheduleSpec(
            "gpipe",
            "all forwards, then all backwards, flush before each step",
            order="gpipe",
            flushes=True,
            activation_rule=_all_activations,
        ),
        ScheduleSpec(
            "1f1b",
            "one forward, one backward after a warm-up of P-1-s forwards; flush before each step",
            order="1f1b",
            flushes=True,
        ),
        ScheduleSpec(
            "2bw",
            "1F1B without a flush; forwards of step t use the weights of step t-1 (PipeDream-2BW)",
            order="1f1b",
            flushes=False,
            forwards_use_previous_step=True,
            delay_rule=_one_step,
            microbatch_rule=_at_least_stages,
        ),
        ScheduleSpec(
            "pipedream",
            "1F1B without a flush, an optimizer step after every microbatch, weight stashing",
            order="1f1b",
            flushes=False,
            step_per_microbatch=True,
            delay_rule=_downstream_stages,
        ),
        ScheduleSpec(
            "interleaved-1f1b",
            "1F1B over v stages per rank (Megatron-LM): the bubble shrinks by v, the messages "
            "grow by v; flush before each step",
            order="interleaved",
            flushes=True,
            microbatch_rule=_multiple_of_stages,
            activation_rule=_interleaved_activations,
            default_chunks=2,
        ),
        ScheduleSpec(
            "zb-h1",
            "1F1B with each backward split into input and weight gradients, the weight ones "
            "filling the cool-down (zero-bubble H1); flush before each step",
            order="zb-h1",
            flushes=True,
            activation_rule=_zero_bubble_activations,
            split_backward=True,
        ),
        ScheduleSpec(
            "zb-h2",
            "zero-bubble H2: more warm-up forwards and up to 2s weight gradients kept back, "
            "so the next step's forwards overlap this step's weight gradients; twice ZB-H1's "
            "activations; flush before each step (per stage)",
            order="zb-h2",
            flushes=True,
            activation_rule=_zero_bubble_h2_activations,
            split_backward=True,
        ),
        ScheduleSpec(
            "zb-v",
            "zero bubble with the V placement (Qi et al.): rank r holds stages r and 2P-1-r, "
            "backwards split into I and W, near-zero bubble at 1F1B's activation memory; flush "
            "before each step",
            order="zb-v",
            flushes=True,
            activation_rule=_zero_bubble_v_activations,
            default_chunks=2,
            placement=V,
            split_backward=True,
        ),
        ScheduleSpec(
            "dualpipev",
            "DeepSeek-V3's DualPipe cut in half: the V placement, a forward and a backward of "
            "the rank's two stages overlapped as one action (F&B), bubble (P-1)(F&B+B-3W); "
            "M >= 2P; flush before each step",
            order="dualpipev",
            flushes=True,
            microbatch_rule=_twice_the_stages,
            activation_rule=_dualpipev_activations,
            default_chunks=2,
            placement=V,
            split_backward=True,
        ),
    )
}
# every name the ``schedule`` setting and ``nobubble schedule`` know; both engines run each
SCHEDULE_NAMES = tuple(SCHEDULES)
# the distinct pipeline orders that listings and comparisons take (the planner, the GPU check,
# `nobubble schedule --schedule all`); sync is 1f1b
PIPELINE_SCHEDULES = tuple(name for name, spec in SCHEDULES.items() if spec.same_as is None)
# the schedules whose gradients are computed at the weights they update (sync included)
SYNCHRONOUS_SCHEDULES = frozenset(name for name, spec in SCHEDULES.items() if spec.flushes)


# schedules under study (docs/schedules.md, "An asynchronous V (2bw-v)"): generated,
# checked by the invariants and timed by the simulator when their spec is passed in, but no
# engine runs them and no setting names them
CANDIDATES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec(
            "2bw-v",
            "2bw's one-step delay, no flush, with the V placement (rank r holds stages r and "
            "2P-1-r); each rank's order is the steady wave of nobubble.schedules.v_wave",
            order="2bw-v",
            flushes=False,
            forwards_use_previous_step=True,
            delay_rule=_one_step,
            microbatch_rule=_at_least_wave_lag,
            activation_rule=_v_wave_activations,
            default_chunks=2,
            placement=V,
        ),
    )
}


def candidate_refusal(name: str) -> str:
    """Why candidate ``name`` cannot be asked for: no engine runs it yet."""
    return (
        f"schedule {name!r} is not supported yet: it is a candidate under study that neither "
        'engine runs (docs/schedules.md, "An asynchronous V (2bw-v)"); choose one of: '
        f"{', '.join(SCHEDULE_NAMES)}"
    )


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec of pipeline schedule ``name``; a clear error naming the choices otherwise."""
    if name in CANDIDATES:
        raise ScheduleError(candidate_refusal(name))
    try:
        return SCHEDULES[name]
    except KeyError:
        close = difflib.get_close_matches(name, SCHEDULE_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ScheduleError(
            f"unknown schedule {name!r}{hint}; choose one of: {', '.join(SCHEDULE_NAMES)}"
        ) from None
