"""The CPU side of ``scripts/gpu_check.sh``: which runs to do on a machine with N GPUs, how each
compares with its one-process reference, and the table of them all (printed, and as JSON).

Every run trains SmolLM2-360M's shape (preset ``smollm2-360m``, tied embeddings) for a few steps
on short sequences in bfloat16, so that a run, its final checkpoint included, takes seconds. A
row is a pipeline under torchrun: with one GPU its processes share the GPU over gloo under the
NCCL emulator (``dist_backend=gloo emulate_nccl=true``: every CUDA path of the pipeline but NCCL
itself, with NCCL's routes and order), with two or more GPUs they run on NCCL, a GPU each (and
one row still shares a GPU over gloo). Each row is compared with a one-process run of the same
semantics. Gradient clipping is off, the one rule that depends on how the model is cut, so
every synchronous schedule computes what one-process 1F1B on two stages computes, whatever its
stages and chunks (the tied weight's two copies are summed alike); 2bw what one-process 2bw
computes (delay 1 on every stage); pipedream (per-stage delays, untied as it must be) what
one-process pipedream on the same stages computes. The 2bw reference runs twice: whether a GPU
repeats a run bit for bit (its kernels may not be deterministic) sets what a row may differ by.

    python -m nobubble.gpu_check plan --gpus N --out OUT   # OUT/plan.json; a run a line
    python -m nobubble.gpu_check compare OUT NAME          # OUT/parity/NAME.json
    python -m nobubble.gpu_check table OUT                 # the table, OUT/table.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nobubble.checkpoint.files import checkpoint_folders, newest_weights
from nobubble.config import ConfigError
from nobubble.config.flags import OneLineParser, whole
from nobubble.destinations import check_output_file, check_output_folder, make_output_folder
from nobubble.files import damaged, read_json_lines, read_json_object, write_json_atomic
from nobubble.runfolder import FINISHED, read_summary, stop_of

# the settings of every run (a row's own come after): the model and where it runs, then how
# long and how it trains (without clipping: see the module's docstring)
MODEL = ("preset=smollm2-360m", "seq_len=256", "batch_size=16", "dtype=bfloat16", "device=cuda")
MODEL += ("p2p_timeout_s=120",)  # a hang fails within the check's time, naming what it waited for
TRAINING = ("steps=6", "eval_every=0", "eval_batches=2", "optim=adamw", "lr=3e-4")
TRAINING += ("warmup_steps=2", "grad_clip=0")
SYNC = ("gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b")
SCHEDULES = (*SYNC, "2bw", "pipedream")
# how a row's processes talk: its settings, the table's words, its name's suffix. NCCL: a GPU
# each; gloo (emulated NCCL, or gloo's own order and sums): one GPU that the processes share
EMULATED = ("dist_backend=gloo", "emulate_nccl=true")
TRANSPORTS = {
    "nccl": (("dist_backend=nccl",), "NCCL", "nccl"),
    "emulated": (EMULATED, "gloo, emulated NCCL, one GPU shared", "gloo"),
    "gloo": (("dist_backend=gloo",), "gloo, one GPU shared", "gloo-plain"),
}

# what a row is expected to be, next to its reference: bitwise equal; close (another summation
# order, compiled kernels); a repeat of it (whatever it is: this GPU's run-to-run noise)
BITWISE, CLOSE, REPEATS = "bitwise", "close", "repeats"
CLOSE_RTOL = 1e-2  # a row expected close: another summation order, compiled kernels
NOISE_FACTOR = 10.0  # a row expected bitwise, on a GPU that does not repeat runs bitwise


FAILED = ("failed", "DIFFERS")  # the verdicts that fail the check ("not run": out of time)


@dataclass(frozen=True)
class Run:
    """One run of the check: ``settings`` come after :data:`MODEL`; ``processes`` is torchrun's
    ``--nproc-per-node`` (0: one process, no torchrun) on ``gpus`` GPUs; ``reference`` names
    the one-process run it is compared with (None: it is one), ``expect`` how closely."""

    name: str
    settings: tuple[str, ...]
    processes: int = 0
    gpus: int = 1
    reference: str | None = None
    expect: str = BITWISE
    transport: str = "one process"

    @property
    def schedule(self) -> str:
        return self.setting("schedule")

    def setting(self, key: str, default: str = "") -> str:
        values = [s.split("=", 1)[1] for s in self.settings if s.startswith(f"{key}=")]
        return values[-1] if values else default

    def line(self) -> str:
        """How the script reads it: name, processes, GPUs, reference (- for none), settings."""
        head = [self.name, str(self.processes), str(self.gpus), self.reference or "-"]
        return " ".join([*head, *MODEL, *TRAINING, *self.settings])


REFERENCES = {
    "sync": Run("one-process-sync", ("schedule=1f1b", "stages=2", "microbatches=4")),
    "2bw": Run("one-process-2bw", ("schedule=2bw", "stages=2", "microbatches=4")),
    "pipedream": Run(
        "one-process-pipedream",
        ("schedule=pipedream", "stages=2", "microbatches=1", "tie_embeddings=false"),
    ),
}
# the 2bw reference again: whether this GPU repeats a run bit for bit
REPEAT = dataclasses.replace(
    REFERENCES["2bw"],
    name="one-process-2bw-again",
    reference=REFERENCES["2bw"].name,
    expect=REPEATS,
)


def semantics(schedule: str) -> str:
    """Which reference a schedule's rows are compared with."""
    return "sync" if schedule in SYNC else schedule


def row(
    schedule: str,
    stages: int,
    transport: str,
    dp: int = 1,
    extra: tuple[str, ...] = (),
    expect: str = BITWISE,
) -> Run:
    """A pipeline row: on NCCL (a GPU a process), or on one GPU that its processes share over
    gloo (under the NCCL emulator, or not: :data:`TRANSPORTS`)."""
    micro = 1 if schedule == "pipedream" else 4
    settings = (f"schedule={schedule}", f"stages={stages}", f"microbatches={micro}")
    settings += (f"dp={dp}",) if dp > 1 else ()
    settings += ("tie_embeddings=false",) if schedule == "pipedream" else ()
    how, words, suffix = TRANSPORTS[transport]
    name = f"{schedule}-p{stages}" + (f"-dp{dp}" if dp > 1 else "") + f"-{suffix}"
    name += "-compiled" if "compile=true" in extra else ""
    processes = stages * dp
    return Run(
        name,
        settings + how + extra,
        processes,
        gpus=processes if transport == "nccl" else 1,
        reference=REFERENCES[semantics(schedule)].name,
        expect=expect,
        transport=words,
    )


def plan(gpus: int) -> list[Run]:
    """The runs for ``gpus`` GPUs, references first (the script runs them in this order and
    skips what its time budget no longer allows)."""
    if gpus < 1:
        return []
    main = "nccl" if gpus >= 2 else "emulated"
    rows = [row(schedule, 2, main) for schedule in SCHEDULES]
    # the other ways to share one GPU, once: plain gloo; with NCCL there, NCCL's emulation
    rows.append(row("2bw", 2, "gloo" if main == "emulated" else "emulated"))
    if gpus >= 4:
        rows += [row("1f1b", 4, main), row("2bw", 2, main, dp=2, expect=CLOSE)]
    if gpus >= 8:
        rows.append(row("2bw", 4, main, dp=2, expect=CLOSE))
    compiled = ("compile=true", "activation_checkpointing=true")
    rows.append(row("2bw", 2, main, extra=compiled, expect=CLOSE))
    return [*REFERENCES.values(), REPEAT, *rows]


# -- parity ------------------------------------------------------------------------------------


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
    checkpoints = checkpoint_folders(run_dir / "checkpoints")
    if summary is None or not checkpoints:
        return None
    records, _ = read_json_lines(run_dir / "metrics.jsonl", "rerun the check")
    rows = [record for _, record in records]
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    losses += [r["val_loss"] for r in rows if "val_loss" in r]
    return Outcome(losses, newest_weights(checkpoints[-1]))


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
    runs = planned(out)
    if name not in runs:
        raise ConfigError(
            f"{name} is not a run of {out / 'plan.json'}; give one of {', '.join(runs)}"
        )
    run = runs[name]
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


# -- the table ---------------------------------------------------------------------------------


def planned(out: Path) -> dict[str, Run]:
    """The plan written into ``out`` (``plan --out``), by name."""
    path = out / "plan.json"
    fix = f"write it with `python -m nobubble.gpu_check plan --gpus N --out {out}`"
    raw = read_json_object(path, fix)
    try:
        runs = [Run(**{**r, "settings": tuple(r["settings"])}) for r in raw["runs"]]
    except (KeyError, TypeError) as exc:
        raise damaged(path, f"is damaged ({type(exc).__name__}: {exc})", fix) from None
    return {run.name: run for run in runs}


def table_rows(out: Path) -> list[dict[str, Any]]:
    """A row per planned run: its parity, tokens/s, MFU (per GPU it used) and peak memory
    (the largest of its processes')."""
    runs = planned(out)
    parities = {
        name: json.loads((out / "parity" / f"{name}.json").read_text())
        for name in runs
        if (out / "parity" / f"{name}.json").is_file()
    }
    noise = parities.get(REPEAT.name, {}).get("max_loss_rel_gap")
    rows = []
    for run in runs.values():
        folder = out / "runs" / run.name
        summary = finished(folder)
        gaps = parities.get(run.name)
        if not folder.is_dir():  # the script's time ran out first
            status = "not run"
        elif run.reference is None:
            status = "reference" if summary else "failed"
        else:
            status = verdict(None if gaps is None or "failed" in gaps else gaps, run.expect, noise)
        rows.append(
            {
                "run": run.name,
                "schedule": run.schedule,
                "stages": int(run.setting("stages", "1")),
                "dp": int(run.setting("dp", "1")),
                "transport": run.transport,
                "gpus": run.gpus,
                "reference": run.reference,
                "expect": run.expect if run.reference else None,
                "parity": status,
                "failed": status in FAILED,
                "max_loss_rel_gap": gaps.get("max_loss_rel_gap") if gaps else None,
                "max_weight_gap": gaps.get("max_weight_gap") if gaps else None,
                **figures(summary, run.gpus),
            }
        )
    return rows


def figures(summary: dict[str, Any] | None, gpus: int) -> dict[str, float | None]:
    """Tokens/s, MFU per GPU used (summary.json's divides by the processes, which share GPUs
    on gloo) and the largest peak memory of the run's processes."""
    if summary is None:
        return {"tokens_per_s": None, "mfu": None, "peak_mem_mb": None}
    peak = summary.get("peak_tflops")
    model = summary.get("model_tflops")
    stages = summary.get("stages") or [summary]
    return {
        "tokens_per_s": summary.get("tokens_per_s"),
        "mfu": model / (peak * gpus) if peak and model is not None else None,
        "peak_mem_mb": max(s.get("peak_mem_mb", 0.0) for s in stages),
    }


def render(rows: list[dict[str, Any]]) -> str:
    """The table as markdown."""

    def number(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    lines = [
        "| run | transport | GPUs | parity (vs reference) | loss gap | tokens/s | MFU | peak MB |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        against = f"{r['parity']} (vs {r['reference']})" if r["reference"] else r["parity"]
        lines.append(
            f"| {r['run']} | {r['transport']} | {r['gpus']} | {against} | "
            f"{number(r['max_loss_rel_gap'], '.1e')} | {number(r['tokens_per_s'], ',.0f')} | "
            f"{number(r['mfu'], '.1%')} | {number(r['peak_mem_mb'], ',.0f')} |"
        )
    return "\n".join(lines)


# -- the commands ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m nobubble.gpu_check", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    planning = commands.add_parser("plan", help="the runs for N GPUs, a line each")
    planning.add_argument("--gpus", type=whole(), required=True, help="GPUs on this machine")
    planning.add_argument("--out", type=Path, required=True)
    comparing = commands.add_parser("compare", help="one run against its reference")
    comparing.add_argument("out", type=Path)
    comparing.add_argument("name")
    tabling = commands.add_parser("table", help="the table of the runs; exit 1 if one failed")
    tabling.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ConfigError as exc:  # an output path, a plan missing or damaged: one line
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


def run(args: argparse.Namespace) -> int:
    if args.command == "plan":
        make_output_folder(args.out, "--out")
        runs = plan(args.gpus)
        listed = [dataclasses.asdict(run) for run in runs]
        payload = {"gpus": args.gpus, "settings": [*MODEL, *TRAINING], "runs": listed}
        write_json_atomic(args.out / "plan.json", payload)
        print("\n".join(run.line() for run in runs))
        return 0
    if args.command == "compare":
        result = compare(args.out, args.name)
        print(json.dumps(result))
        return 0
    planned(args.out)
    check_output_file(args.out / "table.json", "OUT")
    rows = table_rows(args.out)
    write_json_atomic(args.out / "table.json", {"settings": [*MODEL, *TRAINING], "rows": rows})
    print(render(rows))
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
