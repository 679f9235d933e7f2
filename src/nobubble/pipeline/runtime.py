"""One pipeline stage: executes its action list of the schedule IR on real tensors.

The stage owns a slice of the model (:class:`nobubble.model.Stage`) and its weight versions
(:class:`nobubble.versions.VersionStore`, the same as the simulator's). Every F runs with the
version its action names and every B with the same one (weight stashing through
``functional_call``, never an in-place swap); a STEP clips, steps the optimizer on the newest
version and, when microbatches in flight still need it, first copies it (two versions under 2bw).
With weight prediction every F and B of a step runs at its prediction ŵ instead, formed at the
step's first F from the versions held then (:mod:`nobubble.prediction`).

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

Versions follow :mod:`nobubble.delay` for the global step, so a run cut into segments (for
evaluations and checkpoints) computes exactly what an uncut run computes; for a segment that
starts the run the IR's own versions are checked against that rule before anything runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.func import functional_call

from nobubble.config import SYNC, TrainConfig, chosen_corrections
from nobubble.delay import gradient_version, stage_delays
from nobubble.engine import StepStats, peak_memory_mb
from nobubble.evaluation import EvalSums
from nobubble.layout import ParallelLayout
from nobubble.model import TIED_WEIGHT, ModelConfig, Stage, holds_tied_copy, lm_loss, partition
from nobubble.optim import build_optimizer
from nobubble.optim.named_state import load_named_state, named_state
from nobubble.pipeline.comm import Channel, Messenger, PendingRecv
from nobubble.pipeline.replicas import PendingReduction, ReplicaReduction, replica_rows
from nobubble.pipeline.split_backward import SplitBackward
from nobubble.prediction import StepWeights
from nobubble.profiling import OFF, action_label, label, labelled
from nobubble.schedules import Action, ActionKind, generate, lower, schedule_spec
from nobubble.simulated import autocast, versions_from_tensors
from nobubble.stage_options import apply_stage_options
from nobubble.update import optimizer_step, prepare_step
from nobubble.versions import VersionStore

RECV_CHANNELS = {ActionKind.RECV_ACT: Channel.ACTIVATION, ActionKind.RECV_GRAD: Channel.GRADIENT}
RECV_AHEAD = 4  # post a receive this many actions before the action that consumes it


def ir_schedule(schedule: str) -> str:
    """The IR generator behind a config schedule (``sync`` runs as 1f1b: same semantics)."""
    return "1f1b" if schedule == SYNC else schedule


def segment_actions(
    cfg: TrainConfig, stage: int, start: int, stop: int, delay: int
) -> list[Action]:
    """This stage's lowered actions for steps [start, stop), with global indices and versions."""
    # a step is cfg.microbatches microbatches (pipedream: 1, which the config enforces)
    schedule = ir_schedule(cfg.schedule)
    lowered = lower(generate(schedule, cfg.stages, cfg.microbatches, stop - start))
    actions = []
    for action in lowered[stage]:
        step = action.step + start
        # a STEP produces version step+1; F, B and their messages use the delayed version
        version = step + 1 if action.kind is ActionKind.STEP else gradient_version(step, delay)
        if start == 0 and version != action.version:
            raise RuntimeError(
                f"schedule IR and delay rule disagree at stage {stage}: {action} should use "
                f"version {version}; this is a bug in nobubble"
            )
        microbatch = (
            None if action.microbatch is None else action.microbatch + start * cfg.microbatches
        )
        actions.append(
            dataclasses.replace(action, step=step, microbatch=microbatch, version=version)
        )
    return actions


class PipelineEngine:
    """The stage ``layout.stage`` of replica ``layout.replica`` of a ``cfg.stages``-stage
    pipeline (torch.distributed must be initialized). Peers are addressed by stage; the layout
    maps stages to ranks. ``replicas``: the process group of this stage's data-parallel
    replicas (None without data parallelism)."""

    def __init__(
        self,
        cfg: TrainConfig,
        mc: ModelConfig,
        device: torch.device,
        val_batches: int,
        layout: ParallelLayout,
        replicas: dist.ProcessGroup | None = None,
    ) -> None:
        self.cfg, self.device, self.layout = cfg, device, layout
        specs = partition(mc.n_layers, cfg.stages, cfg.embed_cost, cfg.head_cost, cfg.stage_layers)
        self.spec = specs[layout.stage]
        self.first, self.last = self.spec.has_embed, self.spec.has_head
        self.module = Stage(mc, self.spec, cfg.seed).to(device)
        apply_stage_options(self.module, cfg, device)
        split = schedule_spec(ir_schedule(cfg.schedule)).split_backward
        self.split = SplitBackward(self.module) if split else None  # zero-bubble I/W
        self.profiler = OFF  # profile_steps: set while training (nobubble.profiling.profiled)
        params = dict(self.module.named_parameters())
        self.store = VersionStore(params)
        self.optimizer = build_optimizer(list(params.items()), cfg)
        self.delay = stage_delays(cfg.schedule, cfg.stages)[layout.stage]
        self.point = StepWeights(self.store, self.delay, "predict" in chosen_corrections(cfg))
        self.messenger = Messenger(layout, cfg.p2p_timeout_s)
        self.hidden_shape = (cfg.microbatch_size() // layout.dp, cfg.seq_len, mc.d_model)
        self.reduction = (
            ReplicaReduction(replicas, layout.dp, cfg.p2p_timeout_s, layout.name())
            if layout.dp > 1
            else None
        )
        # tied embeddings split over stages: this stage's copy, summed with the other's
        self.tied_name = TIED_WEIGHT if holds_tied_copy(mc, self.spec) else None
        group = tied_group(layout) if mc.tie_embeddings and layout.pp > 1 else None
        self.tied = (  # sum over first + last, mean over replicas: the dp divisor
            ReplicaReduction(
                group,
                layout.dp,
                cfg.p2p_timeout_s,
                layout.name(),
                "the all-reduce of the tied weight with the other stages that hold a copy",
                "tied all-reduce",
            )
            if self.tied_name
            else None
        )
        self.reduced = [p for name, p in params.items() if name != self.tied_name]  # dp bucket
        self.val_batches = val_batches
        self.eval_sequence = 0
        self.step = 0
        self.micro_per_step = cfg.microbatches  # pipedream: 1, which the config enforces
        self.train_wall_s = self.train_idle_s = 0.0
        self.versions_peak = 1
        self.peer_stop = False  # leader: a rank asked to stop in the last steps of a segment

    def barrier(self) -> None:
        dist.barrier()

    # -- training -------------------------------------------------------------------------------

    def run_steps(
        self,
        stop: int,
        next_batch: Callable[[], torch.Tensor] | None,
        on_step: Callable[[StepStats], None],
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """Run this stage's actions for steps [self.step, stop), or fewer if a stop is requested.

        Before its first action of a step, every rank learns from the leader (stage 0 of replica
        0) whether the step runs (a first stage is the first to touch any step, so nobody waits
        long for that answer). If it does not, every rank drops the actions of that and later
        steps: what remains is exactly the schedule of the shorter run, cool-down included. A stop
        requested on another rank reaches the leader as that rank's vote (see ``_Segment.clear``).
        """
        actions = segment_actions(self.cfg, self.layout.stage, self.step, stop, self.delay)
        run = _Segment(self, next_batch, on_step)
        started, waited = time.perf_counter(), self.messenger.waited_s
        index = 0
        while index < len(actions):
            action = actions[index]
            if action.step > run.cleared:  # this stage's first action of the step
                self.profiler.before_step(action.step)
                if not run.clear(action.step, should_stop):
                    actions = actions[:index] + [a for a in actions[index:] if a.step < action.step]
                    continue
            run.finish_update_before(action)
            run.post_receives(actions, index)
            with action_label(action):
                run.execute(action)
            index += 1
        run.finish_update()
        run.count_remaining_votes()
        self.messenger.drain()
        self.train_wall_s += time.perf_counter() - started
        self.train_idle_s += self.messenger.waited_s - waited

    def apply_step(self, step: int) -> tuple[float, bool, float]:
        """The rest of the STEP action, once the gradient is complete (and averaged over the
        replicas): clip -> optimizer on the newest version."""
        norm, ok = prepare_step(
            self.store, step, self.point.history, self.cfg.grad_clip, self.tied_name, self.first
        )
        self.versions_peak = max(self.versions_peak, self.point.copies())
        lr = optimizer_step(self.optimizer, step, self.cfg)
        self.step = step + 1
        return norm, ok, lr

    def stage_reports(self, digests: bool = True) -> list[dict[str, float]] | None:
        """Every rank's idle time and memory, gathered on the leader (a collective call), so far
        in this session; ``digests``: with the digests of the weights (which read all of them).

        ``idle_s`` counts the time blocked on pipeline peers and, with data parallelism, on the
        gradient all-reduce (``allreduce_wait_s`` of its ``allreduce_s``), and on a stage that
        holds a tied copy, on the tied all-reduce (``tied_allreduce_wait_s`` of
        ``tied_allreduce_s``); ``tied_sha256`` is the digest of its copy's newest version.
        ``allreduce_last_s`` and ``allreduce_last_wait_s`` are the run's final all-reduce alone
        (no compute is left to hide it behind; the benchmark reports it apart).
        """
        param_mb = sum(p.numel() * p.element_size() for p in self.store.params.values()) / 2**20
        idle = self.train_idle_s + sum(r.waited_s for r in (self.reduction, self.tied) if r)
        report = {
            "stage": self.layout.stage,
            "replica": self.layout.replica,
            "blocks": len(self.spec.blocks),
            "train_wall_s": self.train_wall_s,
            "idle_s": idle,
            "idle_fraction": idle / self.train_wall_s if self.train_wall_s else 0.0,
            "peak_mem_mb": peak_memory_mb(self.device),
            "param_mb": param_mb,
            "weight_versions_peak": self.versions_peak,
        }
        newest = self.store[self.store.newest]
        if digests:
            report["weights_sha256"] = weights_digest(newest)
        if self.reduction:
            report |= self.reduction.report("allreduce")
        if self.tied:
            if digests:
                report["tied_sha256"] = weights_digest({self.tied_name: newest[self.tied_name]})
            report |= self.tied.report("tied_allreduce")
        reports = [None] * self.layout.world if self.layout.is_leader else None
        dist.gather_object(report, reports, dst=self.layout.leader)
        return reports

    # -- evaluation -----------------------------------------------------------------------------

    @torch.no_grad()
    @labelled("evaluate")
    def evaluate(
        self, batches: Sequence[torch.Tensor], token_bytes: torch.Tensor | None
    ) -> EvalSums:
        """Forward the validation batches through the stages at the newest weights."""
        sums = EvalSums()
        chunks: list[torch.Tensor] = [
            replica_rows(micro, self.layout)
            for batch in batches
            for micro in batch.to(self.device).chunk(self.cfg.microbatches)
        ]
        count = self.val_batches * self.cfg.microbatches
        for i in range(count):
            sequence = self.eval_sequence + i
            if self.first:
                x = chunks[i][:, :-1]
            else:
                x = self.messenger.recv(
                    self.hidden_shape,
                    torch.float32,
                    self.device,
                    self.layout.stage - 1,
                    Channel.EVAL_ACTIVATION,
                    sequence,
                    f"evaluation activation {i}",
                )
            with autocast(self.device, self.cfg.dtype):
                out = self.module(x)
            if self.last:
                sums.add(out, chunks[i][:, 1:], token_bytes)
            else:
                self.messenger.send(
                    out.float(), self.layout.stage + 1, Channel.EVAL_ACTIVATION, sequence
                )
        self.eval_sequence += count
        sums = self._gather_to_first_stage(sums)
        self.messenger.drain()
        return sums

    def _gather_to_first_stage(self, sums: EvalSums) -> EvalSums:
        """The totals of every replica's share, on the first stage of every replica."""
        if self.layout.is_last_stage and self.reduction:
            totals = torch.tensor(sums.as_list(), dtype=torch.float64, device=self.device)
            dist.all_reduce(totals, group=self.reduction.group)
            sums = EvalSums.from_list(totals.tolist())
        if self.layout.pp == 1:
            return sums
        last = self.layout.pp - 1
        if self.layout.is_last_stage:
            totals = torch.tensor(sums.as_list(), dtype=torch.float64, device=self.device)
            self.messenger.send(totals, 0, Channel.EVAL_SUMS, self.eval_sequence)
        if self.layout.is_first_stage:
            totals = self.messenger.recv(
                (4,),
                torch.float64,
                self.device,
                last,
                Channel.EVAL_SUMS,
                self.eval_sequence,
                "evaluation totals",
            )
            return EvalSums.from_list(totals.tolist())
        return sums

    # -- checkpoints ----------------------------------------------------------------------------

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return {
            f"v{version}/{name}": tensor
            for version, weights in self.store.snapshot().items()
            for name, tensor in weights.items()
        }

    def checkpoint_state(self) -> dict[str, Any]:
        """The step and this stage's optimizer state by parameter name."""
        return {"step": self.step, "optimizer": named_state(self.optimizer)}

    def restore(self, tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        """Continue from a checkpoint of any layout: ``tensors`` and ``state`` hold (at least)
        this stage's parameters by name; other parameters are not looked at."""
        self.step = state["step"]
        history = self.point.history
        self.store.load(versions_from_tensors(tensors, self.store.params, self.step, history))
        load_named_state(self.optimizer, state["optimizer"], skip_unowned=True)


def tied_group(layout: ParallelLayout) -> dist.ProcessGroup | None:
    """The process group of the first and the last stage of every replica, which hold the two
    copies of a tied weight; None on the other ranks. Every rank must call it (in the same order
    relative to other groups), as ``dist.new_group`` requires."""
    ranks = sorted(
        layout.rank_of(stage, replica)
        for replica in range(layout.dp)
        for stage in (0, layout.pp - 1)
    )
    group = dist.new_group(ranks)
    return group if layout.is_first_stage or layout.is_last_stage else None


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the bytes of ``weights`` in name order: replicas (and tied copies) that hold
    bitwise the same weights have the same digest."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclasses.dataclass
class _PendingUpdate:
    """A STEP whose update waits for its all-reduces (data-parallel, tied or both)."""

    step: int
    total: torch.Tensor | None  # this rank's loss sum (the last stage), before any all-reduce
    replicas: PendingReduction | None
    tied: PendingReduction | None


class _Segment:
    """The mutable state of one run of actions: stashes, pending receives, batches, losses."""

    def __init__(
        self,
        engine: PipelineEngine,
        next_batch: Callable[[], torch.Tensor] | None,
        on_step: Callable[[StepStats], None],
    ) -> None:
        self.e = engine
        self.next_batch = next_batch
        self.on_step = on_step
        self.batches: dict[int, tuple[torch.Tensor, ...]] = {}
        self.stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # mb -> (input, output)
        self.input_grads: dict[int, torch.Tensor] = {}
        self.recvs: dict[tuple[ActionKind, int], PendingRecv] = {}
        self.losses: dict[int, torch.Tensor] = {}  # float64 sums, read once per step
        self.cleared = engine.step - 1  # the last step known to run
        self.votes: dict[int, list[PendingRecv]] = {}  # leader: the other ranks' stop votes
        self.pending: _PendingUpdate | None = None  # a STEP waiting for its all-reduces

    def clear(self, step: int, should_stop: Callable[[], bool]) -> bool:
        """Whether ``step`` runs: the leader decides and tells every other rank.

        Every other rank first sends the leader its vote: whether a stop was requested there (a
        signal may reach only some processes, e.g. one node of a multi-node job). The leader
        reads the votes of step ``step - (delay + 1)``, its own delay + 1 being how far it can
        run ahead of the last stage; in a running pipeline every rank of its replica has voted on
        that step by then, and the replicas of the first stage, tied to the leader by their
        all-reduce, at most a step's all-reduce later. A stop asked for on another rank thus
        takes effect at most ``delay + 1`` steps later than on the leader.
        """
        e = self.e
        others = [
            e.layout.coordinates(rank) for rank in range(e.layout.world) if rank != e.layout.leader
        ]
        if e.layout.is_leader:
            go = not (should_stop() or e.peer_stop or self.stop_voted(step - e.delay - 1))
            e.peer_stop = False
            self.votes[step] = [
                e.messenger.post_recv(
                    (1,),
                    torch.float32,
                    e.device,
                    stage,
                    Channel.STOP_VOTE,
                    step,
                    f"the stop vote for step {step}",
                    replica=replica,
                )
                for stage, replica in others
            ]
            flag = torch.tensor([1.0 if go else 0.0], device=e.device)
            for stage, replica in others:
                e.messenger.send(flag, stage, Channel.CONTROL, step, replica=replica)
        else:
            vote = torch.tensor([1.0 if should_stop() else 0.0], device=e.device)
            e.messenger.send(vote, 0, Channel.STOP_VOTE, step, replica=0)
            go = bool(
                e.messenger.recv(
                    (1,),
                    torch.float32,
                    e.device,
                    0,
                    Channel.CONTROL,
                    step,
                    f"the go-ahead for step {step}",
                    replica=0,
                ).item()
            )
        if go:
            self.cleared = step
        return go

    def stop_voted(self, step: int) -> bool:
        """The leader: whether any other rank asked to stop when it cleared ``step``."""
        votes = [self.e.messenger.wait(vote).item() for vote in self.votes.pop(step, [])]
        return any(vote > 0 for vote in votes)  # every receive waited for, not just the first

    def count_remaining_votes(self) -> None:
        """The leader, at the end of a segment: read the votes not read yet, keep a stop for
        later."""
        for step in sorted(self.votes):
            self.e.peer_stop |= self.stop_voted(step)

    def post_receives(self, actions: list[Action], index: int) -> None:
        for action in actions[index : index + RECV_AHEAD]:
            key = (action.kind, action.microbatch)
            if action.step > self.cleared:
                break
            if action.kind in RECV_CHANNELS and key not in self.recvs:
                what = "activation" if action.kind is ActionKind.RECV_ACT else "gradient"
                self.recvs[key] = self.e.messenger.post_recv(
                    self.e.hidden_shape,
                    torch.float32,
                    self.e.device,
                    action.peer,
                    RECV_CHANNELS[action.kind],
                    action.microbatch,
                    f"the {what} of microbatch {action.microbatch} (step {action.step})",
                )

    def received(self, kind: ActionKind, microbatch: int) -> torch.Tensor:
        return self.e.messenger.wait(self.recvs.pop((kind, microbatch)))

    def microbatch(self, action: Action) -> torch.Tensor:
        """The token rows of this F's microbatch (first and last stage only)."""
        if action.step not in self.batches:
            self.batches[action.step] = (
                self.next_batch().to(self.e.device).chunk(self.e.micro_per_step)
            )
        index = action.microbatch - action.step * self.e.micro_per_step
        rows = replica_rows(self.batches[action.step][index], self.e.layout)
        if index == self.e.micro_per_step - 1:
            del self.batches[action.step]
        return rows

    def execute(self, action: Action) -> None:
        e, kind = self.e, action.kind
        if kind is ActionKind.F:
            self.forward(action)
        elif kind is ActionKind.B:
            self.backward(action)
        elif kind is ActionKind.I:
            self.input_gradient(action)
        elif kind is ActionKind.W:
            self.weight_gradient(action)
        elif kind is ActionKind.SEND_ACT:
            e.messenger.send(
                self.stash[action.microbatch][1], action.peer, Channel.ACTIVATION, action.microbatch
            )
        elif kind is ActionKind.SEND_GRAD:
            e.messenger.send(
                self.input_grads.pop(action.microbatch),
                action.peer,
                Channel.GRADIENT,
                action.microbatch,
            )
        elif kind is ActionKind.STEP:
            self.step(action.step)
        # RECV_*: posted ahead by post_receives, consumed by F/B

    def forward(self, action: Action) -> None:
        e = self.e
        rows = self.microbatch(action) if (e.first or e.last) else None
        if e.first:
            x = rows[:, :-1]
        else:
            x = self.received(ActionKind.RECV_ACT, action.microbatch).requires_grad_(True)
        recording = e.split.forward(action.microbatch) if e.split else nullcontext()
        with recording, autocast(e.device, e.cfg.dtype):
            out = functional_call(e.module, e.point.at(action.step), (x,))
        if e.last:
            out = lm_loss(out, rows[:, 1:])
            self.losses[action.step] = self.losses.get(action.step, 0.0) + out.detach().double()
        self.stash[action.microbatch] = (x, out)

    def _backward_target(self, action: Action) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a backward differentiates: the loss share (last stage) or this stage's output
        with the next stage's gradient."""
        out = self.stash[action.microbatch][1]
        if self.e.last:
            return out / self.e.micro_per_step, None
        return out, self.received(ActionKind.RECV_GRAD, action.microbatch)

    def backward(self, action: Action) -> None:
        target, grad = self._backward_target(action)
        x, _ = self.stash.pop(action.microbatch)
        target.backward(grad)
        if not self.e.first:
            self.input_grads[action.microbatch] = x.grad

    def input_gradient(self, action: Action) -> None:
        """I of a split backward: the gradient the previous stage waits for (the first stage
        has none) and every weight gradient but the linear layers', which W computes."""
        e = self.e
        target, grad = self._backward_target(action)
        x, _ = self.stash.pop(action.microbatch)
        weights = e.point.at(action.step)
        gx = e.split.input_gradient(
            action.microbatch, target, grad, None if e.first else x, weights
        )
        if not e.first:
            self.input_grads[action.microbatch] = gx

    def weight_gradient(self, action: Action) -> None:
        """W of a split backward: the linear layers' weight gradients."""
        self.e.split.weight_gradient(action.microbatch)

    def step(self, step: int) -> None:
        """The STEP action: the gradient is complete; average it over the replicas and sum the
        tied weight's with the other stage's (in the background), or apply the update now."""
        e = self.e
        e.point.take_gradients(step)
        total = self.losses.pop(step, None)
        if e.reduction is None and e.tied is None:
            self.apply(step, total)
            return
        # the same order of collectives on every rank: tied first (it spans both groups' ranks)
        tied = e.tied.start(step, [e.store.params[e.tied_name]], None) if e.tied else None
        replicas = None
        if e.reduction is not None:
            loss = None if total is None else total.reshape(1)
            replicas = e.reduction.start(step, e.reduced, loss)
        self.pending = _PendingUpdate(step, total, replicas, tied)

    def finish_update_before(self, action: Action) -> None:
        """Finish a pending update before ``action`` if it needs the version the update makes
        (or is the next STEP, which reuses the gradients' place)."""
        if self.pending is None or not (action.kind.is_compute or action.kind is ActionKind.STEP):
            return
        if action.kind is ActionKind.STEP or action.version > self.pending.step:
            self.finish_update()

    def finish_update(self) -> None:
        if self.pending is None:
            return
        e, pending, self.pending = self.e, self.pending, None
        with label(f"STEP v{pending.step + 1} update"):
            total = pending.total
            if pending.replicas is not None:
                total = e.reduction.finish(pending.replicas, e.reduced)
            if pending.tied is not None:
                e.tied.finish(pending.tied, [e.store.params[e.tied_name]])
            self.apply(pending.step, total)

    def apply(self, step: int, total: torch.Tensor | None) -> None:
        """Clip, step the optimizer and report the step's statistics to the first stage."""
        e = self.e
        norm, ok, lr = e.apply_step(step)
        loss = math.nan if total is None else total.item() / e.micro_per_step
        report = torch.tensor([loss, norm, 0.0 if ok else 1.0], dtype=torch.float64)
        if e.layout.is_first_stage:
            self.gather_stats(step, report, lr)
        else:
            e.messenger.send(report.to(e.device), 0, Channel.STATS, step)
        e.profiler.after_step(step)

    def gather_stats(self, step: int, report: torch.Tensor, lr: float) -> None:
        """The first stage: every stage's statistics of ``step``, to ``on_step``."""
        e = self.e
        reports = [report]
        for peer in range(1, e.layout.pp):
            reports.append(
                e.messenger.recv(
                    (3,),
                    torch.float64,
                    e.device,
                    peer,
                    Channel.STATS,
                    step,
                    f"the statistics of step {step}",
                ).cpu()
            )
        self.on_step(
            StepStats(
                step=step,
                loss=reports[-1][0].item(),
                grad_norm=math.sqrt(sum(r[1].item() ** 2 for r in reports)),
                lr=lr,
                skipped_stages=[s for s, r in enumerate(reports) if r[2].item()],
            )
        )
