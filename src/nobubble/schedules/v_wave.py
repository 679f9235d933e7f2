"""The steady state of a V without a flush (``2bw-v``, a candidate under study, not a schedule
the engines run): where each action of a microbatch starts within its rank's period.

With the V placement (rank r holds model stages r and 2P-1-r) and no flush, every rank runs,
per microbatch, a forward and a whole backward of each of its two stages. With a model stage's
forward taking one slot and its backward two (B = 2F), those four actions fill a period of
:data:`PERIOD` slots, and a rank that runs one microbatch per period never idles. A microbatch's
actions form one chain: forwards down the ranks and back up, then backwards down and back up.
The wave places the chain's actions in that order, each at the earliest slot at which its input
is ready and its rank has the action's slots free (modulo the period); every microbatch repeats
microbatch 0's wave one period later. A rank's order is its actions sorted by start time, so it
is one that some timing runs without a deadlock, whatever the actual times; the activations a
rank holds follow from the order alone.
"""

from __future__ import annotations

from collections.abc import Iterator

from nobubble.layout import ParallelLayout, V
from nobubble.schedules.ir import ActionKind

SLOTS = {ActionKind.F: 1, ActionKind.B: 2}  # a model stage's forward and whole backward
PERIOD = 2 * (SLOTS[ActionKind.F] + SLOTS[ActionKind.B])  # a rank's four actions, one microbatch


def chain(ranks: int) -> list[tuple[ActionKind, int]]:
    """One microbatch's (kind, model stage) actions in dependency order, on 2P model stages."""
    stages = range(2 * ranks)
    return [(ActionKind.F, s) for s in stages] + [(ActionKind.B, s) for s in reversed(stages)]


def wave_offsets(ranks: int) -> dict[tuple[ActionKind, int], int]:
    """The start slot of each (kind, model stage) of microbatch 0 in the steady state."""
    layout = ParallelLayout(ranks, chunks=2, placement=V)
    taken: list[set[int]] = [set() for _ in range(ranks)]  # slots modulo the period
    offsets: dict[tuple[ActionKind, int], int] = {}
    ready = 0
    for kind, stage in chain(ranks):
        rank, slots = layout.position_of(stage), SLOTS[kind]
        start = ready
        while any((start + i) % PERIOD in taken[rank] for i in range(slots)):
            start += 1
        taken[rank].update((start + i) % PERIOD for i in range(slots))
        offsets[kind, stage] = start
        ready = start + slots
    return offsets


def wave_lag(ranks: int) -> int:
    """Periods from a microbatch's first forward to the start of its last backward (stage 0's):
    how many microbatches later than its forward stage 0 runs its backward."""
    return wave_offsets(ranks)[ActionKind.B, 0] // PERIOD


def wave_order(rank: int, ranks: int, count: int) -> Iterator[tuple[ActionKind, int, int]]:
    """Rank ``rank``'s (kind, model stage, microbatch index) for microbatches 0 .. count-1, in
    the order of their start times in the wave: in period j, its actions by slot, each of the
    microbatch that reaches it then (j minus the action's lag in periods)."""
    layout = ParallelLayout(ranks, chunks=2, placement=V)
    mine = sorted(
        (start % PERIOD, start // PERIOD, kind, stage)
        for (kind, stage), start in wave_offsets(ranks).items()
        if layout.position_of(stage) == rank
    )
    longest = max(lag for _, lag, _, _ in mine)
    for period in range(count + longest):
        for _, lag, kind, stage in mine:
            if 0 <= period - lag < count:
                yield kind, stage, period - lag


def wave_peak_activations(rank: int, ranks: int) -> int:
    """The most forwards (counted per model stage, half a rank's layers each) whose backward has
    not run that rank ``rank`` holds at once in the wave: the steady state's, which no shorter
    run exceeds (it runs the same order with actions left out)."""
    count = 4 * (max(wave_offsets(ranks).values()) // PERIOD + 1)
    held = peak = 0
    for kind, _, _ in wave_order(rank, ranks, count):
        held += 1 if kind is ActionKind.F else -1
        peak = max(peak, held)
    return peak
