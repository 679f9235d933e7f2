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

Before the rows, a smoke test on a tiny model (every GPU a stage, one 1F1B step on NCCL: every
stage edge connected by the warm-up, then used) says in seconds whether NCCL's point-to-point
works at all. Each run has a timeout of its own (:data:`TIMEOUTS`); a run that passes it has the
Python stacks of every process dumped into its log before it is killed (:func:`run_row`), so a
hang says where each rank waited. One row measures throughput over enough steps to mean
something (:data:`THROUGHPUT`), with MFU beside it; one row trains a step with
``torch.cuda.set_sync_debug_mode("warn")`` inside every action and reports each synchronization
by action (:mod:`nobubble.gpu_check` ``audit``). Rows that need more GPUs than the machine has
are listed as skipped, with why.

    python -m nobubble.gpu_check plan --gpus N --out OUT   # OUT/plan.json; a run a line
    python -m nobubble.gpu_check row OUT NAME              # run NAME, within its timeout
    python -m nobubble.gpu_check compare OUT NAME          # OUT/parity/NAME.json
    python -m nobubble.gpu_check table OUT                 # the table, OUT/table.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nobubble import cli
from nobubble.checkpoint.files import checkpoint_folders, newest_weights
from nobubble.children import POLL_S, identity, shell_status, stopping
from nobubble.config import ConfigError
from nobubble.config.flags import OneLineParser, whole
from nobubble.destinations import check_output_file, check_output_folder, make_output_folder
from nobubble.files import damaged, read_json_lines, read_json_object, write_json_atomic
from nobubble.pipeline.runtime import _Segment
from nobubble.runfolder import FINISHED, read_summary, stop_of
from nobubble.schedules import Action

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


# the verdicts that fail the check ("not run": out of time)
FAILED = ("failed", "DIFFERS", "timed out", "SYNCS")

# what a run without a reference is for, and the table's word for it once it finished
REFERENCE, SMOKE, THROUGHPUT, AUDIT = "reference", "smoke", "throughput", "audit"
FINISHED_AS = {REFERENCE: "reference", SMOKE: "connected", THROUGHPUT: "measured"}

# each run's timeout (s), by what it is: a run that passes it is a hang, its stacks dumped
TIMEOUTS = {SMOKE: 60.0, REFERENCE: 180.0, "row": 180.0, "compiled": 420.0, THROUGHPUT: 300.0}
TIMEOUTS[AUDIT] = TIMEOUTS["row"]


@dataclass(frozen=True)
class Run:
    """One run of the check: ``settings`` come after ``base`` (:data:`MODEL` and
    :data:`TRAINING` unless said); ``processes`` is torchrun's ``--nproc-per-node`` (0: one
    process, no torchrun) on ``gpus`` GPUs; ``reference`` names the one-process run it is
    compared with (None: it is one, or a run of another ``kind``), ``expect`` how closely;
    ``timeout_s``: how long it may take before it counts as a hang."""

    name: str
    settings: tuple[str, ...]
    processes: int = 0
    gpus: int = 1
    reference: str | None = None
    expect: str = BITWISE
    transport: str = "one process"
    kind: str = REFERENCE
    timeout_s: float = TIMEOUTS[REFERENCE]
    base: tuple[str, ...] = MODEL + TRAINING

    @property
    def schedule(self) -> str:
        return self.setting("schedule")

    def setting(self, key: str, default: str = "") -> str:
        values = [s.split("=", 1)[1] for s in self.settings if s.startswith(f"{key}=")]
        return values[-1] if values else default

    def line(self) -> str:
        """How the script reads it: name, processes, GPUs, reference (- for none), settings."""
        head = [self.name, str(self.processes), str(self.gpus), self.reference or "-"]
        return " ".join([*head, *self.base, *self.settings])


@dataclass(frozen=True)
class Skipped:
    """A run this machine cannot do, and why."""

    name: str
    why: str


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
    kind="row",
)
# the smoke test: a tiny model, one 1F1B step, every GPU a stage (the warm-up connects every
# edge; the step sends over each)
SMOKE_BASE = ("preset=tiny", "seq_len=64", "batch_size=8", "device=cuda", "p2p_timeout_s=30")
SMOKE_BASE += ("steps=1", "eval_every=0", "eval_batches=1", "checkpoint_every=0")
# throughput: a ~135M-parameter model at a realistic sequence length, long enough that the
# first steps (allocations, autotuning) weigh little in tokens/s
THROUGHPUT_BASE = ("preset=smollm2-135m", "seq_len=1024", "batch_size=32", "device=cuda")
THROUGHPUT_BASE += ("p2p_timeout_s=120", "steps=40", "eval_every=0", "eval_batches=1")
THROUGHPUT_BASE += ("optim=adamw", "lr=3e-4", "warmup_steps=5", "checkpoint_every=0")
# the audit: one step traced (the second: the first allocates, connects and compiles)
AUDIT_STEP = 1


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
    zero = [s.removeprefix("zero=") for s in extra if s.startswith("zero=")]
    name = f"{schedule}-p{stages}" + (f"-dp{dp}" if dp > 1 else "")
    name += (f"-zero{zero[0]}" if zero else "") + f"-{suffix}"
    compiled = "compile=true" in extra
    name += "-compiled" if compiled else ""
    processes = stages * dp
    return Run(
        name,
        settings + how + extra,
        processes,
        gpus=processes if transport == "nccl" else 1,
        reference=REFERENCES[semantics(schedule)].name,
        expect=expect,
        transport=words,
        kind="row",
        timeout_s=TIMEOUTS["compiled" if compiled else "row"],
    )


def smoke(gpus: int) -> Run:
    """Every GPU a stage of a tiny model for one 1F1B step (one GPU: two processes share it
    under the NCCL emulator)."""
    stages, transport = (min(gpus, 8), "nccl") if gpus >= 2 else (2, "emulated")
    how, words, suffix = TRANSPORTS[transport]
    settings = ("schedule=1f1b", f"stages={stages}", f"microbatches={2 * stages}", *how)
    gpus_used = stages if transport == "nccl" else 1
    name = f"smoke-1f1b-p{stages}-{suffix}"
    return Run(
        name, settings, stages, gpus_used, None, BITWISE, words, SMOKE, TIMEOUTS[SMOKE], SMOKE_BASE
    )


def throughput(gpus: int) -> Run:
    """1F1B on two GPUs over NCCL (one GPU: one process)."""
    if gpus >= 2:
        how, words, _ = TRANSPORTS["nccl"]
        settings = ("schedule=1f1b", "stages=2", "microbatches=8", *how)
        return Run(
            "throughput-1f1b-p2-nccl",
            settings,
            2,
            2,
            None,
            BITWISE,
            words,
            THROUGHPUT,
            TIMEOUTS[THROUGHPUT],
            THROUGHPUT_BASE,
        )
    settings = ("schedule=1f1b", "stages=1", "microbatches=8")
    return Run(
        "throughput-one-process",
        settings,
        0,
        1,
        None,
        BITWISE,
        "one process",
        THROUGHPUT,
        TIMEOUTS[THROUGHPUT],
        THROUGHPUT_BASE,
    )


def audit(gpus: int) -> Run:
    """1F1B on two stages with the main transport; its processes run under :func:`audit_main`."""
    transport = "nccl" if gpus >= 2 else "emulated"
    base = row("1f1b", 2, transport)
    return dataclasses.replace(
        base, name=f"sync-audit-{base.name}", reference=None, kind=AUDIT, timeout_s=TIMEOUTS[AUDIT]
    )


def wanted() -> list[tuple[Run, int]]:
    """The rows that a GPU each on NCCL, and so this many GPUs, makes possible."""
    return [
        (row("1f1b", 4, "nccl"), 4),
        (row("2bw", 2, "nccl", dp=2, expect=CLOSE), 4),
        *[(row("1f1b", 2, "nccl", dp=2, extra=(f"zero={z}",), expect=CLOSE), 4) for z in (1, 2)],
        (row("2bw", 4, "nccl", dp=2, expect=CLOSE), 8),
        (row("1f1b", 8, "nccl"), 8),
    ]


def skipped(gpus: int) -> list[Skipped]:
    """The rows this machine cannot run (too few GPUs), each with why."""
    return [
        Skipped(run.name, f"needs {need} GPUs, a GPU per process on NCCL; this machine has {gpus}")
        for run, need in wanted()
        if need > gpus
    ]


def plan(gpus: int) -> list[Run]:
    """The runs for ``gpus`` GPUs: the smoke test, the references, the rows (the script runs
    them in this order and skips what its time budget no longer allows)."""
    if gpus < 1:
        return []
    main = "nccl" if gpus >= 2 else "emulated"
    rows = [row(schedule, 2, main) for schedule in SCHEDULES]
    # the other ways to share one GPU, once: plain gloo; with NCCL there, NCCL's emulation
    rows.append(row("2bw", 2, "gloo" if main == "emulated" else "emulated"))
    rows += [run for run, need in wanted() if need <= gpus]
    rows += [audit(gpus), throughput(gpus)]
    compiled = ("compile=true", "activation_checkpointing=true")
    rows.append(row("2bw", 2, main, extra=compiled, expect=CLOSE))
    return [smoke(gpus), *REFERENCES.values(), REPEAT, *rows]


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


# -- the table ---------------------------------------------------------------------------------


def planned(out: Path) -> tuple[dict[str, Run], list[Skipped]]:
    """The plan written into ``out`` (``plan --out``): its runs by name, and what it skipped."""
    path = out / "plan.json"
    fix = f"write it with `python -m nobubble.gpu_check plan --gpus N --out {out}`"
    raw = read_json_object(path, fix)
    try:
        runs = [
            Run(**{**r, "settings": tuple(r["settings"]), "base": tuple(r["base"])})
            for r in raw["runs"]
        ]
        left_out = [Skipped(**r) for r in raw.get("skipped", [])]
    except (KeyError, TypeError) as exc:
        raise damaged(path, f"is damaged ({type(exc).__name__}: {exc})", fix) from None
    return {run.name: run for run in runs}, left_out


def planned_run(out: Path, name: str) -> Run:
    """Run ``name`` of ``out``'s plan."""
    runs, _ = planned(out)
    if name not in runs:
        raise ConfigError(
            f"{name} is not a run of {out / 'plan.json'}; give one of {', '.join(runs)}"
        )
    return runs[name]


def write_plan(out: Path, gpus: int, runs: list[Run], left_out: list[Skipped]) -> None:
    """``out/plan.json``: the runs, and those this machine cannot do."""
    payload = {
        "gpus": gpus,
        "runs": [dataclasses.asdict(run) for run in runs],
        "skipped": [dataclasses.asdict(s) for s in left_out],
    }
    write_json_atomic(out / "plan.json", payload)


def table_rows(out: Path) -> list[dict[str, Any]]:
    """A row per planned run: its parity (or what else it is for), tokens/s, MFU (per GPU it
    used) and peak memory (the largest of its processes'); then a row per skipped run."""
    runs, left_out = planned(out)
    parities = {
        name: json.loads((out / "parity" / f"{name}.json").read_text())
        for name in runs
        if (out / "parity" / f"{name}.json").is_file()
    }
    noise = parities.get(REPEAT.name, {}).get("max_loss_rel_gap")
    rows = []
    for run in runs.values():
        summary = finished(out / "runs" / run.name)
        gaps = parities.get(run.name)
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
                "parity": status(out, run, summary, gaps, noise),
                "max_loss_rel_gap": gaps.get("max_loss_rel_gap") if gaps else None,
                "max_weight_gap": gaps.get("max_weight_gap") if gaps else None,
                **figures(summary, run.gpus),
            }
        )
    for skip in left_out:
        rows.append({"run": skip.name, "parity": f"skipped: {skip.why}", "reference": None})
    for r in rows:
        r["failed"] = r["parity"] in FAILED
    return rows


def status(
    out: Path, run: Run, summary: dict[str, Any] | None, gaps: dict | None, noise: float | None
) -> str:
    """What became of ``run``: not run (the script's time ran out first), timed out (its
    stacks are in its log), its audit's verdict, its parity, or what it is for
    (:data:`FINISHED_AS`) once it finished."""
    if (out / "timeouts" / f"{run.name}.json").is_file():
        return "timed out"
    if not (out / "runs" / run.name).is_dir():
        return "not run"
    if run.kind == AUDIT:
        return audit_verdict(out / "audit") if summary else "failed"
    if run.reference is None:
        return FINISHED_AS[run.kind] if summary else "failed"
    return verdict(None if gaps is None or "failed" in gaps else gaps, run.expect, noise)


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
        if r["parity"].startswith("skipped"):
            lines.append(f"| {r['run']} | - | - | {against} | - | - | - | - |")
            continue
        lines.append(
            f"| {r['run']} | {r['transport']} | {r['gpus']} | {against} | "
            f"{number(r['max_loss_rel_gap'], '.1e')} | {number(r['tokens_per_s'], ',.0f')} | "
            f"{number(r['mfu'], '.1%')} | {number(r['peak_mem_mb'], ',.0f')} |"
        )
    return "\n".join(lines)


# -- a run within its timeout -------------------------------------------------------------------

STACKS_WAIT_S = 10.0  # how long a process gets to write its stacks and exit


def command(run: Run, out: Path, python: str = sys.executable) -> list[str]:
    """How ``run`` is started: ``nobubble train`` (under :func:`audit_main` for the audit), in
    one process or under torchrun."""
    train = ["train", "--no-progress", "--overwrite", "--out", str(out / "runs" / run.name)]
    entry = ["-m", "nobubble", *train]
    if run.kind == AUDIT:
        entry = ["-m", "nobubble.gpu_check", "audit", str(out / "audit"), "--", *train]
    launcher = [python]
    if run.processes:
        launcher += ["-m", "torch.distributed.run", "--standalone"]
        launcher.append(f"--nproc-per-node={run.processes}")
    return [*launcher, *entry, *run.base, *run.settings]


def row_environment(run: Run, environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with the run's GPUs (the first ``run.gpus`` of those visible) and Python's
    fault handler on: SIGABRT then writes every thread's stack before the process dies."""
    visible = environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(run.gpus)))
    first = ",".join(visible.split(",")[: run.gpus])
    return {**environ, "CUDA_VISIBLE_DEVICES": first, "PYTHONFAULTHANDLER": "1"}


def run_row(out: Path, run: Run) -> int:
    """Run ``run`` (its output: this process's); past its timeout, dump the stacks of its
    processes (:func:`dump_stacks`), record it in ``out/timeouts/NAME.json``, stop what is left
    and return 124. A stop signal to this process stops the run as :mod:`nobubble.children`
    says."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    with stopping(f"gpu_check row {run.name}", "none of its processes is left") as children:
        process = children.start(command(run, out), env=row_environment(run, dict(os.environ)))
        try:
            return shell_status(children.wait(process, run.timeout_s))
        except subprocess.TimeoutExpired:
            say(f"{run.name}: no end after its timeout of {run.timeout_s:g} s; its stacks follow")
            dumped = dump_stacks(process.pid, torchrun=run.processes > 0)
    (out / "timeouts").mkdir(exist_ok=True)
    record = {"run": run.name, "timeout_s": run.timeout_s, "stacks_of": dumped}
    write_json_atomic(out / "timeouts" / f"{run.name}.json", record)
    return 124


def say(line: str) -> None:
    print(f"nobubble.gpu_check: {line}", file=sys.stderr, flush=True)


def dump_stacks(root: int, torchrun: bool) -> list[str]:
    """Make each process of a run write its Python stacks (SIGABRT, with the fault handler on),
    one after the other so that their stacks do not mix, and return who they were. Under
    torchrun the workers are the agent's children; the agent is stopped meanwhile (SIGSTOP),
    or it would end the other workers when the first one dies (torchrun passes on SIGTERM,
    SIGINT, SIGHUP and SIGQUIT, and no signal that dumps stacks)."""
    workers = children_of(root) if torchrun else [root]
    if torchrun:
        os.kill(root, signal.SIGSTOP)
    dumped = []
    try:
        for pid in workers:
            who = f"{rank_of(pid)} (pid {pid})"
            say(f"the Python stacks of {who}:")
            os.kill(pid, signal.SIGABRT)
            gone(pid, STACKS_WAIT_S)
            dumped.append(who)
    finally:
        if torchrun:
            os.kill(root, signal.SIGCONT)
    return dumped


def children_of(pid: int) -> list[int]:
    """The processes ``pid`` started (none where /proc does not say)."""
    try:
        return [
            int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        ]
    except OSError:
        return []


def rank_of(pid: int) -> str:
    """``rank R`` of a torchrun worker (its environment says), else ``the process``."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return "the process"
    ranks = [entry[5:].decode() for entry in environ if entry.startswith(b"RANK=")]
    return f"rank {ranks[0]}" if ranks else "the process"


def gone(pid: int, wait_s: float) -> None:
    """Wait up to ``wait_s`` for ``pid`` to exit."""
    deadline = time.monotonic() + wait_s
    while identity(pid) is not None and time.monotonic() < deadline:
        time.sleep(POLL_S)


# -- the audit of synchronizations ---------------------------------------------------------------

SYNC_WARNING = "called a synchronizing CUDA operation"  # set_sync_debug_mode("warn")'s words


def audited(
    execute: Callable[[Any, Action], None],
    found: list[dict[str, Any]],
    debug_mode: Callable[[str], None],
) -> Callable[[Any, Action], None]:
    """``execute`` (the runtime's run of one action) that, for the actions of step
    :data:`AUDIT_STEP`, turns ``debug_mode`` to warn and adds each synchronization warned of to
    ``found``, with the action and the line that synchronized."""

    def run(segment: Any, action: Action) -> None:
        if action.step != AUDIT_STEP:
            execute(segment, action)
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            debug_mode("warn")
            try:
                execute(segment, action)
            finally:
                debug_mode("default")
        found.append({"action": str(action), "syncs": []})
        for warning in caught:
            if SYNC_WARNING in str(warning.message):
                where = f"{warning.filename}:{warning.lineno}"
                found[-1]["syncs"].append(where)

    return run


def audit_main(folder: Path, train: list[str]) -> int:
    """``nobubble train TRAIN`` with every action of step :data:`AUDIT_STEP` audited
    (:func:`audited`); what this process found goes into ``folder/rank_R.json``."""
    found: list[dict[str, Any]] = []
    _Segment.execute = audited(_Segment.execute, found, torch.cuda.set_sync_debug_mode)
    try:
        return cli.main(train)
    finally:
        folder.mkdir(parents=True, exist_ok=True)
        rank = os.environ.get("RANK", "0")
        write_json_atomic(folder / f"rank_{rank}.json", {"rank": int(rank), "actions": found})


def audit_verdict(folder: Path) -> str:
    """``no sync in actions``; ``SYNCS`` (some action synchronized: ``folder``'s files say
    which, where); ``failed`` (no process audited an action)."""
    actions = [
        action
        for path in sorted(folder.glob("rank_*.json"))
        for action in json.loads(path.read_text())["actions"]
    ]
    if not actions:
        return "failed"
    return "SYNCS" if any(action["syncs"] for action in actions) else "no sync in actions"


# -- the commands ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m nobubble.gpu_check", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    planning = commands.add_parser("plan", help="the runs for N GPUs, a line each")
    planning.add_argument("--gpus", type=whole(), required=True, help="GPUs on this machine")
    planning.add_argument("--out", type=Path, required=True)
    running = commands.add_parser("row", help="one run of the plan, within its timeout")
    running.add_argument("out", type=Path)
    running.add_argument("name")
    auditing = commands.add_parser("audit", help="nobubble train, its step 1 audited for syncs")
    auditing.add_argument("folder", type=Path)
    auditing.add_argument("train", nargs=argparse.REMAINDER, metavar="-- train ARGS")
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
        write_plan(args.out, args.gpus, runs, skipped(args.gpus))
        print("\n".join(run.line() for run in runs))
        return 0
    if args.command == "row":
        return run_row(args.out, planned_run(args.out, args.name))
    if args.command == "audit":
        return audit_main(args.folder, args.train[1:] if args.train[:1] == ["--"] else args.train)
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
