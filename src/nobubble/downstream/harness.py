"""lm-evaluation-harness on a Hugging Face model folder, and its results as a score file.

``lm_eval`` (the optional extra ``eval``) is imported inside the functions that run it, never at
import time; the functions that shape its results into a score file need nothing but its output.
"""

from __future__ import annotations

import contextlib
import difflib
import math
from collections.abc import Iterator, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

from nobubble.config import ConfigError
from nobubble.config.extras import require
from nobubble.runfolder.scores import FORMAT

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager


class DownstreamError(ConfigError):
    """An evaluation that cannot run; says why and the fix."""


LIST_HINT = (
    "list the task names with `lm-eval ls tasks` (add `--include_path DIR` for a folder of your "
    "own task files)"
)


def require_lm_eval() -> None:
    """A clear error naming the ``eval`` extra when lm-evaluation-harness or transformers is
    missing (:func:`nobubble.config.extras.require`)."""
    for module in ("lm_eval", "transformers"):
        require(module, "nobubble eval")


def parse_tasks(text: str) -> list[str]:
    """``hellaswag,arc_easy`` as a list of names, in order, each once."""
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names:
        raise DownstreamError(f"--tasks {text!r} names no task; e.g. --tasks hellaswag,arc_easy")
    return names


def unknown_tasks_error(unknown: Sequence[str], known: Sequence[str]) -> DownstreamError:
    guesses = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=3)
        if close:
            guesses.append(f"for {name!r} did you mean {' or '.join(map(repr, close))}?")
    hint = f" ({'; '.join(guesses)})" if guesses else ""
    return DownstreamError(
        f"lm-eval has no task named {', '.join(map(repr, unknown))}{hint}; {LIST_HINT}"
    )


def task_manager(names: Sequence[str], include_path: Path | None) -> TaskManager:
    """An lm-eval TaskManager that knows every one of ``names``, else an error naming the rest.

    When every name is in ``include_path``, lm-eval's thousands of built-in task files are not
    indexed (a scan of 15 to 30 s on a small machine).
    """
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if set(names) <= set(local.all_tasks):
            return local
    manager = TaskManager(include_path=None if include_path is None else str(include_path))
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise unknown_tasks_error(unknown, manager.all_tasks)
    return manager


def unreachable_data_error(
    names: Sequence[str], include_path: Path | None, cause: Exception
) -> DownstreamError:
    """The one line for task data that is neither in the local Hugging Face cache nor
    downloadable here: which, and how to make it available offline."""
    where = "" if include_path is None else f"include_path={str(include_path)!r}"
    download = (
        'python -c "from lm_eval.tasks import TaskManager, get_task_dict; '
        f'get_task_dict({list(names)!r}, TaskManager({where}))"'
    )
    return DownstreamError(
        f"the data of {', '.join(names)} is not in this machine's Hugging Face datasets cache "
        f"and cannot be downloaded here ({cause}); where the Hub is reachable, download it with "
        f"{download}, then copy that machine's datasets cache (HF_DATASETS_CACHE, default "
        "~/.cache/huggingface/datasets) into this one's; HF_DATASETS_OFFLINE=1 then reads it "
        "without waiting on the network"
    )


@contextlib.contextmanager
def _without_machine_report() -> Iterator[None]:
    """lm-eval's ``simple_evaluate`` ends by describing the machine for its own result files:
    ``git describe`` in the working folder (which prints "fatal: not a git repository" outside
    one) and torch's environment report (about 4 s). The score file records the versions that
    matter itself, so both do nothing while it runs (each only where this lm-eval has it)."""
    from lm_eval import evaluator

    skipped = {"get_git_commit_hash": lambda: None, "add_env_info": lambda results: None}
    with contextlib.ExitStack() as stack:
        for name, nothing in skipped.items():
            if hasattr(evaluator, name):
                stack.enter_context(mock.patch.object(evaluator, name, nothing))
        yield


def evaluate(
    model_dir: Path,
    names: Sequence[str],
    manager: TaskManager,
    *,
    num_fewshot: int | None,
    limit: int | None,
    batch_size: int | str,
    device: str,
    include_path: Path | None,
) -> dict[str, Any]:
    """lm-eval's results of the model in ``model_dir`` (a transformers folder) on ``names``
    (found by ``manager``, which also searches ``include_path``)."""
    from huggingface_hub.errors import LocalEntryNotFoundError
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    model = HFLM(pretrained=str(model_dir), device=device, batch_size=batch_size)
    try:
        with _without_machine_report():
            results = simple_evaluate(
                model=model,
                tasks=list(names),
                task_manager=manager,
                num_fewshot=num_fewshot,
                limit=limit,
                log_samples=False,
            )
    except (ConnectionError, LocalEntryNotFoundError) as exc:  # offline, or no network
        raise unreachable_data_error(names, include_path, exc) from None
    if results is None:  # only on a non-zero rank of a distributed run, which this never starts
        raise DownstreamError("lm-eval returned no results")
    return results


def _number(value: Any) -> float | None:
    """lm-eval's value as a float; None for its "N/A" (no standard error) and the like."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def metrics_of(result: Mapping[str, Any]) -> dict[str, dict[str, float | None]]:
    """``{"acc,none": .4, "acc_stderr,none": .01}`` as ``{"acc": {value: .4, stderr: .01}}``."""
    out: dict[str, dict[str, float | None]] = {}
    for key, value in result.items():
        metric, comma, filtered = key.partition(",")
        if not comma or metric.endswith("_stderr") or _number(value) is None:
            continue
        stderr = _number(result.get(f"{metric}_stderr,{filtered}"))
        name = metric if filtered == "none" else f"{metric} ({filtered})"
        out[name] = {"value": float(value), "stderr": stderr}
    return out


def _leaves(name: str, subtasks: Mapping[str, Sequence[str]]) -> list[str]:
    if name not in subtasks:
        return [name]
    return [leaf for child in subtasks[name] for leaf in _leaves(child, subtasks)]


def _n_shot(name: str, results: Mapping[str, Any]) -> int | None:
    """The number of examples shown before each question; a group's if its tasks agree."""
    shots = {results["n-shot"].get(leaf) for leaf in _leaves(name, results["group_subtasks"])}
    return shots.pop() if len(shots) == 1 else None


def headline(results: Mapping[str, Any]) -> list[str]:
    """The evaluated names that are no other group's subtask (what was asked for, tags
    expanded), in lm-eval's order."""
    inner = {child for children in results["group_subtasks"].values() for child in children}
    return [name for name in results["results"] if name not in inner]


def score_record(
    results: Mapping[str, Any],
    *,
    step: int,
    version: int,
    tasks: Sequence[str],
    settings: Mapping[str, Any],
    eval_s: float,
    date: str,
) -> dict[str, Any]:
    """The score file (:mod:`nobubble.runfolder.scores`) of lm-eval's ``results``."""
    from nobubble import __version__

    samples = results.get("n-samples", {})
    scored = {
        name: {
            "alias": result.get("alias", name),
            "n_shot": _n_shot(name, results),
            "samples": samples.get(name, {}).get("effective"),
            "metrics": metrics_of(result),
        }
        for name, result in results["results"].items()
    }
    return {
        "format": FORMAT,
        "step": step,
        "version": version,
        "tasks": list(tasks),
        "headline": headline(results),
        "results": scored,
        "settings": dict(settings),
        "versions": {
            "nobubble": __version__,
            **{package: _installed(package) for package in ("lm_eval", "transformers", "torch")},
            "task_versions": dict(results.get("versions", {})),
        },
        "eval_s": round(eval_s, 3),
        "date": date,
    }


def _installed(package: str) -> str | None:
    try:
        return metadata.version(package.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return None
