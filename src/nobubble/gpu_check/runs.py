"""What a run of the GPU check is (:class:`CheckRun`), the settings every run takes, how a row's
processes talk, what a row is expected to be next to its reference, and each run's timeout.

Every run trains SmolLM2-360M's shape (preset ``smollm2-360m``, tied embeddings) for a few steps
on short sequences in bfloat16, so that a run, its final checkpoint included, takes seconds.
Gradient clipping is off, the one rule that depends on how the model is cut: then every
synchronous schedule computes what one-process 1F1B on two stages computes, whatever its stages
and chunks (:mod:`nobubble.gpu_check.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# the settings of every run (a row's own come after): the model and where it runs, then how
# long and how it trains (without clipping: see the module's docstring)
MODEL = ("preset=smollm2-360m", "seq_len=256", "batch_size=16", "dtype=bfloat16", "device=cuda")
MODEL += ("p2p_timeout_s=120",)  # a hang fails within the check's time, naming what it waited for
TRAINING = ("steps=6", "eval_every=0", "eval_batches=2", "optim=adamw", "lr=3e-4")
TRAINING += ("warmup_steps=2", "grad_clip=0")
# how a row's processes talk: its settings, the table's words, its name's suffix. NCCL: a GPU
# each; gloo (emulated NCCL, or gloo's own order and sums): one GPU that the processes share
EMULATED = ("dist_backend=gloo", "emulate_nccl=true")
TRANSPORTS = {
    "nccl": (("dist_backend=nccl",), "NCCL", "nccl"),
    "emulated": (EMULATED, "gloo, emulated NCCL, one GPU shared", "gloo"),
    "gloo": (("dist_backend=gloo",), "gloo, one GPU shared", "gloo-plain"),
}

# what a row is expected to be, next to its reference: bitwise equal; close (another summation
# order, compiled kernels); a repeat of it (whatever it is: this GPU's run-to-run noise)
BITWISE, CLOSE, REPEATS = "bitwise", "close", "repeats"

# what a run without a reference is for
REFERENCE, SMOKE, THROUGHPUT, AUDIT = "reference", "smoke", "throughput", "audit"

# each run's timeout (s), by what it is: a run that passes it is a hang, its stacks dumped
TIMEOUTS = {SMOKE: 60.0, REFERENCE: 180.0, "row": 180.0, "compiled": 420.0, THROUGHPUT: 300.0}
TIMEOUTS[AUDIT] = TIMEOUTS["row"]


@dataclass(frozen=True)
class CheckRun:
    """One run of the check: ``settings`` come after ``base`` (:data:`MODEL` and
    :data:`TRAINING` unless said); ``processes`` is torchrun's ``--nproc-per-node`` (0: one
    process, no torchrun) on ``gpus`` GPUs; ``reference`` names the one-process run it is
    compared with (None: it is one, or a run of another ``kind``), ``expect`` how closely;
    ``timeout_s``: how long it may take before it counts as a hang."""

    name: str
    settings: tuple[str, ...]
    processes: int = 0
    gpus: int = 1
    reference: str | None = None
    expect: str = BITWISE
    transport: str = "one process"
    kind: str = REFERENCE
    timeout_s: float = TIMEOUTS[REFERENCE]
    base: tuple[str, ...] = MODEL + TRAINING

    @property
    def schedule(self) -> str:
        return self.setting("schedule")

    def setting(self, key: str, default: str = "") -> str:
        values = [s.split("=", 1)[1] for s in self.settings if s.startswith(f"{key}=")]
        return values[-1] if values else default

    def line(self) -> str:
        """How the script reads it: name, processes, GPUs, reference (- for none), settings."""
        head = [self.name, str(self.processes), str(self.gpus), self.reference or "-"]
        return " ".join([*head, *self.base, *self.settings])


@dataclass(frozen=True)
class Skipped:
    """A run this machine cannot do, and why."""

    name: str
    why: str


def audit_folder(out: Path, run: CheckRun) -> Path:
    """Where the processes of audit row ``run`` write what they found, one folder a row."""
    return out / "audit" / run.name
