"""An asynchronous V (2bw-v) against 2bw, ZB-V and 1F1B, from the IR and the timing simulator.

Prints the table of docs/schedules.md, "An asynchronous V: why not (yet)": per schedule, P and M,
the activations held on the fullest rank and on every rank (in a loop stage's activations: a V
stage holds half a rank's layers, so its microbatches count half), the weight versions held per
rank (in a loop stage's weights), the step time and the idle time per rank over the run, with a
forward of a rank's layers taking 1 and its backward 2 (a V stage: half of each; ZB-V's weight
gradient half of the backward). Every schedule's list passes its invariants first. Then
2bw-v's wave alone up to P = 64 (no simulation needed: its order gives its peak).

    PYTHONPATH=src python experiments/async_v.py [--steps 4]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from nobubble.schedules import check_invariants, generate, lower, simulate
from nobubble.schedules.registry import CANDIDATES, ScheduleSpec, schedule_spec
from nobubble.schedules.timing import split_rank_times
from nobubble.schedules.v_wave import wave_lag, wave_peak_activations

SCHEDULES = ("1f1b", "2bw", "zb-v", "2bw-v")
FORWARD, BACKWARD = 1.0, 2.0  # one rank's layers (a loop stage)


@dataclass(frozen=True)
class Row:
    schedule: str
    ranks: int
    microbatches: int
    steps: int
    activations: tuple[float, ...]  # per rank, most held at once, in a loop stage's
    weight_versions: tuple[float, ...]  # per rank, most held, in a loop stage's weights
    makespan: float
    idle: float  # the most any rank idles over the run

    @property
    def fullest(self) -> float:
        return max(self.activations)

    @property
    def step_time(self) -> float:
        return self.makespan / self.steps


def spec_of(name: str) -> ScheduleSpec:
    """A registered schedule's spec or a candidate's."""
    return CANDIDATES[name] if name in CANDIDATES else schedule_spec(name)


def measure(name: str, ranks: int, microbatches: int, steps: int) -> Row:
    """Generate, check and simulate one schedule; a list that breaks its invariants raises."""
    spec = spec_of(name)
    actions = generate(spec, ranks, microbatches, steps)
    result = simulate(
        lower(actions),
        fwd=split_rank_times(FORWARD, actions),
        bwd=split_rank_times(BACKWARD, actions),
    )
    problems = check_invariants(actions, spec, result)
    if problems:
        raise AssertionError(f"{name} P={ranks} M={microbatches}: {problems[:3]}")
    chunks = result.stages // ranks
    return Row(
        schedule=name,
        ranks=ranks,
        microbatches=microbatches,
        steps=steps,
        activations=tuple(held / chunks for held in result.peak_activations),
        weight_versions=tuple(
            sum(result.stage_weight_versions[s] for s in stages) / chunks
            for stages in result.rank_stages
        ),
        makespan=result.makespan,
        idle=max(result.idle),
    )


def rows(shapes: list[tuple[int, int]], steps: int) -> list[Row]:
    """Every schedule at every (P, M) of ``shapes``; a schedule whose rule on M refuses the
    shape is left out (2bw-v's needs more microbatches than 2bw's from P = 3 on)."""
    out = []
    for ranks, microbatches in shapes:
        for name in SCHEDULES:
            if spec_of(name).microbatch_problem(ranks, microbatches) is None:
                out.append(measure(name, ranks, microbatches, steps))
    return out


def _figure(value: float) -> str:
    return f"{value:g}"


def markdown(table: list[Row]) -> str:
    lines = [
        "| P | M | schedule | activations, fullest rank | activations per rank | weight versions "
        "per rank | step time | idle per rank over the run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in table:
        lines.append(
            f"| {row.ranks} | {row.microbatches} | {row.schedule} | {_figure(row.fullest)} | "
            f"{', '.join(map(_figure, row.activations))} | "
            f"{', '.join(map(_figure, row.weight_versions))} | {_figure(row.step_time)} | "
            f"{_figure(row.idle)} |"
        )
    return "\n".join(lines)


def wave_markdown(all_ranks: tuple[int, ...]) -> str:
    """2bw-v's wave alone, for larger P: its fullest rank against 2bw's first (P) and against
    the bound no V order can go below ((P+1)/2: a V stage's round trips with no wait), all in a
    loop stage's activations, and its least M (2bw's: P)."""
    lines = [
        "| P | 2bw-v, fullest rank | 2bw, first rank | 2bw-v / 2bw | bound (P+1)/2 "
        "| 2bw-v's least M |",
        "|---|---|---|---|---|---|",
    ]
    for ranks in all_ranks:
        fullest = max(wave_peak_activations(r, ranks) for r in range(ranks)) / 2
        lines.append(
            f"| {ranks} | {_figure(fullest)} | {ranks} | {fullest / ranks:.2f} | "
            f"{_figure((ranks + 1) / 2)} | {wave_lag(ranks)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    shapes = [(p, m) for p in (2, 4, 8) for m in (2 * p, 4 * p)]
    print(markdown(rows(shapes, args.steps)))
    print()
    print(wave_markdown((2, 3, 4, 5, 6, 8, 12, 16, 32, 64)))


if __name__ == "__main__":
    main()
