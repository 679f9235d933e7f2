"""``nobubble eval RUN_FOLDER --tasks hellaswag,arc_easy,...``: benchmark scores of a run.

The run's checkpoint is exported (:func:`nobubble.hf.export.export_hf`) into a temporary folder
(under ``$TMPDIR``), evaluated there by lm-evaluation-harness, and the scores are written into
the run folder (:mod:`nobubble.runfolder.scores`) and printed.
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nobubble.config.fields import NON_NEGATIVE
from nobubble.config.flags import whole
from nobubble.destinations import check_output_folder
from nobubble.downstream.harness import LIST_HINT
from nobubble.markdown import markdown_table


def _batch_size(text: str) -> int | str:
    return text if text == "auto" else whole()(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN_FOLDER", help="the run folder to evaluate")
    parser.add_argument(
        "--tasks",
        required=True,
        metavar="NAMES",
        help=f"comma-separated lm-eval tasks or groups, e.g. hellaswag,arc_easy,piqa; {LIST_HINT}",
    )
    parser.add_argument(
        "--step",
        type=whole(NON_NEGATIVE),
        metavar="N",
        help="evaluate the checkpoint of step N (default: the newest valid checkpoint)",
    )
    parser.add_argument(
        "--limit",
        type=whole(),
        metavar="N",
        help="score only the first N examples of each task (a quick look; such scores get their "
        "own columns in `nobubble report`)",
    )
    parser.add_argument(
        "--num-fewshot",
        type=whole(NON_NEGATIVE),
        metavar="K",
        help="examples shown before each question (default: the task's own setting, 0 if none)",
    )
    parser.add_argument(
        "--batch-size",
        type=_batch_size,
        default=8,
        metavar="B",
        help="sequences per forward pass, or 'auto' (default: 8)",
    )
    parser.add_argument(
        "--device", help="torch device, e.g. cuda:0 (default: cuda if available, else cpu)"
    )
    parser.add_argument(
        "--include-path",
        type=Path,
        metavar="DIR",
        help="a folder of your own lm-eval task files (YAML), searched besides the built-in tasks",
    )


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _value_and_stderr(score: Mapping[str, float | None]) -> tuple[str, str]:
    stderr = score["stderr"]
    return f"{score['value']:.4f}", "—" if stderr is None else f"{stderr:.4f}"


def score_table(record: Mapping[str, Any]) -> str:
    """The headline scores of a score file as a Markdown table."""
    rows = []
    for name in record["headline"]:
        result = record["results"][name]
        shots = "—" if result["n_shot"] is None else str(result["n_shot"])
        samples = "—" if result["samples"] is None else str(result["samples"])
        for metric, score in result["metrics"].items():
            rows.append([name, shots, metric, *_value_and_stderr(score), samples])
    return markdown_table(["task", "n-shot", "metric", "value", "stderr", "examples"], rows)


def run(args: argparse.Namespace) -> int:
    from nobubble.downstream import harness
    from nobubble.downstream.harness import DownstreamError
    from nobubble.runfolder.folder import RunFolder
    from nobubble.runfolder.reading import saved_config
    from nobubble.runfolder.scores import write_scores

    run_dir = Path(args.run)
    saved_config(run_dir)  # a clear error if it is no run folder, before any slow import
    fix = "make it writable, or copy the run and evaluate the copy"
    check_output_folder(RunFolder(run_dir).scores, "RUN_FOLDER", fix=fix)  # where the scores go
    names = harness.parse_tasks(args.tasks)
    if args.include_path is not None and not args.include_path.is_dir():
        raise DownstreamError(
            f"--include-path {args.include_path} is not a folder; give a folder of lm-eval task "
            "files (YAML)"
        )
    harness.require_lm_eval()
    manager = harness.task_manager(names, args.include_path)  # a typo fails before the export
    from nobubble.hf.export import export_hf, provenance

    device = args.device or default_device()
    with tempfile.TemporaryDirectory(prefix="nobubble-eval-") as tmp:
        model_dir = export_hf(run_dir, Path(tmp) / "model", step=args.step)
        source = provenance(model_dir)
        print(f"evaluating {source['checkpoint']} of {run_dir} on {', '.join(names)} ({device})")
        start = time.perf_counter()
        results = harness.evaluate(
            model_dir,
            names,
            manager,
            num_fewshot=args.num_fewshot,
            limit=args.limit,
            batch_size=args.batch_size,
            device=device,
            include_path=args.include_path,
        )
        eval_s = time.perf_counter() - start
    settings = {
        "num_fewshot": args.num_fewshot,
        "limit": args.limit,
        "batch_size": args.batch_size,
        "device": device,
        "include_path": None if args.include_path is None else str(args.include_path.resolve()),
    }
    record = harness.score_record(
        results,
        step=source["step"],
        version=source["version"],
        tasks=names,
        settings=settings,
        eval_s=eval_s,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    path = write_scores(run_dir, record)
    print(score_table(record))
    print(f"\nscores: {path}")
    return 0
