"""One pipeline process: executes its action list of the schedule IR on real tensors.

The process holds one model stage, or several under an interleaved schedule (the layout's
``chunks``) or two under the V placement (zb-v, dualpipev: stages r and 2P-1-r, where the turn from
stage P-1 to P is handed over in memory, not sent; docs/pipeline.md); each is a
:class:`nobubble.pipeline.held_stage.HeldStage` with its slice of the model and its weight versions
(:class:`nobubble.versions.VersionStore`, the same as the one-process engine's), and every action
names the stage it runs on. Every F runs with the version its action names and every B with the
same one (weight stashing through ``functional_call``, never an in-place swap); a STEP clips, steps
the optimizer on the newest version and, when microbatches in flight still need it, first copies it
(two versions under 2bw). With weight prediction every F and B of a step runs at its prediction ŵ
instead, formed at the step's first F from the versions held then
(:mod:`nobubble.corrections.predict`).

This module runs the actions: each kind has its handler (:data:`ActionRunner.HANDLERS`). The rest
has a module each: what a process runs and when (:mod:`~nobubble.pipeline.plan`), whether a step
runs at all (:mod:`~nobubble.pipeline.control`: the leader's go-ahead, the stop votes), a STEP's
update at once or behind its all-reduces (:mod:`~nobubble.pipeline.updates`), the statistics of a
step (:mod:`~nobubble.pipeline.stats`), the evaluation (:mod:`~nobubble.pipeline.evaluation`), and
the picture of the schedule that a failure shows (:mod:`~nobubble.pipeline.failure`).

With data parallelism the replicas of a stage average their gradient at every STEP
(:mod:`nobubble.pipeline.replicas`); the rest of that STEP's update waits until an action needs the
version it produces, so under 2bw the all-reduce runs behind the next step's compute.

Tied embeddings over several stages: the first and the last stage each hold a copy of the tied
weight (:mod:`nobubble.model`). At its STEP each starts an all-reduce of the tied weight's
gradient over the first and last stages of every replica (:func:`tied_group`; the sum of both
stages' gradients, averaged over the replicas, the same bytes on every member), deferred like
the data-parallel one, so both copies take the same update and stay bitwise equal. Under 2bw the
last stage first needs the new version in its forwards of the step after next, which wait for
the first stage's forwards of that step anyway: the all-reduce costs no bubble.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack, nullcontext
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from nobubble.checkpoint.named_state import NamedState, whole
from nobubble.config import ConfigError, TrainConfig
from nobubble.engine import StepStats, peak_memory_mb
from nobubble.evaluation import EvalSums
from nobubble.layout import ParallelLayout
from nobubble.model.layers import lm_loss
from nobubble.model.partition import stage_specs
from nobubble.model.presets import ModelConfig
from nobubble.pipeline.channels import Channel
from nobubble.pipeline.comm import Messenger, PendingRecv
from nobubble.pipeline.control import StepControl
from nobubble.pipeline.evaluation import PipelinedEvaluation
from nobubble.pipeline.failure import add_schedule, schedule_around
from nobubble.pipeline.held_stage import HeldStage
from nobubble.pipeline.links import Links, resolve_links
from nobubble.pipeline.plan import RECV_AHEAD, ActionWindow
from nobubble.pipeline.replicas import peer_failures, replica_rows
from nobubble.pipeline.sharded_update import stage_groups
from nobubble.pipeline.stats import StepStatistics
from nobubble.pipeline.timing import Tally, clock_for
from nobubble.pipeline.transport import active
from nobubble.pipeline.updates import Updates
from nobubble.pipeline.warmup import collective_connections, connect, edge_connections
from nobubble.profiling import OFF, action_label, labelled
from nobubble.schedules import Action, ActionKind, schedule_spec
from nobubble.stage_options import autocast, compile_ahead, wire_dtype
from nobubble.stage_report import StageReport
from nobubble.staleness import weight_drift

RECV_CHANNELS = {ActionKind.RECV_ACT: Channel.ACTIVATION, ActionKind.RECV_GRAD: Channel.GRADIENT}


class PipelineEngine:
    """The model stages ``layout.stages`` of replica ``layout.replica`` of a pipeline
    (torch.distributed must be initialized). Peers are addressed by model stage; the layout maps
    stages to ranks. ``replicas``: the process group of this process's data-parallel replicas
    (None without data parallelism); ``tp_mesh``: the mesh of its tensor-parallel ranks (None
    without tensor parallelism)."""

    def __init__(
        self,
        cfg: TrainConfig,
        mc: ModelConfig,
        device: torch.device,
        val_batches: int,
        layout: ParallelLayout,
        replicas: dist.ProcessGroup | None = None,
        tp_mesh: DeviceMesh | None = None,
    ) -> None:
        self.cfg, self.device, self.layout = cfg, device, layout
        specs = stage_specs(cfg, mc)
        split = schedule_spec(cfg.schedule).split_backward
        tied = tied_group(layout) if mc.tie_embeddings and layout.pp > 1 else None
        sharded = {}
        if cfg.zero and layout.dp > 1:
            sharded = stage_groups(layout, replicas, dist.get_backend())
        self.held = {
            stage: HeldStage(
                stage,
                specs[stage],
                cfg,
                mc,
                device,
                layout,
                replicas,
                tied,
                split,
                sharded.get(stage),
                tp_mesh,
            )
            for stage in layout.stages
        }
        self.profiler = OFF  # profile_steps: set while training (nobubble.profiling.profiled)
        routes = resolve_links(cfg.p2p_routes, dist.get_backend(), active().emulated)
        links = Links.build(layout, routes)
        wire = wire_dtype(cfg.p2p_dtype, cfg.dtype, device)
        self.clock = clock_for(device)  # how this process measures a duration
        self.messenger = Messenger(layout, cfg.p2p_timeout_s, links, wire, self.clock)
        if cfg.p2p_warmup:
            chains = {stage: groups.chain for stage, groups in sharded.items()}
            connections = [
                *edge_connections(self.messenger, layout),
                *collective_connections(layout, tied, replicas, chains),
            ]
            connect(self.messenger, connections, device)
        delay = max(held.trained.delay for held in self.held.values())
        self.control = StepControl(layout, self.messenger, delay)
        self.micro_per_step = cfg.microbatches  # pipedream: 1, which the config enforces
        self.stats = StepStatistics(layout, self.messenger, mc, specs, self.micro_per_step)
        self.hidden_shape = (cfg.microbatch_size() // layout.dp, cfg.seq_len, mc.d_model)
        self.evaluation = PipelinedEvaluation(
            cfg, layout, self.messenger, device, self.held, self.hidden_shape, val_batches
        )
        self.step = 0
        self.train_wall_s = 0.0
        self.train_idle = Tally()  # the messenger's waits while training
        # the peak memory of the training segments (on CUDA each one's own, from its start: an
        # evaluation or a checkpoint between them, where replica 0 gathers a sharded state
        # whole, is not training's)
        self.train_peak_mb = 0.0
        # per (model stage, action kind): time spent running its actions, blocked time left out
        self.action_times: dict[tuple[int, ActionKind], Tally] = {}
        compile_ahead(  # compile=true: every stage compiled before step 0, then a barrier
            [held.module for held in self.held.values()],
            cfg,
            device,
            self.hidden_shape,
            torch.float32,  # what activations and gradients arrive in (post_receives)
            self.barrier,
        )

    @property
    def train_idle_s(self) -> float:
        """The time blocked on pipeline peers while training (outside actions only: on CUDA it
        reads the events)."""
        return self.train_idle.seconds

    def barrier(self) -> None:
        """Wait for every rank; one that exited (its connection closed) or is stuck is a
        :class:`PeerFailure` (the one line a rank ends with when a peer failed)."""
        what = f"the other processes of the run at step {self.step} (a barrier)"
        with peer_failures(self.layout.name(), what):
            dist.barrier()

    # -- training -------------------------------------------------------------------------------

    def run_steps(
        self,
        stop: int,
        next_batch: Callable[[], torch.Tensor] | None,
        on_step: Callable[[StepStats], None],
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """Run this stage's actions for steps [self.step, stop), or fewer if a stop is requested
        (:mod:`nobubble.pipeline.control`: a step that does not run drops the actions of that
        and later steps, leaving the shorter run's schedule, cool-down included).

        An error on the way (a peer that failed or timed out, an action that raised) shows where
        in the schedule this process was (:mod:`nobubble.pipeline.failure`); ``on_step``'s own
        errors pass as they are.
        """
        plan = ActionWindow(self.cfg, self.layout, self.step, stop)
        runner = ActionRunner(self, next_batch, on_step)
        if self.device.type == "cuda":  # this segment's peak: no evaluation's, no checkpoint's
            torch.cuda.reset_peak_memory_stats(self.device)
        started = time.perf_counter()
        at: Action | None = None  # the action running or about to
        try:
            with self.messenger.waited.copied_to(self.train_idle):
                while (at := plan.peek()) is not None:
                    self._run(runner, plan, at, should_stop)
                runner.updates.finish_all()
                self.control.count_remaining_votes()
                self.messenger.drain()
        except Exception as error:
            if error is not runner.callers_error:
                self._show_schedule(error, plan, at or runner.last)
            raise
        self.settle_times(wait=True)  # on CUDA: the segment's work done before its clock stops
        self.train_wall_s += time.perf_counter() - started
        self.train_peak_mb = max(self.train_peak_mb, peak_memory_mb(self.device))

    def _run(
        self,
        runner: ActionRunner,
        plan: ActionWindow,
        action: Action,
        should_stop: Callable[[], bool],
    ) -> None:
        """Run ``action``, the next of ``plan``: first, at a step's first action, learn whether
        the step runs (if not, cut the plan there)."""
        if action.step > runner.cleared:  # this stage's first action of the step
            self.settle_times(wait=False)
            self.profiler.before_step(action.step)
            if not self.control.clear(action.step, should_stop):
                plan.stop_at(action.step)
                return
            runner.cleared = action.step
        runner.updates.advance()
        runner.updates.finish_before(action)
        runner.post_receives(plan.ahead(RECV_AHEAD))
        took = self.action_times.setdefault((action.stage, action.kind), Tally())
        began = self.clock.mark()
        with ExitStack() as blocked:
            for waits in self.waits():  # blocked time is not the action's
                blocked.enter_context(waits.copied_to(took, -1.0))
            with action_label(action):
                runner.execute(action)
        took.add(self.clock.span(began))
        runner.last = action
        plan.pop()

    def _show_schedule(self, error: Exception, plan: ActionWindow, action: Action | None) -> None:
        """Add to ``error`` the picture of the schedule around ``action`` (none before the
        first action)."""
        if action is None:
            return
        try:
            picture = schedule_around(self.cfg, self.layout, action, plan.start, plan.stop)
        except Exception as failed:  # the picture must never hide the error itself
            picture = f"(no picture of the schedule: {type(failed).__name__}: {failed})"
        add_schedule(error, picture)

    def waits(self) -> list[Tally]:
        """Where time blocked is counted: on pipeline peers, data-parallel and tied all-reduces,
        sharded updates' chains."""
        waits = [self.messenger.waited]
        for held in self.held.values():
            waits += [held.reduction.waited] if held.reduction else []
            waits += [held.tied.waited] if held.tied else []
            waits += [held.shards.waited] if held.shards else []
        return waits

    def settle_times(self, wait: bool) -> None:
        """Read the measurements taken so far (:mod:`~nobubble.pipeline.timing`): at a step's
        first action those done already (never waiting for the device), at a segment's end
        all of them."""
        tallies = [self.train_idle, *self.action_times.values(), *self.waits()]
        for held in self.held.values():
            tallies += [held.reduction.duration] if held.reduction else []
            tallies += [held.tied.duration] if held.tied else []
            tallies += [held.shards.comm] if held.shards else []
        for tally in tallies:
            tally.settle(wait)

    def stage_reports(self, digests: bool = True) -> list[dict[str, Any]] | None:
        """Every rank's :class:`~nobubble.stage_report.StageReport` so far in this session,
        gathered on the leader (a collective call); ``digests``: with the digests of the weights
        (which read all of them).

        ``idle_s`` counts the time blocked on pipeline peers and, with data parallelism, on the
        gradient all-reduce (``allreduce_wait_s`` of its ``allreduce_s``), and on a process
        that holds a tied copy, on the tied all-reduce (``tied_allreduce_wait_s`` of
        ``tied_allreduce_s``); ``tied_sha256`` is the digest of its copy's newest version.
        ``allreduce_last_s`` and ``allreduce_last_wait_s`` are the run's final all-reduce alone
        (no compute is left to hide it behind; the benchmark reports it apart). With sharded
        state (``zero`` > 0) the chain of the update replaces the all-reduce: ``zero_comm_s``,
        ``zero_comm_wait_s``, ``zero_comm_mb`` and the last ones alike, and ``zero_owned`` names
        the parameters this replica owns whole (:class:`nobubble.zero_partition.ShardPlan`).

        Every time is measured by the device's clock (:mod:`nobubble.pipeline.timing`): the wall
        clock on the CPU; on CUDA events on the compute stream, so idle is the time the stream
        stood waiting and ``action_s`` the stream's time for the work an action queued.
        """
        held = list(self.held.values())
        reductions = [h.reduction for h in held if h.reduction and not h.shards]
        chains = [h.shards for h in held if h.shards]
        tied = [h for h in held if h.tied]
        idle = self.train_idle_s + sum(r.waited_s for r in reductions)
        idle += sum(h.tied.waited_s for h in tied) + sum(c.wait_s for c in chains)
        action_s: dict[str, dict[str, float]] = {}
        for (stage, kind), took in sorted(self.action_times.items()):
            action_s.setdefault(str(stage), {})[kind.value] = took.seconds
        report = StageReport(
            pp_rank=self.layout.pp_rank,
            model_stages=self.layout.stages,
            replica=self.layout.replica,
            blocks=sum(len(h.spec.blocks) for h in held),
            train_wall_s=self.train_wall_s,
            idle_s=idle,
            peak_mem_mb=self.train_peak_mb,
            param_mb=sum(h.param_mb() for h in held),
            state_mb=sum(h.trained.state_mb() for h in held),
            weight_versions_peak=max(h.trained.versions_peak for h in held),
            action_s=action_s,
        ).as_dict()
        if digests:
            report["weights_sha256"] = weights_digest(self.newest_weights())
        if reductions:
            report |= _summed([r.report("allreduce") for r in reductions])
        if chains:
            report |= _summed([c.report("zero_comm") for c in chains])
            report["zero_owned"] = sorted(n for c in chains for n in c.plan.describe()["owned"])
        for h in tied:  # at most one: the first or the last stage
            if digests:
                newest = h.trained.store[h.trained.store.newest]
                report["tied_sha256"] = weights_digest({h.tied_name: newest[h.tied_name]})
            report |= h.tied.report("tied_allreduce")
        reports = [None] * self.layout.world if self.layout.is_leader else None
        with peer_failures(self.layout.name(), "the other stages' reports (a gather)"):
            dist.gather_object(report, reports, dst=self.layout.leader)
        # under tensor parallelism, tp index 0's: one report per stage and replica
        return None if reports is None else reports[:: self.layout.tp]

    def weight_drift(self) -> list[float | None] | None:
        """Each model stage's weight drift (:mod:`nobubble.staleness`), each process measuring
        its own stages at the pause and the leader gathering them (a collective call, at an
        evaluation: the pipeline has drained); None on the other ranks, and where no stage has
        a gradient delay (the same answer on every rank, without a message)."""
        stages = self.layout.model_stages
        if not any(schedule_spec(self.cfg.schedule).delays(stages)):
            return None
        mine = {s: weight_drift(h.trained.store, h.trained.delay) for s, h in self.held.items()}
        parts = [None] * self.layout.world if self.layout.is_leader else None
        what = f"the other stages' weight drift at step {self.step} (a gather)"
        with peer_failures(self.layout.name(), what):
            dist.gather_object(mine, parts, dst=self.layout.leader)
        if parts is None:
            return None
        drift = {s: value for part in parts for s, value in part.items()}  # replicas agree
        return [drift[s] for s in range(stages)]

    def newest_weights(self) -> dict[str, torch.Tensor]:
        """The newest version of every parameter this process holds, by name."""
        return {
            name: tensor
            for h in self.held.values()
            for name, tensor in h.trained.store[h.trained.store.newest].items()
        }

    # -- evaluation -----------------------------------------------------------------------------

    @torch.no_grad()
    @labelled("evaluate")
    def evaluate(
        self, batches: Sequence[torch.Tensor], token_bytes: torch.Tensor | None
    ) -> EvalSums:
        """Forward the validation batches through the stages at the newest weights
        (:mod:`nobubble.pipeline.evaluation`)."""
        return self.evaluation.run(batches, token_bytes)

    # -- checkpoints ----------------------------------------------------------------------------

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every version of this process's stages by name; tensor-parallel shards gathered
        whole (then a collective call of the stage's tp ranks)."""
        return {
            key: whole(tensor)
            for held in self.held.values()
            for key, tensor in held.trained.checkpoint_tensors().items()
        }

    def checkpoint_state(self) -> dict[str, Any]:
        """The step and the optimizer state of this process's stages by parameter name. With
        sharded state a collective call: replica 0 gathers the whole state from the replicas'
        parts (the others get None), so a checkpoint is the same whatever ``zero`` and ``dp``
        it was saved with, and loads into any."""
        parts = []
        for held in self.held.values():
            state = held.trained.named_state()
            if self.layout.tp > 1:  # the shards gathered whole, as one process holds them
                state = state.whole()
            if held.shards is not None:
                state = held.shards.gather_state(state, held.shard_groups.state)
            parts.append(state)
        whole = None if None in parts else NamedState.merge(parts)
        return {"step": self.step, "optimizer": whole}

    def restore(self, tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        """Continue from a checkpoint of any layout: ``tensors`` and ``state`` hold (at least)
        this process's parameters by name; other parameters are not looked at."""
        if self.layout.tp > 1:
            raise ConfigError(
                f"tp={self.layout.tp}: continuing from a checkpoint into tensor-parallel stages "
                "is not supported yet (the split of the loaded weights and optimizer state); "
                "continue with tp=1 (the checkpoint holds whole tensors)"
            )
        self.step = state["step"]
        for held in self.held.values():
            held.trained.restore(tensors, state["optimizer"], self.step)


def _summed(reports: list[dict[str, float]]) -> dict[str, float]:
    """Several stages' all-reduce reports as one (times and bytes add up)."""
    return {key: sum(r[key] for r in reports) for key in reports[0]}


def tied_group(layout: ParallelLayout) -> dist.ProcessGroup | None:
    """The process group of the first and the last stage of every replica, which hold the two
    copies of a tied weight; None on the other ranks. Every rank must call it (in the same order
    relative to other groups), as ``dist.new_group`` requires."""
    ranks = sorted(
        layout.rank_of(stage, replica)
        for replica in range(layout.dp)
        for stage in (0, layout.model_stages - 1)
    )
    group = active().new_group(ranks, "tied copies")
    return group if layout.is_first_stage or layout.is_last_stage else None


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the bytes of ``weights`` in name order: replicas (and tied copies) that hold
    bitwise the same weights have the same digest."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        tensor = weights[name].detach()
        if isinstance(tensor, DTensor):  # a tensor-parallel shard: this rank's part
            tensor = tensor.to_local()
        digest.update(tensor.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class ActionRunner:
    """Executes a segment's actions on ``engine``'s held stages, one handler for each kind of
    action (:data:`HANDLERS`), and holds their state: stashes, pending receives, batches,
    losses, the updates in flight."""

    def __init__(
        self,
        engine: PipelineEngine,
        next_batch: Callable[[], torch.Tensor] | None,
        on_step: Callable[[StepStats], None],
    ) -> None:
        self.engine = engine
        self.next_batch = next_batch
        self.on_step = on_step
        self.callers_error: BaseException | None = None  # what on_step raised, if anything
        self.batches: dict[int, tuple[torch.Tensor, ...]] = {}
        # keyed by (stage, microbatch): stage's (input, output) of its F; its input gradient
        self.stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.recvs: dict[tuple[ActionKind, int, int], PendingRecv] = {}
        self.losses: dict[int, torch.Tensor] = {}  # float64 sums, read once per step
        self.cleared = engine.step - 1  # the last step known to run
        self.last: Action | None = None  # the last action run
        self.updates = Updates(engine.held, self.update, self.report, engine.layout.is_first_stage)

    def post_receives(self, actions: list[Action]) -> None:
        """Post the receives of ``actions`` (the next few to run) in steps known to run."""
        for action in actions:
            key = (action.kind, action.stage, action.microbatch)
            if action.step > self.cleared:
                break
            if action.kind in RECV_CHANNELS and key not in self.recvs:
                what = "activation" if action.kind is ActionKind.RECV_ACT else "gradient"
                self.recvs[key] = self.engine.messenger.post_recv(
                    self.engine.hidden_shape,
                    torch.float32,
                    self.engine.device,
                    action.peer,
                    RECV_CHANNELS[action.kind],
                    action.microbatch,
                    f"the {what} of microbatch {action.microbatch} for stage {action.stage} "
                    f"(step {action.step})",
                    chunk=self.engine.layout.chunk_of(action.stage),
                )

    def received(self, kind: ActionKind, action: Action) -> torch.Tensor:
        return self.engine.messenger.wait(self.recvs.pop((kind, action.stage, action.microbatch)))

    def microbatch(self, held: HeldStage, action: Action) -> torch.Tensor:
        """The token rows of this F's microbatch (first and last stage only). A step's batch is
        let go after its last microbatch's last read: the head's, where this process holds the
        head (under V it holds the embedding too, and the head reads after it)."""
        if action.step not in self.batches:
            batch = self.next_batch()
            if self.engine.device.type == "cuda":  # queued behind the compute, not waited for
                batch = batch.pin_memory().to(self.engine.device, non_blocking=True)
            self.batches[action.step] = batch.chunk(self.engine.micro_per_step)
        index = action.microbatch - action.step * self.engine.micro_per_step
        rows = replica_rows(self.batches[action.step][index], self.engine.layout)
        if index == self.engine.micro_per_step - 1 and (
            held.last or not self.engine.layout.is_last_stage
        ):
            del self.batches[action.step]
        return rows

    def execute(self, action: Action) -> None:
        self.HANDLERS[action.kind](self, self.engine.held[action.stage], action)

    # -- the handlers ---------------------------------------------------------------------------

    def forward(self, held: HeldStage, action: Action) -> None:
        engine = self.engine
        rows = self.microbatch(held, action) if (held.first or held.last) else None
        x = rows[:, :-1] if held.first else self.stage_input(action).requires_grad_(True)
        recording = held.split.forward(action.microbatch) if held.split else nullcontext()
        with recording, autocast(engine.device, engine.cfg.dtype):
            out = functional_call(held.module, held.trained.at(action.step), (x,))
        if held.last:
            out = lm_loss(out, rows[:, 1:])
            self.losses[action.step] = self.losses.get(action.step, 0.0) + out.detach().double()
        self.stash[action.stage, action.microbatch] = (x, out)

    def stage_input(self, action: Action) -> torch.Tensor:
        """The activation the F ``action`` runs on: the output of the stage before, handed over
        in memory where this process holds it too (the bottom of the V), received otherwise."""
        engine, before = self.engine, action.stage - 1
        if not engine.layout.holds(before):
            return self.received(ActionKind.RECV_ACT, action)
        out = self.stash[before, action.microbatch][1]
        return engine.messenger.hand_over(out, Channel.ACTIVATION, engine.device, torch.float32)

    def output_gradient(self, action: Action) -> torch.Tensor:
        """The gradient of the output of the backward ``action``'s stage: the input gradient of
        the stage after, handed over in memory where this process holds it too (the bottom of
        the V), received otherwise."""
        engine, after = self.engine, action.stage + 1
        if not engine.layout.holds(after):
            return self.received(ActionKind.RECV_GRAD, action)
        grad = self.input_grads.pop((after, action.microbatch))
        return engine.messenger.hand_over(grad, Channel.GRADIENT, engine.device, torch.float32)

    def _backward_target(
        self, held: HeldStage, action: Action
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a backward differentiates: the loss share (last stage) or this stage's output
        with the next stage's gradient."""
        out = self.stash[action.stage, action.microbatch][1]
        if held.last:
            return out / self.engine.micro_per_step, None
        return out, self.output_gradient(action)

    def backward(self, held: HeldStage, action: Action) -> None:
        target, grad = self._backward_target(held, action)
        x, _ = self.stash.pop((action.stage, action.microbatch))
        target.backward(grad)
        if held.split:  # a whole B on a stage that splits its other backwards (DualPipeV)
            held.split.drop(action.microbatch)
        if not held.first:
            self.input_grads[action.stage, action.microbatch] = x.grad

    def input_gradient(self, held: HeldStage, action: Action) -> None:
        """I of a split backward: the gradient the previous stage waits for (the first stage
        has none) and every weight gradient but the linear layers', which W computes."""
        target, grad = self._backward_target(held, action)
        x, _ = self.stash.pop((action.stage, action.microbatch))
        weights = held.trained.at(action.step)
        gx = held.split.input_gradient(
            action.microbatch, target, grad, None if held.first else x, weights
        )
        if not held.first:
            self.input_grads[action.stage, action.microbatch] = gx

    def weight_gradient(self, held: HeldStage, action: Action) -> None:
        """W of a split backward: the linear layers' weight gradients."""
        held.split.weight_gradient(action.microbatch)

    def overlapped(self, held: HeldStage, action: Action) -> None:
        """An overlapped F&B (DualPipeV): the forward half on ``held``, the backward half (a
        whole B) on another stage of this process, each as its own action would run it. Here
        they run one after the other, which on the CPU, where nothing would run beside them,
        costs nothing; this is the one place where a GPU build would overlap them: launch the
        halves on two CUDA streams (or interleave their kernels, as DeepSeek's DualPipe does) so
        that one half's all-to-alls and pipeline messages run under the other's compute. Both
        halves' receives are posted before the action and both sends follow it (lowering)."""
        forward, backward = action.parts
        self.forward(held, forward)
        self.backward(self.engine.held[backward.stage], backward)

    def send_activation(self, held: HeldStage, action: Action) -> None:
        self.engine.messenger.send(
            self.stash[action.stage, action.microbatch][1],
            action.peer,
            Channel.ACTIVATION,
            action.microbatch,
            chunk=self.engine.layout.chunk_of(action.peer),
        )

    def send_gradient(self, held: HeldStage, action: Action) -> None:
        self.engine.messenger.send(
            self.input_grads.pop((action.stage, action.microbatch)),
            action.peer,
            Channel.GRADIENT,
            action.microbatch,
            chunk=self.engine.layout.chunk_of(action.peer),
        )

    def receive(self, held: HeldStage, action: Action) -> None:
        """Nothing: a receive is posted ahead (:meth:`post_receives`), its F or B waits for it."""

    def step(self, held: HeldStage, action: Action) -> None:
        """The STEP of one held stage: its gradient is complete; its update follows, at once or
        behind its all-reduces (:class:`~nobubble.pipeline.updates.Updates`)."""
        held.trained.take_gradients(action.step)
        sums = held.step_sums(self.losses.pop(action.step, None) if held.last else None)
        self.updates.start(held, action.step, sums)

    HANDLERS: ClassVar[dict[ActionKind, Callable[[ActionRunner, HeldStage, Action], None]]] = {
        ActionKind.F: forward,
        ActionKind.B: backward,
        ActionKind.I: input_gradient,
        ActionKind.W: weight_gradient,
        ActionKind.FB: overlapped,
        ActionKind.SEND_ACT: send_activation,
        ActionKind.SEND_GRAD: send_gradient,
        ActionKind.RECV_ACT: receive,
        ActionKind.RECV_GRAD: receive,
        ActionKind.STEP: step,
    }

    # -- a step's end ---------------------------------------------------------------------------

    @staticmethod
    def update(
        held: HeldStage, step: int, sums: torch.Tensor, norms: tuple[float, float | None] | None
    ) -> tuple[float, bool, float]:
        """Clip, step the optimizer (:meth:`HeldStage.apply_step`)."""
        return held.apply_step(step, sums, norms)

    def report(
        self, held: HeldStage, step: int, sums: list[float], outcome: tuple[float, bool, float]
    ) -> None:
        """Once every stage of this process has updated, report the step's statistics to the
        first stage (:mod:`nobubble.pipeline.stats`)."""
        engine = self.engine
        norm, ok, lr = outcome
        if not engine.stats.add(held.index, step, sums, norm, ok, held.last):
            return
        engine.step = step + 1
        engine.stats.report(step, lr, self.tell)
        engine.profiler.after_step(step)

    def tell(self, stats: StepStats) -> None:
        """``on_step``, remembering what it raised (its own errors are not the pipeline's)."""
        try:
            self.on_step(stats)
        except BaseException as error:
            self.callers_error = error
            raise
