"""The one-process engine: the exact semantics of every schedule, without communication.

The model is cut into the schedule's model stages (the partition), each a
:class:`~nobubble.stage_update.TrainedStage` as a pipeline process holds it: its weight versions,
its optimizer with the run's delay correction, and its update in the one order both backends
share.
At step t the forward and backward of every microbatch run with stage s at the weights its step
runs at (version max(t - d, 0) for delay d, or the prediction ŵ; through
``torch.func.functional_call``, so nothing is swapped in place under autograd), then every stage
takes its gradient and applies its update. With every delay 0 this is exactly a plain
gradient-accumulation training loop.

Tied embeddings over several stages compute what the pipeline computes: the first and the last
stage each hold a copy of the tied weight (``embed.weight``), the embedding reads the first's and
the head the last's (as separate leaves, so each accumulates its own gradient over the
microbatches, as on the two stages), both copies receive the sum of the two gradients and are
clipped by its norm alone (:mod:`nobubble.stage_update`), and each stage's optimizer steps its copy
from the same bytes, so the copies stay bitwise equal. With one stage the weight is simply shared.

With ``dp`` > 1 the one process computes what the replicas compute together: each microbatch is
the whole of what the replicas split between them, so the run equals a data-parallel pipeline's up
to the order of summation (docs/pipeline.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from copy import deepcopy
from typing import Any

import torch
from torch.func import functional_call

from nobubble.checkpoint.named_state import NamedState
from nobubble.config import TrainConfig
from nobubble.corrections.base import base_optimizer
from nobubble.engine import StepStats
from nobubble.evaluation import EvalSums
from nobubble.layout import ParallelLayout
from nobubble.model.layers import build_model, lm_loss
from nobubble.model.moe import Routing
from nobubble.model.partition import TIED_HEAD_USE, TIED_WEIGHT, stage_parameter_names, stage_specs
from nobubble.model.presets import ModelConfig
from nobubble.profiling import OFF, label, labelled
from nobubble.schedules.registry import schedule_spec
from nobubble.stage_options import apply_stage_options, autocast
from nobubble.stage_update import TrainedStage, combined_norm
from nobubble.staleness import (
    APPLIED_COSINE,
    APPLIED_ERROR,
    COSINE,
    SYNC_STEP_COSINE,
    SYNC_STEP_ERROR,
    applied_error,
    cosine,
    weight_drift,
)
from nobubble.versions import Weights, gradient_version

MicroLoss = Callable[[Weights, torch.Tensor], torch.Tensor]
Gradients = dict[str, torch.Tensor | None]  # a stage's, by the names of its trained weights
Measured = dict[str, list[float | None]]  # a step's measures: metrics key -> one per model stage


class DelayedTrainer:
    """Delayed-gradient training of any parameters split into stages with given delays.

    ``micro_loss(weights, microbatch)`` returns the mean loss of one microbatch computed with
    ``weights``; the step's gradient is the mean over its microbatches.

    ``routing()`` takes the MoE routing sums of the step's microbatches; the balance biases among
    the stages' parameters take their update from them at ``balance_rate``
    (:func:`nobubble.model.moe.balance_routers`).

    ``tied = (name, use)``: the first and the last stage both hold a parameter ``name``, copies
    of one tied weight (both stages must have the same delay: the configuration checks it).
    ``micro_loss`` finds the last stage's copy under ``use``. Both copies get the sum of their
    gradients and each its stage's update (see :mod:`nobubble.stage_update`).
    """

    def __init__(
        self,
        stage_params: Sequence[dict[str, torch.nn.Parameter]],
        delays: Sequence[int],
        micro_loss: MicroLoss,
        cfg: TrainConfig,
        tied: tuple[str, str] | None = None,
        routing: Callable[[], Routing] = dict,
        balance_rate: float = 0.0,
    ) -> None:
        last = len(stage_params) - 1
        holds_tied = {0, last} if tied is not None else set()
        self.stages = [
            TrainedStage(
                index,
                params,
                delay,
                cfg,
                tied[0] if index in holds_tied else None,
                reports_tied=index == 0,
            )
            for index, (params, delay) in enumerate(zip(stage_params, delays, strict=True))
        ]
        self.delays = list(delays)
        self.micro_loss, self.cfg, self.tied = micro_loss, cfg, tied
        self.routing, self.balance_rate = routing, balance_rate
        self.step = 0

    @property
    def stores(self) -> list:
        """Every stage's weight versions."""
        return [stage.store for stage in self.stages]

    def train_step(self, microbatches: Sequence[torch.Tensor]) -> StepStats:
        t = self.step
        cosine_due = _due(self.cfg.staleness_every, t) and any(self.delays)
        applied_due = _due(self.cfg.applied_error_every, t)
        fresh = self._fresh_gradients(microbatches) if cosine_due or applied_due else None
        weights: Weights = {}
        for stage in self.stages:
            weights.update(self._uses(stage.index, stage.at(t)))
        total = 0.0
        versions = versions_label([gradient_version(t, d) for d in self.delays])
        for index, micro in enumerate(microbatches):
            number = t * len(microbatches) + index  # over the run, as in the schedule's picture
            with label(f"F mb{number}", versions):
                loss = self.micro_loss(weights, micro)
            with label(f"B mb{number}", versions):
                (loss / len(microbatches)).backward()
            total += loss.item()
        measured: Measured = {COSINE: self._cosines(t, fresh)} if cosine_due else {}
        with label(f"STEP v{t + 1}"):
            return self._update(
                t, total / len(microbatches), measured, fresh if applied_due else None
            )

    def _fresh_gradients(self, microbatches: Sequence[torch.Tensor]) -> list[Gradients]:
        """Each stage's gradient of the step's loss with every stage at its newest weights (what a
        synchronous step would compute), without touching any ``.grad``; run before the step's
        own forwards so that its MoE routing sums are dropped, not counted."""
        newest = [s.store[s.store.newest] for s in self.stages]
        leaves = [{n: w for n, w in part.items() if w.requires_grad} for part in newest]
        weights = {
            key: tensor
            for index, part in enumerate(newest)
            for key, tensor in self._uses(index, part).items()
        }
        with label("staleness"):
            loss = sum(self.micro_loss(weights, micro) for micro in microbatches)
            flat = torch.autograd.grad(
                loss / len(microbatches),
                [w for part in leaves for w in part.values()],
                allow_unused=True,
            )
        self.routing()
        found = iter(flat)
        return [{name: next(found) for name in part} for part in leaves]

    def _cosines(self, t: int, fresh: list[Gradients]) -> list[float | None]:
        """Per stage: the cosine between its gradient at the weights step ``t`` ran at and the
        fresh one (None for a stage without a delay)."""
        out = []
        for stage, grads in zip(self.stages, fresh, strict=True):
            ran = {n: w.grad for n, w in stage.at(t).items() if w.requires_grad}
            out.append(cosine(ran.values(), (grads[n] for n in ran)) if stage.delay else None)
        return out

    def weight_drift(self) -> list[float | None]:
        """Each stage's :func:`~nobubble.staleness.weight_drift` now."""
        return [weight_drift(stage.store, stage.delay) for stage in self.stages]

    def _update(
        self, t: int, loss: float, measured: Measured, fresh: list[Gradients] | None = None
    ) -> StepStats:
        """Step ``t``'s update, once its gradients are complete: every stage in the one order;
        with the ``fresh`` gradients, each stage's applied-step error and cosine measured too
        (:func:`~nobubble.staleness.applied_error`)."""
        routing = self.routing()
        for stage in self.stages:
            stage.take_gradients(t)
        if self.tied:
            self._sum_tied_gradients()
        if fresh is not None:
            would = self._fresh_updates(t, fresh)
            sync = self._fresh_updates(t, fresh, corrected=False) if self._wraps() else would
            before = [_trained_copy(stage.params) for stage in self.stages]
        norms, skipped, lr = [], [], 0.0
        for stage in self.stages:
            norm, ok, lr = stage.apply(t, routing, self.balance_rate)
            norms.append(norm)
            if not ok:
                skipped.append(stage.index)
        if fresh is not None:
            applied = [
                {n: stage.params[n].detach() - w for n, w in old.items()}
                for stage, old in zip(self.stages, before, strict=True)
            ]
            for (error_key, cosine_key), references in (
                ((APPLIED_ERROR, APPLIED_COSINE), would),
                ((SYNC_STEP_ERROR, SYNC_STEP_COSINE), sync),
            ):
                errors = [applied_error(a, r) for a, r in zip(applied, references, strict=True)]
                measured[error_key] = [error for error, _ in errors]
                measured[cosine_key] = [cos for _, cos in errors]
        self.step += 1
        return StepStats(t, loss, combined_norm(norms), lr, skipped, routing, measured)

    def _wraps(self) -> bool:
        """Whether the stages' optimizers are wrapped in an update correction."""
        return any(base_optimizer(s.optimizer) is not s.optimizer for s in self.stages)

    def _fresh_updates(
        self, t: int, fresh: list[Gradients], corrected: bool = True
    ) -> list[Weights]:
        """Each stage's update at step ``t`` from its ``fresh`` gradient, with its correction or
        without (:meth:`~nobubble.stage_update.TrainedStage.update_from`), a tied weight's summed as
        :meth:`_sum_tied_gradients` sums it."""
        if self.tied:
            name = self.tied[0]
            like = self.stages[0].params[name]
            summed = _tied_sum(like, fresh[0][name], fresh[-1][name])
            fresh = [{**fresh[0], name: summed}, *fresh[1:-1], {**fresh[-1], name: summed}]
        return [
            stage.update_from(g, t, corrected) for stage, g in zip(self.stages, fresh, strict=True)
        ]

    def _uses(self, stage: int, weights: Weights) -> Weights:
        """``weights`` of ``stage`` under the keys ``micro_loss`` reads them by."""
        if self.tied is None or stage != len(self.stages) - 1:
            return weights
        name, use = self.tied
        return {use if key == name else key: tensor for key, tensor in weights.items()}

    def _sum_tied_gradients(self) -> None:
        """Both copies get first + last (what the pipeline's all-reduce of the two gives)."""
        name = self.tied[0]
        first, last = self.stages[0].params[name], self.stages[-1].params[name]
        first.grad = _tied_sum(first, first.grad, last.grad)
        last.grad = first.grad.clone()  # clipped on its own, like the last stage's

    def checkpoint_tensors(self) -> Weights:
        """Every version held, as ``v{version}/{name}`` (the tied copies under one name)."""
        return {key: t for stage in self.stages for key, t in stage.checkpoint_tensors().items()}

    def checkpoint_state(self) -> dict[str, Any]:
        """The step and the optimizer state by parameter name (any layout can load it); a tied
        weight's state is the first stage's (the last stage's copy is bitwise the same)."""
        skip = [self.tied[0]] if self.tied else []
        parts = [s.named_state(skip if s.index > 0 else ()) for s in self.stages]
        return {"step": self.step, "optimizer": NamedState.merge(parts)}

    def restore(self, tensors: Weights, state: dict[str, Any]) -> None:
        """Continue from a checkpoint: ``tensors`` as :meth:`checkpoint_tensors` (from any split
        into stages), ``state`` as :meth:`checkpoint_state` (optimizer state by name)."""
        self.step = state["step"]
        optimizer: NamedState = state["optimizer"]
        for stage in self.stages:
            stage.restore(tensors, self._own(stage, optimizer), self.step)

    def _own(self, stage: TrainedStage, state: NamedState) -> NamedState:
        """``state`` for ``stage`` to load: the last stage's tied copy takes a copy of the tied
        weight's state (torch's optimizers keep the tensors they load, and the two copies must
        not share their moments)."""
        if not self.tied or stage.index == 0 or self.tied[0] not in stage.params:
            return state
        tied = {self.tied[0]}
        return NamedState.merge([state.select(state.names() - tied), deepcopy(state.select(tied))])


def _due(every: int, t: int) -> bool:
    """Whether a measure taken every ``every`` steps (0: never) is taken at step ``t``."""
    return bool(every) and (t + 1) % every == 0


def _tied_sum(
    like: torch.Tensor, first: torch.Tensor | None, last: torch.Tensor | None
) -> torch.Tensor:
    """The tied weight's gradient from its two copies' (a missing one counts as zeros)."""
    first, last = (g if g is not None else torch.zeros_like(like) for g in (first, last))
    return first + last


def _trained_copy(params: dict[str, torch.nn.Parameter]) -> Weights:
    """A copy of the trained parameters among ``params``."""
    return {n: p.detach().clone() for n, p in params.items() if p.requires_grad}


class OneProcessEngine:
    """Trains the whole model in one process under the delays of ``cfg.schedule``."""

    layout = ParallelLayout(pp=1)  # a description only: one process, one checkpoint shard

    def __init__(self, cfg: TrainConfig, mc: ModelConfig, device: torch.device) -> None:
        specs = stage_specs(cfg, mc)  # interleaved: every model stage, all in one process
        delays = schedule_spec(cfg.schedule).delays(len(specs))
        self.cfg, self.device = cfg, device
        self.model = build_model(mc, cfg.seed).to(device)
        apply_stage_options(self.model, cfg, device)
        self.profiler = OFF
        params = dict(self.model.named_parameters())
        stage_params = [
            {n: params[n] for n in names} for names in stage_parameter_names(list(params), specs)
        ]
        # tied over several stages: the last stage holds a copy for the head (module docstring)
        self.split_tied = mc.tie_embeddings and len(specs) > 1
        tied = None
        if self.split_tied:
            stage_params[-1][TIED_WEIGHT] = torch.nn.Parameter(params[TIED_WEIGHT].detach().clone())
            tied = (TIED_WEIGHT, TIED_HEAD_USE)
        self.trainer = DelayedTrainer(
            stage_params,
            delays,
            self.micro_loss,
            cfg,
            tied,
            self.model.take_routing,
            mc.moe_bias_rate,
        )

    @property
    def step(self) -> int:
        return self.trainer.step

    def barrier(self) -> None:
        """Nothing to wait for in one process."""

    def stage_reports(self, digests: bool = True) -> None:
        """No stages run apart in one process."""

    def micro_loss(self, weights: Weights, micro: torch.Tensor) -> torch.Tensor:
        with autocast(self.device, self.cfg.dtype):
            # split tied copies: the head reads its own copy, not the embedding's
            tie = not self.split_tied
            logits = functional_call(self.model, weights, (micro[:, :-1],), tie_weights=tie)
        return lm_loss(logits, micro[:, 1:])

    def run_steps(
        self,
        stop: int,
        next_batch: Callable[[], torch.Tensor],
        on_step: Callable[[StepStats], None],
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        while self.step < stop and not should_stop():
            step = self.step
            self.profiler.before_step(step)
            batch = next_batch().to(self.device)
            on_step(self.trainer.train_step(batch.chunk(self.cfg.microbatches)))
            self.profiler.after_step(step)

    @torch.no_grad()
    @labelled("evaluate")
    def evaluate(self, batches: Sequence[torch.Tensor], token_bytes: torch.Tensor) -> EvalSums:
        sums = EvalSums()
        for batch in batches:
            for micro in batch.to(self.device).chunk(self.cfg.microbatches):
                with autocast(self.device, self.cfg.dtype):
                    logits = self.model(micro[:, :-1])
                sums.add(logits, micro[:, 1:], token_bytes)
        return sums

    def weight_drift(self) -> list[float | None] | None:
        """Each model stage's weight drift (:mod:`nobubble.staleness`); None where no stage has
        a gradient delay."""
        return self.trainer.weight_drift() if any(self.trainer.delays) else None

    def named_weights(self) -> Weights:
        """The newest weights (what a plain training loop would hold after ``step`` updates)."""
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def checkpoint_tensors(self) -> Weights:
        return self.trainer.checkpoint_tensors()

    def checkpoint_state(self) -> dict[str, Any]:
        return self.trainer.checkpoint_state()

    def restore(self, tensors: Weights, state: dict[str, Any]) -> None:
        self.trainer.restore(tensors, state)


def versions_label(versions: Sequence[int]) -> str:
    """``v5`` when every stage uses version 5, else each stage's (``v3,4,5``: pipedream)."""
    if len(set(versions)) == 1:
        return f"v{versions[0]}"
    return "v" + ",".join(map(str, versions))
