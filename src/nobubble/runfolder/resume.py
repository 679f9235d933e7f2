"""Opening a run folder to train into: a new run, an explicit resume, or an automatic one.

A resumed run continues from the newest checkpoint whose checksums verify (older ones are the
fallback when the newest is corrupt), with the saved configuration: only the fields in
``SAFE_TO_CHANGE`` may differ, everything else would make the continuation a different run. The
parallel layout (``LAYOUT``: stages, their split, dp) may change where every parameter keeps its
gradient delay, so that the checkpoint holds exactly the weight versions the new layout needs:
checkpoints are keyed by parameter name and load into any layout, in either launcher.

Opening checks everything it can up front and changes no file: the caller sets the run up in
``work``, then :meth:`commit` makes it the run (or :meth:`discard` undoes the setup). Nothing
here ever deletes a run it was asked to continue.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import warnings
from dataclasses import dataclass
from pathlib import Path

from nobubble.checkpoint.files import CheckpointError, check_format, checkpoint_step, read_meta
from nobubble.config import FIELDS, ConfigError, NobubbleWarning, TrainConfig
from nobubble.config.fields import FREE
from nobubble.config.fields import LAYOUT as LAYOUT_CHANGE
from nobubble.configure import build_config
from nobubble.destinations import check_output_folder
from nobubble.json_files import DamagedFile
from nobubble.layout import ParallelLayout
from nobubble.model.partition import stage_specs
from nobubble.model.resolve import model_config
from nobubble.runfolder.folder import RunFolder, holds_files, run_path
from nobubble.runfolder.lock import hold_run_folder
from nobubble.runfolder.new import NewRun, target_of, tidy_leftovers
from nobubble.runfolder.reading import (
    checkpoint_config,
    checkpoints,
    has_metrics,
    latest_valid_checkpoint,
    read_metrics,
    saved_train_config,
    tokenizer_digest,
    tokenizer_path,
)
from nobubble.schedules.registry import schedule_spec
from nobubble.tracking import require_loggers

# What a continued run may change: the settings that change no step's result, and the parallel
# layout where each parameter keeps its gradient delay (each field says which: config/fields.py).
SAFE_TO_CHANGE = frozenset(key for key, f in FIELDS.items() if f.metadata["resume"] == FREE)
LAYOUT = frozenset(key for key, f in FIELDS.items() if f.metadata["resume"] == LAYOUT_CHANGE)

# Why a field cannot change, where the generic "it would be another run" says too little.
WHY_NOT = {
    "schedule": (
        "the schedule fixes every stage's gradient delay, hence the weight versions the "
        "checkpoint holds and how every later step is computed"
    ),
}


class RunFinished(Exception):
    """The run has trained all its steps already: there is nothing to do (not an error)."""


def resumed_config(run_dir: Path, *layers: dict) -> TrainConfig:
    """The saved config of ``run_dir`` with ``layers`` applied, if they only change safe fields."""
    for layer in layers:
        out = layer.get("out")
        if out is not None and Path(out).resolve() != run_dir.resolve():
            raise ConfigError(
                f"--resume continues {run_dir} in place, so out={out} cannot apply; drop --out "
                "(to branch a run, copy its folder and resume the copy)"
            )
    saved = saved_train_config(run_dir)
    cfg = _continued_config(saved, layers, {"out": str(run_dir)})
    check_compatible(saved, cfg, run_dir)
    return cfg


def _continued_config(saved: TrainConfig, layers: tuple[dict, ...], out: dict) -> TrainConfig:
    """``saved`` with ``layers`` applied. The split ``partition=flops`` resolved (saved as
    ``stage_layers``) is one for the run's number of model stages: where the layers give
    another number and no split of their own, the rule splits the model again for the new
    layout, as it would a new run's (whether the delays allow it is checked after)."""
    if saved.partition == "flops" and not any("stage_layers" in layer for layer in layers):
        by_rule = build_config({**saved.to_dict(), "stage_layers": None}, *layers, out)
        if ParallelLayout.of(by_rule).model_stages != len(saved.stage_layers or []):
            return by_rule
    return build_config(saved.to_dict(), *layers, out)


def check_compatible(saved: TrainConfig, cfg: TrainConfig, run_dir: Path) -> None:
    for key in FIELDS:
        old, new = getattr(saved, key), getattr(cfg, key)
        if key not in SAFE_TO_CHANGE | LAYOUT and old != new:
            why = f" ({WHY_NOT[key]})" if key in WHY_NOT else ""
            raise ConfigError(
                f"cannot continue {run_dir} with {key}={new!r}: the run was trained with "
                f"{key}={old!r}, and {key} cannot change within a run{why}. Start a new run "
                f"(another --out) or keep {key}; only {', '.join(sorted(SAFE_TO_CHANGE))} may "
                f"change, and the layout ({', '.join(sorted(LAYOUT))}) where the schedule allows"
            )
    check_layout_change(saved, cfg, run_dir)


def _layout_changes(saved: TrainConfig, cfg: TrainConfig) -> list[str]:
    return [
        f"{key}={getattr(cfg, key)!r} (was {getattr(saved, key)!r})"
        for key in sorted(LAYOUT & set(FIELDS))
        if getattr(saved, key) != getattr(cfg, key)
    ]


def unit_stages(cfg: TrainConfig) -> dict[str, int]:
    """The stage of every part of the model (the embedding, each block, the head) under ``cfg``."""
    # the vocabulary only weighs the head in a split partition=flops has still to make (a new
    # number of model stages: _continued_config); only pipedream's delays differ by stage, and
    # it refuses a new number of stages whatever the split (the table in docs/reliability.md)
    mc = model_config(cfg, tokenizer_vocab=1)
    owner: dict[str, int] = {}
    for spec in stage_specs(cfg, mc):
        if spec.has_embed:
            owner["the embedding"] = spec.index
        owner.update({f"block {block}": spec.index for block in spec.blocks})
        if spec.has_head:
            owner["the head"] = spec.index
    return owner


def check_layout_change(saved: TrainConfig, cfg: TrainConfig, run_dir: Path) -> None:
    """Refuse a new layout under which some parameter would train with another gradient delay:
    the checkpoint holds the weight versions of the old delay, and the continuation would not be
    what any uninterrupted run computes (pipedream: stage s of P has delay P-1-s)."""
    changes = _layout_changes(saved, cfg)
    if not changes:
        return
    old_stage, new_stage = unit_stages(saved), unit_stages(cfg)
    split = ", ".join(
        f"{key}={getattr(saved, key)!r}"
        for key in ("stages", "chunks", "stage_layers", "embed_cost", "head_cost")
        if key == "stages" or getattr(saved, key) != getattr(cfg, key)
    )
    old_delay = schedule_spec(saved.schedule).delays(ParallelLayout.of(saved).model_stages)
    new_delay = schedule_spec(cfg.schedule).delays(ParallelLayout.of(cfg).model_stages)
    for unit, stage in old_stage.items():
        before, after = old_delay[stage], new_delay[new_stage[unit]]
        if before != after:
            raise ConfigError(
                f"cannot continue {run_dir} with {', '.join(changes)}: under {cfg.schedule} a "
                f"stage's gradient delay depends on its place in the pipeline (stage s of P: "
                f"P-1-s), so {unit} would move from delay {before} to {after}; the checkpoint "
                f"holds the weight versions of delay {before}, and no uninterrupted run trains "
                f"that way. Keep the run's stage split ({split}) to continue it"
            )


def split_change_note(saved: TrainConfig, cfg: TrainConfig, step: int) -> str | None:
    """A warning for a new stage split under per-stage gradient clipping, else None."""
    if cfg.grad_clip <= 0:
        return None

    def groups(owner: dict[str, int]) -> set[frozenset[str]]:
        return {frozenset(u for u, s in owner.items() if s == stage) for stage in owner.values()}

    if groups(unit_stages(saved)) == groups(unit_stages(cfg)):
        return None
    return (
        f"gradients are clipped per stage (grad_clip={cfg.grad_clip}), so from step {step} on "
        f"they are clipped over the {ParallelLayout.of(cfg).model_stages} new stages, not the "
        f"{ParallelLayout.of(saved).model_stages} of the run "
        "so far: the continuation is exactly what the new split computes from the checkpoint, "
        "but not what the old split would have computed (set grad_clip=0 at the start of a run "
        "for a clip-free run that can change its split without any difference)"
    )


def metrics_up_to(run: RunFolder, step: int, at_step: list[dict]) -> str | None:
    """metrics.jsonl as the run continuing from ``step`` has it (None: there is none): the lines
    up to ``step`` (the resumed run writes the later ones again), without damaged lines (a line
    cut short by a hard kill), with a warning if there were any. ``at_step``: the lines of
    ``step`` its checkpoint keeps, written again if metrics.jsonl has lost them (its last line
    cut short after the checkpoint was saved), since the resumed run starts after ``step``."""
    if not has_metrics(run.path):
        return None
    metrics = read_metrics(run.path)
    lines, damaged = metrics.lines, metrics.damaged
    kept = [text for text, record in lines if _step_of(record) <= step]
    lost = not any(_step_of(record) == step for _, record in lines)
    restored = [json.dumps(record) for record in at_step] if lost else []
    if damaged:
        again = f"; step {step}'s line is restored from its checkpoint" if restored else ""
        warnings.warn(
            f"{run.metrics_path}: dropping {damaged} damaged line(s) (cut short by a hard kill, "
            f"or garbage){again}",
            NobubbleWarning,
            stacklevel=2,
        )
    return "".join(text + "\n" for text in kept + restored)


def _step_of(record: dict) -> float:
    step = record.get("step", 0)
    return step if isinstance(step, int | float) else 0


def check_replaceable(path: Path) -> None:
    """A file the run will write anew (summary.json) must be a file, if it exists at all."""
    if path.exists() and not path.is_file():
        raise DamagedFile(
            f"{path} is not a file, and the run writes its {path.name} there; move it away"
        )


def resume_command(run_dir: Path, processes: int) -> str:
    """The command that continues ``run_dir`` with ``processes`` processes (its layout)."""
    launcher = f"torchrun --nproc-per-node {processes} -m nobubble" if processes > 1 else "nobubble"
    return f"{launcher} train --resume {shlex.quote(str(run_dir))}"


@dataclass
class Resumption:
    """A run to continue from ``checkpoint``, set up in place: the setup writes nothing, and
    :meth:`commit` updates config.json and metrics.jsonl (``metrics``: its new text, None to
    leave it absent) for the continuation."""

    cfg: TrainConfig
    work: Path
    checkpoint: Path
    metrics: str | None

    def commit(self) -> RunFolder:
        run = RunFolder(self.work)
        run.write_config(self.cfg)
        if self.metrics is not None:
            tmp = run.metrics_path.with_name(".metrics.jsonl.tmp")
            tmp.write_text(self.metrics)
            tmp.replace(run.metrics_path)
        tidy_leftovers(Path(os.path.realpath(self.work)))
        return run

    def discard(self) -> None:
        """Nothing to undo."""


def reopen(cfg: TrainConfig, path: Path, flag: str) -> Resumption:
    """Check that ``path`` (given as ``flag``) holds this run and a checkpoint it can continue
    from (a checkpoint of any number of shards loads into any layout that ``cfg`` allows,
    :func:`check_layout_change`).
    """
    check_compatible(saved_train_config(path), cfg, path)
    # the run writes its metrics and checkpoints into it
    check_output_folder(path, flag, fix="make it writable, or copy the run and resume the copy")
    found = latest_valid_checkpoint(path)
    if found is None:
        tried = len(checkpoints(path))
        why = f"{tried} failed verification, see the warnings above" if tried else "it has none"
        raise CheckpointError(
            f"{path} holds no complete checkpoint to resume from ({why}); nothing was changed. "
            "Restore its checkpoints to continue it, start it over with --overwrite (which "
            "replaces the folder), or choose another --out"
        )
    checkpoint, manifest = found
    step = checkpoint_step(checkpoint)
    if step == cfg.steps:
        raise RunFinished(
            f"{path} is finished: it trained all {step} steps; nothing to do (pass a larger "
            "steps=N to train on)"
        )
    if step > cfg.steps:
        raise ConfigError(
            f"{path} has trained {step} steps, more than steps={cfg.steps}; pass steps={step} "
            "or more"
        )
    check_format(checkpoint, manifest)
    meta = read_meta(checkpoint)
    at_checkpoint = checkpoint_config(path, meta)
    run = RunFolder(path)
    check_replaceable(run.summary_path)
    metrics = metrics_up_to(run, step, meta.get("metrics", []))  # older checkpoints: none
    check_layout_change(at_checkpoint, cfg, path)
    note = split_change_note(at_checkpoint, cfg, step)
    if note:
        warnings.warn(
            f"continuing {path} with another stage split: {note}", NobubbleWarning, stacklevel=2
        )
    if meta.get("tokenizer_sha256") != tokenizer_digest(path):
        raise CheckpointError(
            f"{tokenizer_path(path)} is not the tokenizer {checkpoint} was trained with; "
            "restore the run's original tokenizer.json"
        )
    return Resumption(cfg, path, checkpoint, metrics)


def open_run(
    cfg: TrainConfig,
    held: contextlib.ExitStack,
    overwrite: bool = False,
    resume: bool = False,
    auto_resume: bool = False,
) -> NewRun | Resumption:
    """Check up front and prepare the run to train, changing no file of an existing run.

    The run folder (an existing one, and the setup folder that becomes the new one) is locked
    until ``held`` closes: a second process opening the same folder (two ``--auto-resume`` jobs,
    an ``--overwrite`` of a run in progress) is refused before it reads or changes anything.

    ``resume``: continue the run in ``cfg.out`` (it must have a valid checkpoint). ``auto_resume``:
    the same if that folder holds anything, else start a new run there. Raises
    :class:`RunFinished` when the run has trained all ``cfg.steps`` steps.

    Every path it returns is absolute: under torchrun the leader's answer goes to every rank, and
    a rank on another node (another working directory) must find the same folder.
    """
    require_loggers(cfg)  # the leader's loggers: a missing package fails before any work
    if auto_resume and not cfg.out:
        raise ConfigError(
            "--auto-resume needs --out: it continues the run in that folder (without --out "
            "every run gets a new one)"
        )
    path = Path(os.path.abspath(run_path(cfg)))
    if target_of(path).is_dir():
        hold_run_folder(target_of(path), held, path)
    if resume or (auto_resume and holds_files(path)):
        return reopen(cfg, path, "--resume" if resume else "--out")
    setup = NewRun(cfg, path, overwrite)
    try:
        hold_run_folder(setup.work, held, path)  # renamed into place, it stays locked
    except BaseException:
        setup.discard()
        raise
    return setup
