"""Spike compensation for a gradient delay of D steps (Kosson et al., MLSys 2021).

A gradient that arrives D steps late has missed D steps of its momentum's impulse response. The
compensated update applies the missed part at once and shrinks what the momentum still carries:

    heavy ball (sgd, v = m·v + g):   w[t+1] = w[t] - η·(a·v[t] + b·g[t]),
                                     a = m^D,  b = (1 - m^D)/(1 - m)
    EMA (adamw, m = β1·m + (1-β1)·g): the numerator m̂ becomes (a·m[t] + (1 - a)·g[t])/(1 - β1^t),
                                     a = β1^D (the same impulse response, normalized)

D is each parameter's own delay (2bw: 1; pipedream: P-1-s on stage s; 0 leaves it untouched).
Optimizers whose update is not linear in the momentum (Muon's orthogonalization, the sign of
Lion/Signum, SOAP's rotation, Adan's and MARS's extra terms) are refused: a·v + b·g has no
defined place in them.
"""

from __future__ import annotations

import torch

from nobubble.config import TrainConfig
from nobubble.corrections.base import UpdateCorrection
from nobubble.corrections.response import Response, fir
from nobubble.corrections.spec import PUBLISHED, Correction, Source
from nobubble.optim.composite import CompositeOptimizer, OptimizerLike

SUPPORTED = ("sgd", "adamw")


class SpikeCompensation(UpdateCorrection):
    """Wraps torch's SGD (heavy ball, no Nesterov) or AdamW; no buffer of its own (it reads the
    optimizer's momentum). ``delays``: each parameter's delay D."""

    kind = "spike"
    buffer_key = "spike"

    def __init__(self, base: OptimizerLike, delays: dict[torch.Tensor, int]) -> None:
        super().__init__(base)
        parts = base.optimizers if isinstance(base, CompositeOptimizer) else [base]
        self.owner: dict[torch.Tensor, torch.optim.Optimizer] = {}
        for part in parts:
            if not isinstance(part, torch.optim.SGD | torch.optim.AdamW):
                raise ValueError(f"spike compensation supports {SUPPORTED}, not {part!r}")
            for group in part.param_groups:
                if isinstance(part, torch.optim.SGD) and group["nesterov"]:
                    raise ValueError("spike compensation is for heavy-ball SGD, not Nesterov")
                for p in group["params"]:
                    self.owner[p] = part
        self.delays = delays

    def _correct(self, params: list[torch.Tensor], before: list[torch.Tensor]) -> None:
        # the groups as they are now: loading a state (a resume) replaces the group dicts
        groups = {p: group for group in self.param_groups for p in group["params"]}
        for p, w in zip(params, before, strict=True):
            delay = self.delays[p]
            if delay == 0:
                continue
            group, state = groups[p], self.owner[p].state[p]
            if isinstance(self.owner[p], torch.optim.SGD):
                m, lr = group["momentum"], group["lr"]
                a = m**delay
                b = (1 - a) / (1 - m)
                g = p.grad.add(w, alpha=group["weight_decay"])  # torch's L2 term
                velocity = state["momentum_buffer"] if m else torch.zeros_like(p)
                p.copy_(w - lr * (a * velocity + b * g))
            else:
                beta1, beta2 = group["betas"]
                t = float(state["step"])
                a = beta1**delay
                denominator = (state["exp_avg_sq"].sqrt() / (1 - beta2**t) ** 0.5).add_(
                    group["eps"]
                )
                shift = (state["exp_avg"] - p.grad).div_(denominator)
                p.add_(shift, alpha=group["lr"] / (1 - beta1**t) * (1 - a))

    def __repr__(self) -> str:
        return f"SpikeCompensation({self.base!r})"


def _refuses(cfg: TrainConfig) -> str | None:
    if cfg.optim not in SUPPORTED:
        return (
            f"spike compensation is defined for optimizers whose update is linear in the "
            f"momentum ({', '.join(SUPPORTED)}); {cfg.optim} is not (docs/corrections.md)"
        )
    if cfg.optim == "sgd" and cfg.nesterov and cfg.momentum > 0:
        return "spike compensation is for heavy-ball momentum; set nesterov=false"
    return None


def _wrap(optimizer: OptimizerLike, cfg: TrainConfig, delay: int) -> SpikeCompensation:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return SpikeCompensation(optimizer, dict.fromkeys(params, delay))


def response(cfg: TrainConfig, delay: int) -> Response:
    """Relative to the optimizer's own momentum m (sgd: momentum; adamw: β1), the compensated
    step is the finite filter [(1 - m^(D+1))/(1 - m), -m·(1 - m^D)/(1 - m)]: an error feedback of
    γ = m·(1 - m^D)/(1 - m) (γ = m under 2bw), which applies the D missed terms of the
    momentum's response at once (D = 0: none)."""
    m = cfg.beta1 if cfg.optim == "adamw" else cfg.momentum
    if m == 0:
        return fir(1.0)
    gamma = m * (1 - m**delay) / (1 - m)
    return fir(1 + gamma, -gamma)


CORRECTION = Correction(
    name="spike",
    acts_on="update",
    rule=(
        "w[t+1] = w[t] - η·(a·v[t] + b·g[t]), a = m^D, b = (1 - m^D)/(1 - m) "
        "(adamw: numerator a·m[t] + (1 - a)·g[t], a = β1^D)"
    ),
    memory="none (a transient snapshot during the step)",
    needs="the optimizer's momentum: torch SGD (heavy ball) or AdamW",
    schedules="pipedream (D = P-1-s), 2bw (D = 1)",
    source=Source(
        PUBLISHED,
        "Kosson et al., Pipelined Backpropagation at Scale: Training Large Models without "
        "Batches, MLSys 2021, arXiv 2003.11666 (heavy-ball SGD)",
        ours="the AdamW form (the same response for its EMA, in Adam's numerator)",
    ),
    response=response,
    refuses=_refuses,
    wrap=_wrap,
)
