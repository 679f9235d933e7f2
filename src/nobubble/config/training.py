"""The training run: how long, from which seed, where it runs and how often it is evaluated."""

from __future__ import annotations

from dataclasses import dataclass

from nobubble.config.fields import FREE, NON_NEGATIVE, POSITIVE, Range, setting

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")  # auto: nobubble.stage_options.compute_dtype
MAX_THREADS = 1024  # threads=: more than any machine's cores (the OS would refuse the threads)


@dataclass
class TrainingSettings:
    steps: int = setting(300, "optimizer steps", POSITIVE, resume=FREE)
    seed: int = setting(0, "seed for initialization and data order", Range(0, 2**32))
    eval_every: int = setting(
        50,
        "evaluate every N steps (and at the end); 0 = only at the end",
        NON_NEGATIVE,
        resume=FREE,
    )
    eval_batches: int = setting(8, "validation batches per evaluation", POSITIVE, resume=FREE)
    device: str = setting("auto", "where to train", choices=DEVICES, resume=FREE)
    dtype: str = setting(
        "auto",
        "float32, or bfloat16 (autocast for matmuls); auto: bfloat16 on CUDA, float32 elsewhere",
        choices=DTYPES,
        saved_default="float32",
    )
    tf32: bool = setting(
        True,
        "CUDA: float32 matmuls and convolutions in TensorFloat-32 (the CPU has none)",
        resume=FREE,
    )
    threads: int = setting(  # each is an OS thread, made at the first parallel operation
        0,
        "torch CPU threads; 0 keeps torch's default",
        Range(0, MAX_THREADS, high_open=False),
        resume=FREE,
    )
