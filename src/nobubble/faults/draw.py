"""What each run of the fault campaign is: a layout and a fault, drawn from the seed.

Run ``i`` of seed ``s`` is drawn from a generator of its own (seeded ``"s-i"``), so it is the same
whatever ``--runs`` says: a campaign of 10 runs is the first 10 of one of 50.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

STAGES = 2  # pipeline stages of every run: the layouts vary dp, zero and the transport
STEPS = 80
CHECKPOINT_EVERY = 10
# The settings every run shares, its twin included: a model small enough for 4 processes on 2
# cores, long enough (a few seconds of steps) for a fault to land in the middle, and timeouts
# short enough that a stopped rank is given up on within the run's minute: the peer timeout for
# a message, the groups' timeout for a barrier or a gather (a checkpoint's, an evaluation's),
# whose default (30 minutes) leaves room for a large checkpoint's fsync.
P2P_TIMEOUT_S = 20
GROUP_TIMEOUT_S = 60
SETTINGS = (
    "d_model=32", "n_layers=4", "n_heads=4", "n_kv_heads=2", "d_ff=64", "seq_len=32",
    "batch_size=8", "microbatches=2", "eval_batches=1", "threads=1", "lr=3e-3",
    "warmup_steps=2", f"stages={STAGES}", f"steps={STEPS}", "eval_every=20",
    f"checkpoint_every={CHECKPOINT_EVERY}", "keep_checkpoints=3", f"p2p_timeout_s={P2P_TIMEOUT_S}",
    f"group_timeout_s={GROUP_TIMEOUT_S}",
)  # fmt: skip

SCHEDULES = ("2bw", "1f1b")
SIGTERM = "sigterm"  # SIGTERM to torchrun, which passes it on: a graceful stop
SIGKILL_RANK = "sigkill_rank"  # SIGKILL of one rank: its peers must notice it is gone
SIGSTOP_RANK = "sigstop_rank"  # SIGSTOP of one rank: its peers give up after p2p_timeout_s
FULL_DISK = "full_disk"  # the run folder's file system fills up
READ_ONLY = "read_only"  # the run folder and everything in it stop taking writes
DAMAGED_CHECKPOINT = "damaged_checkpoint"  # stopped, then a file of its newest checkpoint damaged
KINDS = (SIGTERM, SIGKILL_RANK, SIGSTOP_RANK, FULL_DISK, READ_ONLY, DAMAGED_CHECKPOINT)
RANK_KINDS = (SIGKILL_RANK, SIGSTOP_RANK)
# The files of a checkpoint of STAGES shards, one of which a damaged_checkpoint fault damages.
SHARD_FILES = ("weights.safetensors", "state.safetensors", "state.json", "meta.json")
CHECKPOINT_FILES = (
    "manifest.json",
    *(f"shard_{shard}/{name}" for shard in range(STAGES) for name in SHARD_FILES),
)
DAMAGES = ("flip", "truncate")  # one byte in the middle flipped; cut to half its length


@dataclass(frozen=True)
class Layout:
    """How a run is laid out; its twin is the run of the same layout without a fault."""

    schedule: str
    dp: int
    zero: int
    emulate_nccl: bool

    @property
    def world(self) -> int:
        """torchrun's processes: a rank per stage and replica."""
        return STAGES * self.dp

    @property
    def name(self) -> str:
        transport = "emulated" if self.emulate_nccl else "gloo"
        return f"{self.schedule}-dp{self.dp}-zero{self.zero}-{transport}"

    def settings(self) -> list[str]:
        """The run's settings (zero only where it is read, at dp > 1)."""
        emulate = "true" if self.emulate_nccl else "false"
        layout = [f"schedule={self.schedule}", f"dp={self.dp}", f"emulate_nccl={emulate}"]
        return [*SETTINGS, *layout, *([f"zero={self.zero}"] if self.dp > 1 else [])]


@dataclass(frozen=True)
class Fault:
    """What happens to a run once it has logged ``at_step``: ``rank`` for the kinds that hit one
    rank; ``target`` (a file of the newest checkpoint) and ``damage`` for a damaged checkpoint."""

    kind: str
    at_step: int
    rank: int | None = None
    target: str | None = None
    damage: str | None = None

    @property
    def checkpoints_needed(self) -> int:
        """Sealed checkpoints the run must have before the fault: one to resume from (a run
        stopped before its first is refused by --auto-resume, by design), two where the newest
        is damaged."""
        return 2 if self.kind == DAMAGED_CHECKPOINT else 1


@dataclass(frozen=True)
class Trial:
    """Run ``index`` of the campaign."""

    index: int
    layout: Layout
    fault: Fault

    @property
    def name(self) -> str:
        return f"{self.index:03d}-{self.fault.kind}-{self.layout.name}"


def draw_layout(rng: random.Random) -> Layout:
    """2bw or 1f1b, dp 1 or 2, zero 0 or 1 (only at dp 2: it shares nothing at dp 1), the NCCL
    emulator on or off."""
    schedule = rng.choice(SCHEDULES)
    dp = rng.choice((1, 2))
    zero = rng.choice((0, 1)) if dp > 1 else 0
    return Layout(schedule, dp, zero, rng.choice((False, True)))


def draw_fault(rng: random.Random, layout: Layout, kinds: tuple[str, ...]) -> Fault:
    """One of ``kinds``, after a step drawn between the checkpoint(s) it needs and the last
    checkpoint before the end (so that the run is still training when it comes)."""
    kind = rng.choice(kinds)
    first = CHECKPOINT_EVERY * (2 if kind == DAMAGED_CHECKPOINT else 1) + 1
    at_step = rng.randint(first, STEPS - CHECKPOINT_EVERY)
    if kind in RANK_KINDS:
        return Fault(kind, at_step, rank=rng.randrange(layout.world))
    if kind == DAMAGED_CHECKPOINT:
        return Fault(kind, at_step, target=rng.choice(CHECKPOINT_FILES), damage=rng.choice(DAMAGES))
    return Fault(kind, at_step)


def draw_trials(runs: int, seed: int, kinds: tuple[str, ...] = KINDS) -> list[Trial]:
    """The campaign's ``runs`` runs for ``seed``, faults among ``kinds``."""
    trials = []
    for index in range(runs):
        rng = random.Random(f"{seed}-{index}")
        layout = draw_layout(rng)
        trials.append(Trial(index, layout, draw_fault(rng, layout, kinds)))
    return trials
