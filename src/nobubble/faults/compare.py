"""What a resumed run lost against its uninterrupted twin: its end, metrics lines or the values
in them, its final weights. Nothing lost is an exact resume."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from nobubble.checkpoint.files import CheckpointError, checkpoint_step, newest_weights
from nobubble.json_files import DamagedFile
from nobubble.runfolder.folder import FINISHED
from nobubble.runfolder.reading import read_metrics, read_summary, sealed_checkpoints, stop_of

# The values of a metrics line that an exact resume repeats bit for bit (times are not).
COMPARED = ("train_loss", "val_loss", "val_bpb", "grad_norm")


def _steps(steps: Sequence[int]) -> str:
    shown = ", ".join(map(str, steps[:5]))
    return (
        f"step {shown}"
        if len(steps) == 1
        else f"{len(steps)} steps ({shown}{', ...' * (len(steps) > 5)})"
    )


def metrics_lost(rows: Sequence[Mapping[str, Any]], twin: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the metrics lines ``rows`` lack or get wrong against the twin's: a step without
    its line or with two, a step the twin never logged, a value of :data:`COMPARED` missing
    or different (each kind said once, with the steps)."""
    by_step: dict[int, Mapping[str, Any]] = {}
    twice = []
    for row in rows:
        if row["step"] in by_step:
            twice.append(row["step"])
        by_step[row["step"]] = row
    expected = {row["step"]: row for row in twin}
    lost = []
    missing = sorted(expected.keys() - by_step.keys())
    if missing:
        lost.append(f"no metrics line for {_steps(missing)}")
    if twice:
        lost.append(f"two metrics lines for {_steps(sorted(set(twice)))}")
    extra = sorted(by_step.keys() - expected.keys())
    if extra:
        lost.append(f"metrics lines the twin does not have, for {_steps(extra)}")
    for key in COMPARED:
        gone, differ = [], []
        for step in sorted(expected.keys() & by_step.keys()):
            if key not in expected[step]:
                continue
            if key not in by_step[step]:
                gone.append(step)
            elif by_step[step][key] != expected[step][key]:
                differ.append(step)
        if gone:
            lost.append(f"{key} missing at {_steps(gone)}")
        if differ:
            first = differ[0]
            ours, theirs = by_step[first][key], expected[first][key]
            lost.append(f"{key} differs at {_steps(differ)}: {ours!r} vs the twin's {theirs!r}")
    return lost


def weights_lost(
    weights: Mapping[str, torch.Tensor], twin: Mapping[str, torch.Tensor]
) -> list[str]:
    """Parameters missing, extra, or not bitwise the twin's (with the largest difference)."""
    lost = [f"weight {name} missing" for name in sorted(twin.keys() - weights.keys())]
    lost += [f"weight {name} not in the twin" for name in sorted(weights.keys() - twin.keys())]
    for name in sorted(weights.keys() & twin.keys()):
        ours, theirs = weights[name], twin[name]
        if ours.shape != theirs.shape:
            lost.append(
                f"weight {name} has shape {tuple(ours.shape)}, the twin's {tuple(theirs.shape)}"
            )
        elif not torch.equal(ours, theirs):
            gap = (ours.double() - theirs.double()).abs().max().item()
            lost.append(f"weight {name} differs from the twin's by up to {gap:.3g}")
    return lost


def final_weights(run: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """(step, newest weight of every parameter) of the run's newest sealed checkpoint;
    :class:`CheckpointError` if it fails its checksums, or there is none."""
    sealed = sealed_checkpoints(run)
    if not sealed:
        raise CheckpointError(f"{run} has no checkpoint")
    return checkpoint_step(sealed[-1]), newest_weights(sealed[-1])


def what_was_lost(run: Path, twin: Path) -> list[str]:
    """Everything the run folder ``run`` lacks or has wrong against ``twin`` (empty: exact)."""
    lost = []
    try:
        summary = read_summary(run)
    except DamagedFile as exc:
        lost.append(str(exc))
        summary = {}
    stopped = "no summary.json" if summary is None else stop_of(summary)
    if stopped != FINISHED:
        lost.append(f"did not finish ({stopped})")
    metrics = read_metrics(run, "")
    if metrics.damaged:
        lost.append(f"{metrics.damaged} damaged line(s) in metrics.jsonl")
    lost += metrics_lost(metrics.records, read_metrics(twin, "").records)
    try:
        step, weights = final_weights(run)
    except CheckpointError as exc:
        return [*lost, f"no final weights: {exc}"]
    twin_step, twin_weights = final_weights(twin)
    if step != twin_step:
        lost.append(f"newest checkpoint at step {step}, the twin's at {twin_step}")
    return lost + weights_lost(weights, twin_weights)
