"""The optimizer, its learning-rate schedule, and each stage's gradient clip."""

from __future__ import annotations

from dataclasses import dataclass

from nobubble.config.fields import DECAY, FRACTION, FREE, NON_NEGATIVE, POSITIVE, setting

LR_SCHEDULES = ("cosine", "wsd", "constant")
MUON_ADJUST_LR = ("match_rms_adamw", "original")
MUON_NS_DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class OptimizerSettings:
    optim: str = setting("adamw", "optimizer", registry="optim")
    lr: float = setting(3e-3, "peak learning rate", POSITIVE)
    weight_decay: float = setting(
        0.1, "decoupled weight decay (matrices only; never norms)", NON_NEGATIVE
    )
    beta1: float = setting(0.9, "first-moment decay (Adam-family, Lion, SOAP, MARS)", DECAY)
    beta2: float = setting(0.95, "second-moment decay", DECAY)
    beta3: float = setting(0.99, "third beta (Adan only)", DECAY)
    eps: float = setting(1e-8, "denominator epsilon", POSITIVE)
    nadam_momentum_decay: float = setting(
        0.0,
        "nadamw: NAdam's momentum warm-up ψ, μ_t = β1·(1 - 0.5·0.96^(tψ)); 0 = none, β1 from the "
        "first step (torch's and Ajanthan et al.'s default is 0.004)",
        NON_NEGATIVE,
    )
    momentum: float = setting(0.95, "momentum (muon, signum, sgd)", DECAY)
    nesterov: bool = setting(True, "Nesterov momentum (muon, sgd)")
    muon_adjust_lr: str = setting("match_rms_adamw", "muon LR scaling", choices=MUON_ADJUST_LR)
    muon_ns_dtype: str = setting(
        "auto",
        "muon: dtype of the Newton–Schulz orthogonalization; auto: bfloat16 on CUDA and on CPUs "
        "with bfloat16 matrix instructions, else float32 (docs/optimizers.md)",
        choices=MUON_NS_DTYPES,
        resume=FREE,
    )
    muon_blocks: int = setting(
        1,
        "muon: orthogonalize each hidden matrix in this many blocks, split as tensor parallelism "
        "would split it (column-parallel matrices by output rows, row-parallel by input "
        "columns), each block scaled by its own shape; 1 = the whole matrix (docs/optimizers.md)",
        POSITIVE,
    )
    lr_schedule: str = setting(
        "cosine", "learning-rate schedule, after a linear warmup", choices=LR_SCHEDULES
    )
    warmup_steps: int = setting(20, "linear warmup steps", NON_NEGATIVE)
    decay_frac: float = setting(0.2, "WSD: share of steps spent decaying at the end", FRACTION)
    min_lr_ratio: float = setting(0.1, "final LR as a share of the peak (cosine, wsd)", FRACTION)
    grad_clip: float = setting(
        1.0, "max gradient norm per pipeline stage; 0 disables clipping", NON_NEGATIVE
    )
    nonfinite_patience: int = setting(
        3,
        "abort after this many steps in a row whose update was skipped for a non-finite gradient",
        POSITIVE,
        resume=FREE,
    )
