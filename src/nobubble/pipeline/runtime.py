"""One pipeline process: executes its action list of the schedule IR on real tensors.

The process holds one model stage, or several under an interleaved schedule (the layout's
``chunks``); each is a :class:`nobubble.pipeline.held_stage.HeldStage` with its slice of the
model and its weight versions (:class:`nobubble.versions.VersionStore`, the same as the
simulator's), and every action names the stage it runs on. Every F runs with the
version its action names and every B with the same one (weight stashing through
``functional_call``, never an in-place swap); a STEP clips, steps the optimizer on the newest
version and, when microbatches in flight still need it, first copies it (two versions under 2bw).
With weight prediction every F and B of a step runs at its prediction ŵ instead, formed at the
step's first F from the versions held then (:mod:`nobubble.corrections.predict`).

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

Versions follow the schedule's delays (:mod:`nobubble.schedules.registry`) for the global step, so
a run cut into segments (for evaluations and checkpoints) computes exactly what an uncut run
computes; for a segment that starts the run the IR's own versions are checked against that rule
as each action is planned. A process plans its actions as it runs them, a few ahead
(:class:`_Plan`), never a whole segment up front: a segment of any length starts at once and
holds flat memory.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.func import functional_call

from nobubble.checkpoint.named_state import NamedState
from nobubble.config import TrainConfig
from nobubble.engine import StepStats, peak_memory_mb
from nobubble.evaluation import EvalSums
from nobubble.layout import ParallelLayout
from nobubble.model.layers import lm_loss
from nobubble.model.moe import routing_size, unpack_routing
from nobubble.model.partition import stage_specs
from nobubble.model.presets import ModelConfig
from nobubble.pipeline.channels import Channel
from nobubble.pipeline.comm import Messenger, PendingRecv
from nobubble.pipeline.held_stage import HeldStage
from nobubble.pipeline.links import Links, resolve_links
from nobubble.pipeline.replicas import PendingReduction, replica_rows
from nobubble.profiling import OFF, action_label, label, labelled
from nobubble.schedules import (
    Action,
    ActionKind,
    lower_rank,
    rank_actions,
    schedule_spec,
    until_step,
)
from nobubble.stage_options import autocast
from nobubble.versions import gradient_version

RECV_CHANNELS = {ActionKind.RECV_ACT: Channel.ACTIVATION, ActionKind.RECV_GRAD: Channel.GRADIENT}
RECV_AHEAD = 4  # post a receive this many actions before the action that consumes it


def segment_actions(
    cfg: TrainConfig, layout: ParallelLayout, start: int, stop: int
) -> Iterator[Action]:
    """The lowered actions of this process (``layout``'s pipeline position) for steps
    [start, stop), with global indices and versions, made as they are read: planning costs a
    step's actions at a time whatever ``stop`` is."""
    # a step is cfg.microbatches microbatches (pipedream: 1, which the config enforces)
    chunks = cfg.chunks
    planned = rank_actions(
        cfg.schedule,
        cfg.stages,
        cfg.microbatches,
        stop - start,
        layout.pp_rank,
        chunks if chunks > 1 else None,
    )
    rank_of = {stage: layout.rank_of(stage) for stage in range(layout.model_stages)}
    delays = schedule_spec(cfg.schedule).delays(layout.model_stages)
    for action in lower_rank(planned, rank_of, layout.model_stages - 1):
        step = action.step + start
        # a STEP produces version step+1; F, B and their messages use the delayed version
        delay = delays[action.stage]
        version = step + 1 if action.kind is ActionKind.STEP else gradient_version(step, delay)
        if start == 0 and version != action.version:
            raise RuntimeError(
                f"schedule IR and delay rule disagree at stage {action.stage}: {action} should "
                f"use version {version}; this is a bug in nobubble"
            )
        microbatch = (
            None if action.microbatch is None else action.microbatch + start * cfg.microbatches
        )
        yield dataclasses.replace(action, step=step, microbatch=microbatch, version=version)


class _Plan:
    """A segment's actions, read a few ahead of the one running (to post receives early)."""

    def __init__(self, actions: Iterator[Action]) -> None:
        self.actions = actions
        self.window: collections.deque[Action] = collections.deque()

    def ahead(self, count: int) -> list[Action]:
        """The next ``count`` actions (fewer at the end), the next one to run first."""
        while len(self.window) < count and (action := next(self.actions, None)) is not None:
            self.window.append(action)
        return list(itertools.islice(self.window, count))

    def peek(self) -> Action | None:
        """The next action to run, or None when the segment is done."""
        return next(iter(self.ahead(1)), None)

    def pop(self) -> None:
        self.window.popleft()

    def stop_at(self, step: int) -> None:
        """Run no action of ``step`` or later: what remains is the cool-down of a segment that
        ends at ``step`` (:func:`nobubble.schedules.until_step`)."""
        ahead = list(self.window)  # a copy: the chain reads it after the window is cleared
        self.actions = until_step(itertools.chain(ahead, self.actions), step)
        self.window.clear()


class PipelineEngine:
    """The model stages ``layout.stages`` of replica ``layout.replica`` of a pipeline
    (torch.distributed must be initialized). Peers are addressed by model stage; the layout maps
    stages to ranks. ``replicas``: the process group of this process's data-parallel replicas
    (None without data parallelism)."""

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
        specs = stage_specs(cfg, mc)
        split = schedule_spec(cfg.schedule).split_backward
        tied = tied_group(layout) if mc.tie_embeddings and layout.pp > 1 else None
        self.held = {
            stage: HeldStage(stage, specs[stage], cfg, mc, device, layout, replicas, tied, split)
            for stage in layout.stages
        }
        self.first, self.last = layout.is_first_stage, layout.is_last_stage
        # the statistics every process reports per held stage: loss, norm, skipped, routing
        self.mc, self.moe_blocks = mc, [[i for i in s.blocks if mc.is_moe(i)] for s in specs]
        self.report_width = 3 + max(len(b) for b in self.moe_blocks) * routing_size(mc)
        self.delay = max(held.trained.delay for held in self.held.values())
        self.profiler = OFF  # profile_steps: set while training (nobubble.profiling.profiled)
        links = Links.build(layout, resolve_links(cfg.p2p_routes, dist.get_backend()))
        self.messenger = Messenger(layout, cfg.p2p_timeout_s, links)
        self.hidden_shape = (cfg.microbatch_size() // layout.dp, cfg.seq_len, mc.d_model)
        self.val_batches = val_batches
        self.eval_sequence = 0
        self.step = 0
        self.micro_per_step = cfg.microbatches  # pipedream: 1, which the config enforces
        self.train_wall_s = self.train_idle_s = 0.0
        # per (model stage, action kind): time spent running its actions, blocked time left out
        self.action_s: dict[tuple[int, ActionKind], float] = {}
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
        plan = _Plan(segment_actions(self.cfg, self.layout, self.step, stop))
        run = _Segment(self, next_batch, on_step)
        started, waited = time.perf_counter(), self.messenger.waited_s
        while (action := plan.peek()) is not None:
            if action.step > run.cleared:  # this stage's first action of the step
                self.profiler.before_step(action.step)
                if not run.clear(action.step, should_stop):
                    plan.stop_at(action.step)
                    continue
            run.finish_update_before(action)
            run.post_receives(plan.ahead(RECV_AHEAD))
            began, blocked = time.perf_counter(), self.blocked_s()
            with action_label(action):
                run.execute(action)
            took = time.perf_counter() - began - (self.blocked_s() - blocked)
            key = (action.stage, action.kind)
            self.action_s[key] = self.action_s.get(key, 0.0) + took
            plan.pop()
        run.finish_updates()
        run.count_remaining_votes()
        self.messenger.drain()
        self.train_wall_s += time.perf_counter() - started
        self.train_idle_s += self.messenger.waited_s - waited

    def blocked_s(self) -> float:
        """Time blocked so far on pipeline peers, data-parallel and tied all-reduces."""
        blocked = self.messenger.waited_s
        for held in self.held.values():
            blocked += held.reduction.waited_s if held.reduction else 0.0
            blocked += held.tied.waited_s if held.tied else 0.0
        return blocked

    def stage_reports(self, digests: bool = True) -> list[dict[str, float]] | None:
        """Every rank's idle time and memory, gathered on the leader (a collective call), so far
        in this session; ``digests``: with the digests of the weights (which read all of them).

        One report per process (``stage``: its pipeline position; ``stages``: the model stages
        it holds). ``idle_s`` counts the time blocked on pipeline peers and, with data
        parallelism, on the gradient all-reduce (``allreduce_wait_s`` of its ``allreduce_s``),
        and on a process that holds a tied copy, on the tied all-reduce
        (``tied_allreduce_wait_s`` of ``tied_allreduce_s``); ``tied_sha256`` is the digest of its
        copy's newest version. ``allreduce_last_s`` and ``allreduce_last_wait_s`` are the run's
        final all-reduce alone (no compute is left to hide it behind; the benchmark reports it
        apart).
        """
        held = list(self.held.values())
        reductions = [h.reduction for h in held if h.reduction]
        tied = [h for h in held if h.tied]
        idle = self.train_idle_s + sum(r.waited_s for r in reductions)
        idle += sum(h.tied.waited_s for h in tied)
        action_s: dict[str, dict[str, float]] = {}
        for (stage, kind), seconds in sorted(self.action_s.items()):
            action_s.setdefault(str(stage), {})[kind.value] = seconds
        report = {
            "stage": self.layout.pp_rank,
            "stages": list(self.layout.stages),
            "replica": self.layout.replica,
            "blocks": sum(len(h.spec.blocks) for h in held),
            "train_wall_s": self.train_wall_s,
            "idle_s": idle,
            "idle_fraction": idle / self.train_wall_s if self.train_wall_s else 0.0,
            "peak_mem_mb": peak_memory_mb(self.device),
            "param_mb": sum(h.param_mb() for h in held),
            "weight_versions_peak": max(h.trained.versions_peak for h in held),
            "action_s": action_s,
        }
        if digests:
            report["weights_sha256"] = weights_digest(self.newest_weights())
        if reductions:
            report |= _summed([r.report("allreduce") for r in reductions])
        for h in tied:  # at most one: the first or the last stage
            if digests:
                newest = h.trained.store[h.trained.store.newest]
                report["tied_sha256"] = weights_digest({h.tied_name: newest[h.tied_name]})
            report |= h.tied.report("tied_allreduce")
        reports = [None] * self.layout.world if self.layout.is_leader else None
        dist.gather_object(report, reports, dst=self.layout.leader)
        return reports

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
        """Forward the validation batches through the stages at the newest weights, one
        microbatch at a time through this process's stages in order."""
        sums = EvalSums()
        chunks: list[torch.Tensor] = [
            replica_rows(micro, self.layout)
            for batch in batches
            for micro in batch.to(self.device).chunk(self.cfg.microbatches)
        ]
        count = self.val_batches * self.cfg.microbatches
        chunk_of = self.layout.chunk_of
        for i in range(count):
            sequence = self.eval_sequence + i
            for stage, held in self.held.items():
                if held.first:
                    x = chunks[i][:, :-1]
                else:
                    x = self.messenger.recv(
                        self.hidden_shape,
                        torch.float32,
                        self.device,
                        stage - 1,
                        Channel.EVAL_ACTIVATION,
                        sequence,
                        f"evaluation activation {i}",
                        chunk=chunk_of(stage),
                    )
                with autocast(self.device, self.cfg.dtype):
                    out = held.module(x)
                if held.last:
                    sums.add(out, chunks[i][:, 1:], token_bytes)
                else:
                    self.messenger.send(
                        out.float(),
                        stage + 1,
                        Channel.EVAL_ACTIVATION,
                        sequence,
                        chunk=chunk_of(stage + 1),
                    )
        self.eval_sequence += count
        sums = self._gather_to_first_stage(sums)
        self.messenger.drain()
        return sums

    def _gather_to_first_stage(self, sums: EvalSums) -> EvalSums:
        """The totals of every replica's share, on the first stage of every replica."""
        reduction = self.held[self.layout.stages[-1]].reduction
        if self.last and reduction:
            totals = torch.tensor(sums.as_list(), dtype=torch.float64, device=self.device)
            reduction.sum_now(totals, "the evaluation totals of the other replicas")
            sums = EvalSums.from_list(totals.tolist())
        if self.layout.pp == 1:
            return sums
        last = self.layout.model_stages - 1
        if self.last:
            totals = torch.tensor(sums.as_list(), dtype=torch.float64, device=self.device)
            self.messenger.send(totals, 0, Channel.EVAL_SUMS, self.eval_sequence)
        if self.first:
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
            key: tensor
            for held in self.held.values()
            for key, tensor in held.trained.checkpoint_tensors().items()
        }

    def checkpoint_state(self) -> dict[str, Any]:
        """The step and the optimizer state of this process's stages by parameter name."""
        state = NamedState.merge(held.trained.named_state() for held in self.held.values())
        return {"step": self.step, "optimizer": state}

    def restore(self, tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        """Continue from a checkpoint of any layout: ``tensors`` and ``state`` hold (at least)
        this process's parameters by name; other parameters are not looked at."""
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
    sums: torch.Tensor  # HeldStage.step_sums (loss and routing), before any all-reduce
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
        # keyed by (stage, microbatch): stage's (input, output) of its F; its input gradient
        self.stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.recvs: dict[tuple[ActionKind, int, int], PendingRecv] = {}
        self.losses: dict[int, torch.Tensor] = {}  # float64 sums, read once per step
        self.cleared = engine.step - 1  # the last step known to run
        self.votes: dict[int, list[PendingRecv]] = {}  # leader: the other ranks' stop votes
        self.pending: dict[int, _PendingUpdate] = {}  # by stage: STEPs awaiting all-reduces
        self.reports: dict[int, dict[int, torch.Tensor]] = {}  # step -> stage -> statistics

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

    def post_receives(self, actions: list[Action]) -> None:
        """Post the receives of ``actions`` (the next few to run) in steps known to run."""
        for action in actions:
            key = (action.kind, action.stage, action.microbatch)
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
                    f"the {what} of microbatch {action.microbatch} for stage {action.stage} "
                    f"(step {action.step})",
                    chunk=self.e.layout.chunk_of(action.stage),
                )

    def received(self, kind: ActionKind, action: Action) -> torch.Tensor:
        return self.e.messenger.wait(self.recvs.pop((kind, action.stage, action.microbatch)))

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
        held = e.held[action.stage]
        if kind is ActionKind.F:
            self.forward(held, action)
        elif kind is ActionKind.B:
            self.backward(held, action)
        elif kind is ActionKind.I:
            self.input_gradient(held, action)
        elif kind is ActionKind.W:
            held.split.weight_gradient(action.microbatch)  # the linear layers' weight gradients
        elif kind is ActionKind.SEND_ACT:
            e.messenger.send(
                self.stash[action.stage, action.microbatch][1],
                action.peer,
                Channel.ACTIVATION,
                action.microbatch,
                chunk=e.layout.chunk_of(action.peer),
            )
        elif kind is ActionKind.SEND_GRAD:
            e.messenger.send(
                self.input_grads.pop((action.stage, action.microbatch)),
                action.peer,
                Channel.GRADIENT,
                action.microbatch,
                chunk=e.layout.chunk_of(action.peer),
            )
        elif kind is ActionKind.STEP:
            self.step(held, action.step)
        # RECV_*: posted ahead by post_receives, consumed by F/B

    def forward(self, held: HeldStage, action: Action) -> None:
        e = self.e
        rows = self.microbatch(action) if (held.first or held.last) else None
        if held.first:
            x = rows[:, :-1]
        else:
            x = self.received(ActionKind.RECV_ACT, action).requires_grad_(True)
        recording = held.split.forward(action.microbatch) if held.split else nullcontext()
        with recording, autocast(e.device, e.cfg.dtype):
            out = functional_call(held.module, held.trained.at(action.step), (x,))
        if held.last:
            out = lm_loss(out, rows[:, 1:])
            self.losses[action.step] = self.losses.get(action.step, 0.0) + out.detach().double()
        self.stash[action.stage, action.microbatch] = (x, out)

    def _backward_target(
        self, held: HeldStage, action: Action
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a backward differentiates: the loss share (last stage) or this stage's output
        with the next stage's gradient."""
        out = self.stash[action.stage, action.microbatch][1]
        if held.last:
            return out / self.e.micro_per_step, None
        return out, self.received(ActionKind.RECV_GRAD, action)

    def backward(self, held: HeldStage, action: Action) -> None:
        target, grad = self._backward_target(held, action)
        x, _ = self.stash.pop((action.stage, action.microbatch))
        target.backward(grad)
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

    def step(self, held: HeldStage, step: int) -> None:
        """The STEP action of one held stage: its gradient is complete; average it over the
        replicas and sum the tied weight's with the other stage's (in the background), or
        apply the update now."""
        held.trained.take_gradients(step)
        sums = held.step_sums(self.losses.pop(step, None) if held.last else None)
        if held.reduction is None and held.tied is None:
            self.apply(held, step, sums)
            return
        # the same order of collectives on every rank: tied first (it spans both groups' ranks)
        tied_copy = [held.trained.params[held.tied_name]] if held.tied else []
        tied = held.tied.start(step, tied_copy, None) if held.tied else None
        replicas = None
        if held.reduction is not None:
            replicas = held.reduction.start(step, held.reduced, sums)
        self.pending[held.index] = _PendingUpdate(step, sums, replicas, tied)

    def finish_update_before(self, action: Action) -> None:
        """Finish pending updates before ``action`` where it needs the version they make (or is
        the next STEP of their stage, which reuses the gradients' place).

        A process's stages move to a new version together: a compute action on any of them that
        needs a newer version finishes every pending update. An interleaved process would
        otherwise keep its last stage's update (and so its step's statistics, which the first
        stage waits for) pending behind forwards that wait for the first stage.
        """
        if not (action.kind.is_compute or action.kind is ActionKind.STEP):
            return
        for stage, pending in list(self.pending.items()):
            next_step = action.kind is ActionKind.STEP and action.stage == stage
            if next_step or (action.kind.is_compute and action.version > pending.step):
                self.finish_update(stage)

    def finish_updates(self) -> None:
        """Finish every pending update (the end of a segment), in the order they started."""
        for stage in list(self.pending):
            self.finish_update(stage)

    def finish_update(self, stage: int) -> None:
        pending, held = self.pending.pop(stage), self.e.held[stage]
        with label(f"STEP v{pending.step + 1} update"):
            sums = pending.sums
            if pending.replicas is not None:
                sums = held.reduction.finish(pending.replicas, held.reduced)
            if pending.tied is not None:
                held.tied.finish(pending.tied, [held.trained.params[held.tied_name]])
            self.apply(held, pending.step, sums)

    def apply(self, held: HeldStage, step: int, sums: torch.Tensor) -> None:
        """Clip, step the optimizer; once every stage of this process has, report the step's
        statistics to the first stage: a row per held stage of (loss, gradient norm, skipped,
        its MoE routing sums), zero-padded to the engine's ``report_width``."""
        e = self.e
        norm, ok, lr = held.apply_step(step, sums)
        sums = sums.cpu()
        loss = sums[0].item() / e.micro_per_step if held.last else math.nan
        row = torch.zeros(e.report_width, dtype=torch.float64)
        row[:3] = torch.tensor([loss, norm, 0.0 if ok else 1.0], dtype=torch.float64)
        row[3 : 2 + len(sums)] = sums[1:]
        reports = self.reports.setdefault(step, {})
        reports[held.index] = row
        if len(reports) < len(e.held):
            return
        del self.reports[step]
        e.step = step + 1
        mine = torch.stack([reports[stage] for stage in e.layout.stages])
        if e.layout.is_first_stage:
            self.gather_stats(step, mine, lr)
        else:
            e.messenger.send(mine.to(e.device), 0, Channel.STATS, step)
        e.profiler.after_step(step)

    def gather_stats(self, step: int, mine: torch.Tensor, lr: float) -> None:
        """The first stage: every stage's statistics of ``step``, to ``on_step``."""
        e = self.e
        by_rank = [mine]
        for peer in range(1, e.layout.pp):  # the process of model stage `peer` (chunk 0)
            by_rank.append(
                e.messenger.recv(
                    (e.layout.chunks, e.report_width),
                    torch.float64,
                    e.device,
                    peer,
                    Channel.STATS,
                    step,
                    f"the statistics of step {step}",
                ).cpu()
            )
        # model stage c·P + r is row c of pipeline rank r's report
        reports = [
            by_rank[s % e.layout.pp][e.layout.chunk_of(s)]
            for s in range(len(by_rank) * e.layout.chunks)
        ]
        routing = {}
        for stage, row in enumerate(reports):
            routing.update(unpack_routing(row[3:], e.moe_blocks[stage], e.mc))
        self.on_step(
            StepStats(
                step=step,
                loss=reports[-1][0].item(),
                grad_norm=math.sqrt(sum(r[1].item() ** 2 for r in reports)),
                lr=lr,
                routing=routing,
                skipped_stages=[s for s, r in enumerate(reports) if r[2].item()],
            )
        )
