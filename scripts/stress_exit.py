"""Many short torchrun jobs under CPU load: does every finished pipeline run exit cleanly?

Not part of CI (it takes about an hour for 300 runs on 2 cores). Every job trains a tiny model for
a few steps with evaluations in between (so the pipeline drains several times), cycling through
every schedule with and without error feedback; busy-loop processes beside it keep the CPUs
oversubscribed, which is when teardown races show. A job fails if any rank exits non-zero or
prints ``terminate called``; its log (and, where the kernel wrote a core file, a native backtrace
of every thread from gdb) is kept under ``--out``. Jobs in which the process group outlived its
destruction (the fallback exit of nobubble.pipeline.process_group ran) are counted as well.

    python scripts/stress_exit.py --runs 300 --hogs 2 --parallel 2 --out stress-runs
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

SMALL = [
    "d_model=32", "n_layers=4", "n_heads=4", "n_kv_heads=2", "d_ff=64", "seq_len=32",
    "batch_size=8", "eval_batches=1", "threads=1", "lr=3e-3", "warmup_steps=2",
    "steps=4", "eval_every=2",
]  # fmt: skip

CASES = [  # (schedule, stages, microbatches, optimizer)
    ("gpipe", 2, 2, "adamw"),
    ("1f1b", 2, 2, "adamw"),
    ("2bw", 2, 2, "sgd"),
    ("2bw", 3, 4, "muon"),
    ("pipedream", 2, 1, "adamw"),
]


def hog() -> None:
    while True:
        pass


def command(schedule: str, stages: int, micro: int, optim: str, ef: bool, out: Path) -> list[str]:
    settings = [f"schedule={schedule}", f"stages={stages}", f"microbatches={micro}"]
    settings += [f"optim={optim}", f"correction={'ef' if ef else 'none'}"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [
        *torchrun,
        f"--nproc-per-node={stages}",
        "-m",
        "nobubble",
        "train",
        "--no-progress",
        "--out",
        str(out),
        *SMALL,
        *settings,
    ]


def allow_core_files() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def backtraces(job: Path) -> str:
    """gdb's backtrace of every thread for each core file the job left behind."""
    text = []
    for core in sorted(job.glob("core*")):
        gdb = ["gdb", "-batch", "-ex", "thread apply all bt", sys.executable, str(core)]
        try:
            result = subprocess.run(gdb, capture_output=True, text=True, timeout=300)
            text.append(f"=== {core.name}\n{result.stdout}\n{result.stderr}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            text.append(f"=== {core.name}: gdb failed: {exc}")
    return "\n".join(text)


def run_job(index: int, case: tuple, ef: bool, root: Path, timeout: float) -> dict:
    schedule, stages, micro, optim = case
    job = root / f"job_{index:04d}"
    job.mkdir(parents=True)
    cmd = command(schedule, stages, micro, optim, ef, job / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    started = time.monotonic()
    try:
        result = subprocess.run(
            cmd,
            cwd=job,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=allow_core_files,
        )
        rc, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = "timeout", f"{exc.stdout or ''}{exc.stderr or ''}"
    record = {
        "job": index,
        "schedule": schedule,
        "stages": stages,
        "optim": optim,
        "ef": ef,
        "rc": rc,
        "seconds": round(time.monotonic() - started, 1),
        "terminate": "terminate called" in str(output),
        # the fallback of nobubble.pipeline.process_group ran: some library held the group
        "outlived_group": "exiting without interpreter teardown" in str(output),
    }
    record["ok"] = rc == 0 and not record["terminate"]
    if record["ok"]:
        shutil.rmtree(job)
    else:
        (job / "output.log").write_text(" ".join(cmd) + "\n\n" + str(output))
        (job / "backtraces.log").write_text(backtraces(job))
        for core in job.glob("core*"):
            core.unlink()
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--hogs", type=int, default=2, help="busy-loop processes beside the jobs")
    parser.add_argument("--out", type=Path, default=Path("stress-runs"))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    parser.add_argument("--parallel", type=int, default=1, help="jobs run at the same time")
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} already holds files; choose another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    hogs = [multiprocessing.Process(target=hog, daemon=True) for _ in range(args.hogs)]
    for process in hogs:
        process.start()
    variants = itertools.cycle([(case, ef) for case in CASES for ef in (False, True)])
    records: list[dict] = []
    jobs = zip(range(args.runs), variants, strict=False)
    try:
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            futures = [
                pool.submit(run_job, index, case, ef, args.out, args.timeout)
                for index, (case, ef) in jobs
            ]
            for future in concurrent.futures.as_completed(futures):
                record = future.result()
                records.append(record)
                with open(args.out / "jobs.jsonl", "a") as fh:
                    fh.write(json.dumps(record) + "\n")
                failed = sum(not r["ok"] for r in records)
                status = "ok" if record["ok"] else f"FAILED (rc {record['rc']})"
                what = f"{record['schedule']} P={record['stages']} ef={record['ef']}"
                print(f"[{len(records)}/{args.runs}] {what}: {status}; failures so far {failed}")
    finally:
        for process in hogs:
            process.terminate()
    failed = [r for r in records if not r["ok"]]
    summary = {
        "runs": len(records),
        "failed": len(failed),
        "outlived_group": sum(r["outlived_group"] for r in records),
        "hogs": args.hogs,
        "parallel": args.parallel,
        "failures": failed,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"{len(records)} runs, {len(failed)} failed, {summary['outlived_group']} with a process "
        f"group that outlived its destruction; details in {args.out}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
