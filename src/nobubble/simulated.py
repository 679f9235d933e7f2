"""The single-process engine: the exact semantics of every schedule, without communication.

Stage s with delay d holds its weight versions in a :class:`VersionStore`. At step t the forward
and backward of every microbatch run with stage s at version max(t - d, 0) (through
``torch.func.functional_call``, so nothing is swapped in place under autograd), the gradient is
moved onto the optimizer's parameters, and the optimizer steps the newest version. With every
delay 0 this is exactly a plain gradient-accumulation training loop.

Tied embeddings over several stages compute what the pipeline computes: the first and the last
stage each hold a copy of the tied weight (``embed.weight``), the embedding reads the first's and
the head the last's (as separate leaves, so each accumulates its own gradient over the
microbatches, as on the two stages), both copies receive the sum of the two gradients and are
clipped by its norm alone (:mod:`nobubble.update`), and both take the same update: the optimizer
steps the first stage's copy, the last stage's takes its value (the pipeline's last stage
computes the same update from the same bytes). With one stage the weight is simply shared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.func import functional_call

from nobubble.checkpoint import CheckpointError
from nobubble.config import ConfigError, TrainConfig, chosen_corrections
from nobubble.engine import StepStats
from nobubble.evaluation import EvalSums
from nobubble.layout import ParallelLayout
from nobubble.model.layers import build_model, lm_loss
from nobubble.model.moe import Routing, balance_routers
from nobubble.model.partition import TIED_HEAD_USE, TIED_WEIGHT, partition, stage_parameter_names
from nobubble.model.presets import ModelConfig
from nobubble.optim import build_optimizer
from nobubble.optim.named_state import load_named_state, named_state
from nobubble.prediction import StepWeights
from nobubble.profiling import OFF, label, labelled
from nobubble.schedules.registry import schedule_spec
from nobubble.stage_options import apply_stage_options
from nobubble.update import combined_norm, optimizer_step, prepare_step
from nobubble.versions import VersionStore, Weights, gradient_version


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    if dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


MicroLoss = Callable[[Weights, torch.Tensor], torch.Tensor]


class DelayedTrainer:
    """Delayed-gradient training of any parameters split into stages with given delays.

    ``micro_loss(weights, microbatch)`` returns the mean loss of one microbatch computed with
    ``weights``; the step's gradient is the mean over its microbatches.

    ``routing()`` takes the MoE routing sums of the step's microbatches; the balance biases among
    the stages' parameters take their update from them at ``balance_rate``
    (:func:`nobubble.model.moe.balance_routers`).

    ``tied = (name, use)``: the first and the last stage both hold a parameter ``name``, copies
    of one tied weight; the optimizer holds the first stage's. ``micro_loss`` finds the last
    stage's copy under ``use``. Both copies get the sum of their gradients and the same update
    (see :mod:`nobubble.update`).

    With ``correction=predict`` every stage with a delay runs its steps at the weight prediction
    ŵ instead (:mod:`nobubble.prediction`).
    """

    def __init__(
        self,
        stage_params: Sequence[dict[str, torch.nn.Parameter]],
        delays: Sequence[int],
        optimizer: Any,
        micro_loss: MicroLoss,
        cfg: TrainConfig,
        tied: tuple[str, str] | None = None,
        routing: Callable[[], Routing] = dict,
        balance_rate: float = 0.0,
    ) -> None:
        self.stores = [VersionStore(params) for params in stage_params]
        self.routing, self.balance_rate = routing, balance_rate
        predict = "predict" in chosen_corrections(cfg)
        self.points = [
            StepWeights(store, delay, predict)
            for store, delay in zip(self.stores, delays, strict=True)
        ]
        self.delays, self.optimizer, self.micro_loss, self.cfg = (
            list(delays),
            optimizer,
            micro_loss,
            cfg,
        )
        if tied is not None and (len(self.stores) < 2 or len(set(self.delays)) > 1):
            raise ValueError("tied copies need two stages or more, all with the same delay")
        self.tied = tied
        self.step = 0

    def train_step(self, microbatches: Sequence[torch.Tensor]) -> StepStats:
        t = self.step
        used = [gradient_version(t, d) for d in self.delays]
        weights: Weights = {}
        for stage, point in enumerate(self.points):
            weights.update(self._uses(stage, point.at(t)))
        total = 0.0
        versions = versions_label(used)
        for index, micro in enumerate(microbatches):
            number = t * len(microbatches) + index  # over the run, as in the schedule's picture
            with label(f"F mb{number}", versions):
                loss = self.micro_loss(weights, micro)
            with label(f"B mb{number}", versions):
                (loss / len(microbatches)).backward()
            total += loss.item()
        with label(f"STEP v{t + 1}"):
            return self._update(t, total / len(microbatches))

    def _update(self, t: int, loss: float) -> StepStats:
        """Step ``t``'s update, once its gradients are complete."""
        cfg = self.cfg
        routing = self.routing()
        for point in self.points:
            point.take_gradients(t)
        if self.tied:
            self._sum_tied_gradients()
        norms, skipped = [], []
        for stage, store in enumerate(self.stores):
            tied = self.tied[0] if self.tied and stage in (0, len(self.stores) - 1) else None
            norm, ok = prepare_step(
                store, t, self.points[stage].history, cfg.grad_clip, tied, reports_tied=stage == 0
            )
            norms.append(norm)
            if not ok:
                skipped.append(stage)
            balance_routers(store.params, routing, self.balance_rate)
        lr = optimizer_step(self.optimizer, t, cfg)
        if self.tied:
            self._copy_tied_update()
        self.step += 1
        return StepStats(t, loss, combined_norm(norms), lr, skipped, routing)

    def _uses(self, stage: int, weights: Weights) -> Weights:
        """``weights`` of ``stage`` under the keys ``micro_loss`` reads them by."""
        if self.tied is None or stage != len(self.stores) - 1:
            return weights
        name, use = self.tied
        return {use if key == name else key: tensor for key, tensor in weights.items()}

    def _tied_copies(self) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
        name = self.tied[0]
        return self.stores[0].params[name], self.stores[-1].params[name]

    def _sum_tied_gradients(self) -> None:
        """Both copies get first + last (what the pipeline's all-reduce of the two gives)."""
        first, last = self._tied_copies()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in (first, last)]
        first.grad = grads[0] + grads[1]
        last.grad = first.grad.clone()  # clipped on its own, like the last stage's

    @torch.no_grad()
    def _copy_tied_update(self) -> None:
        """The last stage's copy takes the update the optimizer gave the first stage's (the
        pipeline's last stage computes it itself, from the same bytes)."""
        first, last = self._tied_copies()
        last.data.copy_(first.data)
        last.grad = None

    def checkpoint_tensors(self) -> Weights:
        """Every version held, as ``v{version}/{name}``."""
        return {
            f"v{version}/{name}": tensor
            for store in self.stores
            for version, weights in store.snapshot().items()
            for name, tensor in weights.items()
        }

    def checkpoint_state(self) -> dict[str, Any]:
        """The step and the optimizer state by parameter name (any layout can load it)."""
        return {"step": self.step, "optimizer": named_state(self.optimizer)}

    def restore(self, tensors: Weights, state: dict[str, Any]) -> None:
        """Continue from a checkpoint: ``tensors`` as :meth:`checkpoint_tensors` (from any split
        into stages), ``state`` as :meth:`checkpoint_state` (optimizer state by name)."""
        self.step = state["step"]
        for point in self.points:
            store = point.store
            store.load(versions_from_tensors(tensors, store.params, self.step, point.history))
        load_named_state(self.optimizer, state["optimizer"])


class SimulatedEngine:
    """Trains the whole model in one process under the delays of ``cfg.schedule``."""

    layout = ParallelLayout(pp=1)  # a description only: one process, one checkpoint shard

    def __init__(self, cfg: TrainConfig, mc: ModelConfig, device: torch.device) -> None:
        stages = cfg.model_stages()  # interleaved: every model stage, one process for all
        delays = schedule_spec(cfg.schedule).delays(stages)
        if mc.tie_embeddings and len(set(delays)) > 1:
            raise ConfigError(
                f"{cfg.schedule} gives the embedding (stage 0) and the head (stage "
                f"{stages - 1}) different delays, which a tied weight cannot have; set "
                "tie_embeddings=false"
            )
        self.cfg, self.device = cfg, device
        self.model = build_model(mc, cfg.seed).to(device)
        apply_stage_options(self.model, cfg, device)
        self.profiler = OFF
        params = dict(self.model.named_parameters())
        specs = partition(mc.n_layers, stages, cfg.embed_cost, cfg.head_cost, cfg.stage_layers)
        stage_params = [
            {n: params[n] for n in names} for names in stage_parameter_names(list(params), specs)
        ]
        optimizer = build_optimizer(list(params.items()), cfg)
        # tied over several stages: the last stage holds a copy for the head (module docstring)
        self.split_tied = mc.tie_embeddings and stages > 1
        tied = None
        if self.split_tied:
            stage_params[-1][TIED_WEIGHT] = torch.nn.Parameter(params[TIED_WEIGHT].detach().clone())
            tied = (TIED_WEIGHT, TIED_HEAD_USE)
        self.trainer = DelayedTrainer(
            stage_params,
            delays,
            optimizer,
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


def versions_from_tensors(
    tensors: Weights, params: dict[str, torch.Tensor], step: int, history: int
) -> dict[int, Weights]:
    """Invert ``checkpoint_tensors`` for the parameters ``params`` of a stage that keeps its
    versions ``history`` steps back (:attr:`StepWeights.history`) at ``step``: it must find
    exactly the versions max(step - history, 0) .. step of every parameter, those that the stage
    holds after ``step`` updates."""
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
