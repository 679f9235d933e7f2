"""The update a stage applies, once for every backend (one-process engine, pipeline, torch
baseline): :class:`TrainedStage` holds what a model stage trains with and orders its update.

A step's update runs in three parts, so that a pipeline stage can reduce its gradient across data
parallel replicas (or with a tied copy) between the first two while it computes something else:

1. :meth:`nobubble.corrections.predict.StepWeights.take_gradients`: the gradient of step ``t``,
   accumulated on the weights it was computed at, moves onto the optimizer's parameters.
2. :func:`prepare_step`: clip (or drop a non-finite gradient, so the optimizer skips the stage),
   release versions nobody will read again, and make the newest version the step's target
   (copying it first if an in-flight microbatch still reads it).
3. :func:`optimizer_step`: scheduled learning rate, optimizer step, gradients cleared.

Policy (docs/training.md): each stage clips its own parameters' gradient (no reduction across
stages, which would re-create the bubble under 2bw); a stage whose gradient norm is not finite
skips its update; the training loop aborts after ``nonfinite_patience`` such steps in a row.
Data-parallel replicas of a stage average their gradients before the clip, so clipping and the
non-finite check see what one process with the whole batch would see.

Tied embeddings split over stages (the first stage's embedding and the last stage's head share
one weight, each stage holding a copy, see :mod:`nobubble.model`): the tied weight's gradient is
the sum of both stages' gradients, the same bytes on both (the backend sums them before
:func:`prepare_step`). It forms its own clipping group: it is clipped by its own norm, on both
stages alike (identical bytes, identical factor), and each stage's other parameters are clipped
as before; a non-finite tied gradient makes both copies skip, whatever the rest of either stage
does. The first stage's reported norm includes the tied norm, the last stage's does not, so that
:func:`combined_norm` over the stages counts it once.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from copy import deepcopy
from typing import Any

import torch

from nobubble.checkpoint.files import CheckpointError
from nobubble.checkpoint.named_state import NamedState, load_named_state, named_state
from nobubble.config import TrainConfig
from nobubble.corrections.base import base_optimizer
from nobubble.corrections.predict import StepWeights
from nobubble.corrections.registry import predicts, wrap_optimizer
from nobubble.model.moe import Routing, balance_routers
from nobubble.optim.clipping import clip_grad_norm
from nobubble.optim.composite import OptimizerLike
from nobubble.optim.lr_schedule import lr_at, set_lr
from nobubble.optim.registry import build_optimizer
from nobubble.versions import VersionStore, Weights, gradient_version
from nobubble.zero_partition import ShardPlan


def build_stage_optimizer(
    named_params: list[tuple[str, torch.nn.Parameter]], cfg: TrainConfig, delay: int
) -> OptimizerLike:
    """The optimizer of one model stage (whose gradients come ``delay`` steps late), wrapped in
    the update or gradient correction ``cfg`` chooses, if any."""
    return wrap_optimizer(build_optimizer(named_params, cfg), cfg, delay)


class TrainedStage:
    """One model stage under training, the same in both backends: its parameters' weight
    versions, where its steps run (its delayed version, or the prediction ŵ), its optimizer with
    the run's delay correction, and :meth:`apply`, the one order of its update.

    ``tied``: the name of the tied weight if the stage holds one of its two copies;
    ``reports_tied``: whether its reported norm includes that weight's (the first stage's does);
    ``shard``: with sharded data parallelism (``zero`` > 0), the part of the parameters this
    replica updates, its optimizer and correction holding state for that part alone (the other
    replicas' parts of the new version come from them: :mod:`nobubble.pipeline.sharded_update`).
    """

    def __init__(
        self,
        index: int,
        params: dict[str, torch.nn.Parameter],
        delay: int,
        cfg: TrainConfig,
        tied: str | None = None,
        reports_tied: bool = False,
        shard: ShardPlan | None = None,
    ) -> None:
        self.index, self.delay, self.cfg = index, delay, cfg
        self.tied, self.reports_tied = tied, reports_tied
        self.store = VersionStore(params)
        self.point = StepWeights(self.store, delay, predicts(cfg))
        self.shard = shard
        # with sharded state: this replica's parts of the newest version, which its optimizer
        # steps (views, pointed again at the newest version before every step)
        self.parts: dict[str, torch.nn.Parameter] | None = None
        if shard is not None:
            self.parts = {
                p.name: torch.nn.Parameter(p.of(params[p.name].data)) for p in shard.parts()
            }
            if not self.parts:
                raise ValueError(
                    f"model stage {index}: replica {shard.replica} of {shard.dp} would update no "
                    "parameter (the stage has fewer parameters than replicas to share them); "
                    "use fewer replicas or zero=0"
                )
        self.optimizer = build_stage_optimizer(list(self.stepped.items()), cfg, delay)
        self.versions_peak = 1

    @property
    def params(self) -> dict[str, torch.nn.Parameter]:
        """The newest version (the optimizer's parameters, without sharded state)."""
        return self.store.params

    @property
    def stepped(self) -> dict[str, torch.nn.Parameter]:
        """What the optimizer steps: the parameters, or this replica's parts of them."""
        return self.store.params if self.parts is None else self.parts

    def at(self, step: int) -> Weights:
        """The weights every forward and backward of ``step`` runs at."""
        return self.point.at(step)

    def take_gradients(self, step: int) -> None:
        """Part 1: the gradient of ``step`` (complete) onto the optimizer's parameters."""
        self.point.take_gradients(step)

    def apply(
        self,
        step: int,
        routing: Routing,
        balance_rate: float,
        norms: tuple[float, float | None] | None = None,
    ) -> tuple[float, bool, float]:
        """Parts 2 and 3, once the gradient is complete (summed with a tied copy's, averaged over
        replicas): clip and set up the versions, move the MoE balance biases by the step's
        ``routing``, step the optimizer on the newest version. ``norms``: the gradient's norms
        where this process holds only a part of it (sharded state: the stage's but the tied
        weight's, and the tied weight's), else measured here. Returns (gradient norm before
        clipping, whether the update went ahead in full, learning rate)."""
        norm, ok = prepare_step(
            self.store,
            step,
            self.point.history,
            self.cfg.grad_clip,
            self.tied,
            self.reports_tied,
            self.parts,
            norms,
        )
        self.versions_peak = max(self.versions_peak, self.point.copies())
        if self.parts is not None:  # the step writes the newest version, wherever it is now
            for part in self.shard.parts():
                self.parts[part.name].data = part.of(self.store.params[part.name].data)
        balance_routers(self.store.params, routing, balance_rate)
        lr = optimizer_step(self.optimizer, step, self.cfg)
        return norm, ok, lr

    def update_from(self, grads: Weights, step: int, corrected: bool = True) -> Weights:
        """The update w[t+1] - w[t] of the trained parameters that :meth:`apply` would make at
        ``step`` (= t) from ``grads`` (by parameter name; complete, as a tied weight's summed
        with its copy's) in place of the stage's own gradient: clipped by the same rule and
        stepped by a second optimizer and correction loaded with a copy of the stage's state (as a
        checkpoint holds it) at the step's learning rate, on copies of the newest weights, so
        that nothing of the stage changes. ``corrected=False``: by the base optimizer alone,
        without the update correction that wraps it (the step a synchronous run takes from the
        same optimizer state). Call it before :meth:`apply` (it reads the state step t starts
        from); the whole stage (no ``shard``)."""
        copies = {
            name: torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            for name, p in self.params.items()
        }
        if corrected:
            optimizer = build_stage_optimizer(list(copies.items()), self.cfg, self.delay)
            state = self.optimizer.state_dict()
        else:
            optimizer = build_optimizer(list(copies.items()), self.cfg)
            state = base_optimizer(self.optimizer).state_dict()
        # a copy: torch's optimizers keep the tensors they load
        optimizer.load_state_dict(deepcopy(state))
        for name, grad in grads.items():
            copies[name].grad = None if grad is None else grad.clone()
        clip_gradients(copies, self.cfg.grad_clip, self.tied, self.reports_tied)
        optimizer_step(optimizer, step, self.cfg)
        return {
            name: copies[name].detach() - p.detach()
            for name, p in self.params.items()
            if p.requires_grad
        }

    def checkpoint_tensors(self) -> Weights:
        """Every version held, as ``v{version}/{name}``."""
        return {
            f"v{version}/{name}": tensor
            for version, weights in self.store.snapshot().items()
            for name, tensor in weights.items()
        }

    def named_state(self, skip: Collection[str] = ()) -> NamedState:
        """The optimizer and correction state by parameter name, but for ``skip``."""
        state = named_state(self.optimizer)
        return state.select(state.names() - set(skip)) if skip else state

    def restore(self, tensors: Weights, optimizer: NamedState, step: int) -> None:
        """Continue at ``step`` from a checkpoint of any layout: ``tensors`` as
        :meth:`checkpoint_tensors` wrote them (at least this stage's), ``optimizer`` a named
        state covering (at least) this stage's parameters."""
        self.store.load(versions_from_tensors(tensors, self.params, step, self.point.history))
        if self.shard is not None:
            optimizer = self.shard.slice_state(optimizer)
            for part in self.shard.parts():
                self.parts[part.name].data = part.of(self.store.params[part.name].data)
        load_named_state(self.optimizer, optimizer, skip_unowned=True)

    def state_mb(self) -> float:
        """The optimizer's and the correction's state this process holds, in MiB."""
        return self.named_state().nbytes() / 2**20


def versions_from_tensors(
    tensors: Weights, params: dict[str, torch.Tensor], step: int, history: int
) -> dict[int, Weights]:
    """Invert :meth:`TrainedStage.checkpoint_tensors` for the parameters ``params`` of a stage
    that keeps its versions ``history`` steps back at ``step``: it must find exactly the versions
    max(step - history, 0) .. step of every parameter, those that the stage holds after ``step``
    updates."""
    found: dict[int, Weights] = {}
    for key, tensor in tensors.items():
        version, name = key.split("/", 1)
        if name in params:
            found.setdefault(int(version[1:]), {})[name] = tensor
    needed = list(range(gradient_version(step, history), step + 1))
    for name in params:
        held = sorted(v for v, weights in found.items() if name in weights)
        if held != needed:
            raise CheckpointError(
                f"the checkpoint of step {step} holds weight versions {held} of {name}, and a "
                f"stage that keeps {history} steps of history needs versions {needed}: it was "
                "saved under another schedule, stage split or correction"
            )
    return {v: found[v] for v in needed}


def prepare_step(
    store: VersionStore,
    step: int,
    history: int,
    grad_clip: float,
    tied: str | None = None,
    reports_tied: bool = False,
    parts: dict[str, torch.nn.Parameter] | None = None,
    norms: tuple[float, float | None] | None = None,
) -> tuple[float, bool]:
    """Clip the stage's gradient and set up the versions for the optimizer step of ``step``.

    ``history``: how many steps back the stage keeps its versions (its gradient delay; one more
    under weight prediction: :attr:`nobubble.corrections.predict.StepWeights.history`).
    ``tied``: the name of the tied weight if this stage holds one of its two copies (its gradient
    already summed over both); ``reports_tied``: whether the returned norm includes it (the
    first stage's does). ``parts`` and ``norms``: with sharded state, the parts the gradient is
    on and the norms of the whole gradient (of the stage but the tied weight, of the tied
    weight). Returns (gradient norm before clipping, whether the stage's update goes ahead in
    full).
    """
    params = store.params if parts is None else parts
    norm, ok = clip_gradients(params, grad_clip, tied, reports_tied, norms)
    store.release_older_than(gradient_version(step + 1, history))
    store.begin_step(still_needed=history > 0)
    return norm, ok


def optimizer_step(optimizer: Any, step: int, cfg: TrainConfig) -> float:
    """Step ``optimizer`` at the scheduled learning rate of ``step``; return that rate."""
    lr = lr_at(step, cfg)
    set_lr(optimizer, lr)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lr


def clip_gradients(
    params: dict[str, torch.nn.Parameter],
    grad_clip: float,
    tied: str | None = None,
    reports_tied: bool = False,
    norms: tuple[float, float | None] | None = None,
) -> tuple[float, bool]:
    """Clip the gradient on a stage's ``params`` by the stage's rule (:func:`prepare_step` says
    what the arguments mean); returns (norm before clipping, whether the update goes ahead)."""
    if tied is None:
        return clip_stage(params.values(), grad_clip, None if norms is None else norms[0])
    return clip_with_tied(params, tied, grad_clip, reports_tied, norms)


def clip_stage(
    params: Iterable[torch.nn.Parameter], max_norm: float, norm: float | None = None
) -> tuple[float, bool]:
    """Clip one stage's gradients (by ``norm`` if given: the norm of a gradient of which
    ``params`` hold a part); drop them if non-finite so the optimizer skips the stage.

    Returns (norm before clipping, whether the update goes ahead).
    """
    params = [p for p in params if p.grad is not None]
    norm = clip_grad_norm(params, max_norm, norm)
    if math.isfinite(norm):
        return norm, True
    for p in params:
        p.grad = None
    return norm, False


def clip_with_tied(
    params: dict[str, torch.nn.Parameter],
    tied: str,
    max_norm: float,
    reports_tied: bool,
    norms: tuple[float, float | None] | None = None,
) -> tuple[float, bool]:
    """Clip a stage that holds a copy of the tied weight ``tied``: the tied weight by its own
    norm, the other parameters together by theirs (``norms``: both given, where ``params`` hold
    parts of the gradient); either group is dropped if its norm is not finite. Returns (the
    others' norm, combined with the tied norm if ``reports_tied``; whether both groups go
    ahead)."""
    others, tied_norm = (None, None) if norms is None else norms
    norm, ok = clip_stage([p for name, p in params.items() if name != tied], max_norm, others)
    copy = [params[tied]] if tied in params else []  # sharded: this replica may hold none of it
    tied_norm, tied_ok = clip_stage(copy, max_norm, tied_norm)
    if reports_tied:
        norm = combined_norm([norm, tied_norm])
    return norm, ok and tied_ok


def combined_norm(norms: Iterable[float]) -> float:
    """The norm of the whole model's gradient from its stages' norms."""
    return math.sqrt(sum(n * n for n in norms))
