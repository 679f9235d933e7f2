"""How a finished run of the GPU check compares with its one-process reference: its losses and
final weights, the gaps between them, and the verdict by what the row expects
(``OUT/parity/NAME.json``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nobubble.checkpoint.files import newest_weights
from nobubble.destinations import check_output_folder
from nobubble.gpu_check.plan import planned_run
from nobubble.gpu_check.runs import CLOSE, REPEATS
from nobubble.json_files import write_json_atomic
from nobubble.runfolder.folder import FINISHED
from nobubble.runfolder.reading import checkpoints, read_metrics, read_summary, stop_of

CLOSE_RTOL = 1e-2  # a row expected close: another summation order, compiled kernels
NOISE_FACTOR = 10.0  # a row expected bitwise, on a GPU that does not repeat runs bitwise


@dataclass
class Outcome:
    """What a finished run left: its losses (every step's training loss, then the evaluations')
    and its final weights."""

    losses: list[float]
    weights: dict[str, torch.Tensor]


def finished(run_dir: Path) -> dict[str, Any] | None:
    """The summary of the run in ``run_dir`` if it finished, else None."""
    summary = read_summary(run_dir) if run_dir.is_dir() else None
    return summary if summary is not None and stop_of(summary) == FINISHED else None


def outcome(run_dir: Path) -> Outcome | None:
    """The losses and final weights of a finished run (None if it did not finish)."""
    summary = finished(run_dir)
    saved = checkpoints(run_dir)
    if summary is None or not saved:
        return None
    rows = read_metrics(run_dir, "rerun the check").records
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    losses += [r["val_loss"] for r in rows if "val_loss" in r]
    return Outcome(losses, newest_weights(saved[-1]))


def parity(run: Outcome, reference: Outcome) -> dict[str, Any]:
    """How far ``run`` is from ``reference``: whether the losses and the weights are equal, the
    largest relative loss gap and the largest weight gap (None where they cannot be compared:
    another number of losses, other parameters)."""
    comparable = len(run.losses) == len(reference.losses) and bool(run.losses)
    pairs = list(zip(run.losses, reference.losses, strict=False))
    same_names = run.weights.keys() == reference.weights.keys() and bool(run.weights)
    gaps = [
        (run.weights[k].float() - w.float()).abs().max().item()
        for k, w in (_items(reference) if same_names else [])
    ]
    return {
        "losses_equal": comparable and all(a == b for a, b in pairs),
        "weights_equal": same_names
        and all(torch.equal(run.weights[k], w) for k, w in _items(reference)),
        "max_loss_rel_gap": (
            max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs) if comparable else None
        ),
        "max_weight_gap": max(gaps) if same_names else None,
    }


def _items(outcome: Outcome) -> list[tuple[str, torch.Tensor]]:
    return sorted(outcome.weights.items())


def verdict(gaps: dict[str, Any] | None, expect: str, noise: float | None) -> str:
    """``bitwise``; ``noise floor`` (the repeat, not bitwise: this GPU's kernels are not
    deterministic); ``within noise`` (a row expected bitwise, within :data:`NOISE_FACTOR` times
    ``noise``, the repeat's loss gap); ``close`` (expected close, within :data:`CLOSE_RTOL`);
    ``DIFFERS``; ``failed`` (no result)."""
    if gaps is None:
        return "failed"
    if gaps["losses_equal"] and gaps["weights_equal"]:
        return "bitwise"
    gap = gaps["max_loss_rel_gap"]
    if gap is None or gaps["max_weight_gap"] is None:
        return "DIFFERS"
    if expect == REPEATS:
        return "noise floor"
    if expect == CLOSE:
        return "close" if gap <= CLOSE_RTOL else "DIFFERS"
    if noise and gap <= NOISE_FACTOR * noise:
        return "within noise"
    return "DIFFERS"


def compare(out: Path, name: str) -> dict[str, Any]:
    """Compare run ``name`` of ``out``'s plan with its reference; write it into
    ``out/parity/NAME.json`` and return it."""
    run = planned_run(out, name)
    check_output_folder(out / "parity", "OUT")
    mine, theirs = outcome(out / "runs" / name), outcome(out / "runs" / run.reference)
    gaps = parity(mine, theirs) if mine and theirs else None
    result = {"run": name, "reference": run.reference, **(gaps or {})}
    if mine is None:
        result["failed"] = "the run did not finish"
    elif theirs is None:
        result["failed"] = f"its reference {run.reference} did not finish"
    (out / "parity").mkdir(exist_ok=True)
    write_json_atomic(out / "parity" / f"{name}.json", result)
    return result
