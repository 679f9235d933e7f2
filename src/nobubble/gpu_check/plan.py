"""The GPU check's plan: which runs a machine with N GPUs does, in which order, and the plan's
file (``OUT/plan.json``), which every later step of the check reads.

Every pipeline schedule of the registry gets a row on two stages. With one GPU a row's processes
share the GPU over gloo under the NCCL emulator (``dist_backend=gloo emulate_nccl=true``: every
CUDA path of the pipeline but NCCL itself, with NCCL's routes and order); with two or more GPUs
they run on NCCL, a GPU each (and one row still shares a GPU). A row is compared with the
one-process run of its semantics (:func:`semantics`), as the schedule registry states them: a
schedule that flushes computes what ``sync`` computes (run in one process as the schedule
``sync`` is the same as, on two stages, so that the tied weight's two copies are summed as a
pipeline sums them), whatever its stages and chunks; a schedule that does not flush computes what
it computes in one process on the same stages. A schedule whose first and last stages have
different delays cannot tie the embedding to the head: its runs are untied. The 2bw reference
runs twice: whether a GPU repeats a run bit for bit (its kernels may not be deterministic) sets
what a row may differ by.

Before the rows, a smoke test on a tiny model (every GPU a stage, one 1F1B step on NCCL: every
stage edge connected by the warm-up, then used) says in seconds whether NCCL's point-to-point
works at all. One row measures throughput over enough steps to mean something, with MFU beside
it; two rows audit the synchronizations of a step's actions, a dense model's and an MoE model's
(:mod:`nobubble.gpu_check.audit`).
Rows that need more GPUs than the machine has are listed as skipped, with why.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nobubble.config import ConfigError
from nobubble.gpu_check.runs import (
    AUDIT,
    BITWISE,
    CLOSE,
    REPEATS,
    SMOKE,
    THROUGHPUT,
    TIMEOUTS,
    TRANSPORTS,
    CheckRun,
    Skipped,
)
from nobubble.json_files import damaged, read_json_object, write_json_atomic
from nobubble.schedules.registry import PIPELINE_SCHEDULES, schedule_spec

SYNC = "sync"  # the registry's synchronous semantics, which every flushing schedule computes
UNTIED = "tie_embeddings=false"


def semantics(schedule: str) -> str:
    """The semantics a schedule's rows are compared with: ``sync`` for one that flushes."""
    return SYNC if schedule_spec(schedule).flushes else schedule


def shape(schedule: str, stages: int) -> tuple[str, ...]:
    """``schedule`` on ``stages`` ranks: 4 microbatches, or 1 where every microbatch is its own
    step; untied where the pipeline runtime cannot tie the first and the last stage's weight
    (different delays, or the V placement: the registry's ``pipeline_can_tie``)."""
    spec = schedule_spec(schedule)
    micro = 1 if spec.step_per_microbatch else 4
    settings = (f"schedule={schedule}", f"stages={stages}", f"microbatches={micro}")
    tied = spec.pipeline_can_tie(stages * spec.default_chunks)
    return settings + (() if tied else (UNTIED,))


def reference(schedule: str) -> CheckRun:
    """The one-process run that ``schedule``'s rows are compared with: its semantics on two
    stages, untied where its rows are (``-untied`` where the semantics' own run is tied: a
    V schedule against sync)."""
    name = semantics(schedule)
    settings = shape(schedule_spec(name).same_as or name, 2)
    untied = UNTIED in shape(schedule, 2) and UNTIED not in settings
    suffix, extra = ("-untied", (UNTIED,)) if untied else ("", ())
    return CheckRun(f"one-process-{name}{suffix}", settings + extra)


# the references of the pipeline schedules' rows, by name (sync first)
REFERENCES = {run.name: run for run in map(reference, PIPELINE_SCHEDULES)}
# the 2bw reference again: whether this GPU repeats a run bit for bit
REPEAT = dataclasses.replace(
    REFERENCES["one-process-2bw"],
    name="one-process-2bw-again",
    reference=REFERENCES["one-process-2bw"].name,
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


def row(
    schedule: str,
    stages: int,
    transport: str,
    dp: int = 1,
    extra: tuple[str, ...] = (),
    expect: str = BITWISE,
) -> CheckRun:
    """A pipeline row: on NCCL (a GPU a process), or on one GPU that its processes share over
    gloo (under the NCCL emulator, or not: :data:`~nobubble.gpu_check.runs.TRANSPORTS`)."""
    settings = shape(schedule, stages) + ((f"dp={dp}",) if dp > 1 else ())
    how, words, suffix = TRANSPORTS[transport]
    zero = [s.removeprefix("zero=") for s in extra if s.startswith("zero=")]
    name = f"{schedule}-p{stages}" + (f"-dp{dp}" if dp > 1 else "")
    name += (f"-zero{zero[0]}" if zero else "") + f"-{suffix}"
    compiled = "compile=true" in extra
    name += "-compiled" if compiled else ""
    processes = stages * dp
    return CheckRun(
        name,
        settings + how + extra,
        processes,
        gpus=processes if transport == "nccl" else 1,
        reference=reference(schedule).name,
        expect=expect,
        transport=words,
        kind="row",
        timeout_s=TIMEOUTS["compiled" if compiled else "row"],
    )


def smoke(gpus: int) -> CheckRun:
    """Every GPU a stage of a tiny model for one 1F1B step (one GPU: two processes share it
    under the NCCL emulator)."""
    stages, transport = (min(gpus, 8), "nccl") if gpus >= 2 else (2, "emulated")
    how, words, suffix = TRANSPORTS[transport]
    settings = ("schedule=1f1b", f"stages={stages}", f"microbatches={2 * stages}", *how)
    gpus_used = stages if transport == "nccl" else 1
    name = f"smoke-1f1b-p{stages}-{suffix}"
    return CheckRun(
        name, settings, stages, gpus_used, None, BITWISE, words, SMOKE, TIMEOUTS[SMOKE], SMOKE_BASE
    )


def throughput(gpus: int) -> CheckRun:
    """1F1B on two GPUs over NCCL (one GPU: one process)."""
    if gpus >= 2:
        how, words, _ = TRANSPORTS["nccl"]
        settings = ("schedule=1f1b", "stages=2", "microbatches=8", *how)
        name, processes, used = "throughput-1f1b-p2-nccl", 2, 2
    else:
        settings = ("schedule=1f1b", "stages=1", "microbatches=8")
        name, processes, used, words = "throughput-one-process", 0, 1, "one process"
    return CheckRun(
        name,
        settings,
        processes,
        used,
        transport=words,
        kind=THROUGHPUT,
        timeout_s=TIMEOUTS[THROUGHPUT],
        base=THROUGHPUT_BASE,
    )


# an MoE model for the audit: two routed blocks on each of the two stages (of the 32), experts
# dispatched by the grouped GEMM (bfloat16), which reads nothing on the host
MOE = ("moe_experts=8", "moe_top_k=2", "moe_layers=[1, 2, 17, 18]", "moe_bias_rate=0.001")


def audit(gpus: int, model: tuple[str, ...] = (), label: str = "") -> CheckRun:
    """1F1B on two stages with the main transport (the dense model, or ``model``'s settings,
    named by ``label``), its processes audited (:func:`nobubble.gpu_check.audit.audit_main`)."""
    transport = "nccl" if gpus >= 2 else "emulated"
    base = row("1f1b", 2, transport, extra=model)
    name = f"sync-audit-{label}{base.name}"
    return dataclasses.replace(
        base, name=name, reference=None, kind=AUDIT, timeout_s=TIMEOUTS[AUDIT]
    )


def wanted() -> list[tuple[CheckRun, int]]:
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


def plan(gpus: int) -> list[CheckRun]:
    """The runs for ``gpus`` GPUs: the smoke test, the references, the rows (the script runs
    them in this order and skips what its time budget no longer allows)."""
    if gpus < 1:
        return []
    main = "nccl" if gpus >= 2 else "emulated"
    rows = [row(schedule, 2, main) for schedule in PIPELINE_SCHEDULES]
    # the other ways to share one GPU, once: plain gloo; with NCCL there, NCCL's emulation
    rows.append(row("2bw", 2, "gloo" if main == "emulated" else "emulated"))
    rows += [run for run, need in wanted() if need <= gpus]
    rows += [audit(gpus), audit(gpus, MOE, "moe-"), throughput(gpus)]
    compiled = ("compile=true", "activation_checkpointing=true")
    rows.append(row("2bw", 2, main, extra=compiled, expect=CLOSE))
    return [smoke(gpus), *REFERENCES.values(), REPEAT, *rows]


# -- the plan's file ------------------------------------------------------------------------------


def write_plan(out: Path, gpus: int, runs: list[CheckRun], left_out: list[Skipped]) -> None:
    """``out/plan.json``: the runs, and those this machine cannot do."""
    payload = {
        "gpus": gpus,
        "runs": [dataclasses.asdict(run) for run in runs],
        "skipped": [dataclasses.asdict(s) for s in left_out],
    }
    write_json_atomic(out / "plan.json", payload)


def planned(out: Path) -> tuple[dict[str, CheckRun], list[Skipped]]:
    """The plan written into ``out`` (``plan --out``): its runs by name, and what it skipped."""
    path = out / "plan.json"
    fix = f"write it with `nobubble gpu-check plan --gpus N --out {out}`"
    raw = read_json_object(path, fix)
    try:
        runs = [
            CheckRun(**{**r, "settings": tuple(r["settings"]), "base": tuple(r["base"])})
            for r in raw["runs"]
        ]
        left_out = [Skipped(**r) for r in raw.get("skipped", [])]
    except (KeyError, TypeError) as exc:
        raise damaged(path, f"is damaged ({type(exc).__name__}: {exc})", fix) from None
    return {run.name: run for run in runs}, left_out


def planned_run(out: Path, name: str) -> CheckRun:
    """Run ``name`` of ``out``'s plan."""
    runs, _ = planned(out)
    if name not in runs:
        raise ConfigError(
            f"{name} is not a run of {out / 'plan.json'}; give one of {', '.join(runs)}"
        )
    return runs[name]
