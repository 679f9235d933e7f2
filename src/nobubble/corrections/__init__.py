"""Delay corrections: the one registry of what each correction is and where it acts.

A correction acts at one of three points of a step (:data:`ACTS_ON`):

- ``update``: changes the step from w[t] to w[t+1] given the base optimizer's result (ef,
  nesterov, spike);
- ``gradient``: changes the gradient the optimizer receives, after the stage's clip (dc);
- ``weights``: changes the weights a step's forwards and backwards run at (predict).

The first two wrap the optimizer (:class:`~nobubble.optim.update_correction.UpdateCorrection`,
built by :func:`nobubble.optim.build_optimizer`), so both backends run them unchanged; at most one
of them (``config.UPDATE_CORRECTIONS``). A ``weights`` correction lives in the engines
(:mod:`nobubble.prediction`) and combines with any one of them.

:data:`REGISTRY` holds one :class:`Correction` per name: its rule in our notation, its extra
memory, what it needs from the optimizer, the schedules it is meant for, its source, the
configurations it refuses (and why), and for an update correction how to wrap an optimizer.
docs/corrections.md is the long form. ``config.CORRECTIONS`` lists the names the ``correction``
key accepts; a name not registered here is refused by :func:`check` as not implemented yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nobubble.config import ConfigError, TrainConfig, chosen_corrections
from nobubble.corrections.dc import DelayCompensation
from nobubble.corrections.nesterov import NesterovCorrection
from nobubble.corrections.spike import SUPPORTED as SPIKE_OPTIMIZERS
from nobubble.corrections.spike import SpikeCompensation
from nobubble.model.partition import stage_parameter_names, stage_specs
from nobubble.model.resolve import model_config
from nobubble.optim.composite import OptimizerLike
from nobubble.optim.ef import ErrorFeedback
from nobubble.schedules.registry import schedule_spec

ACTS_ON = ("update", "gradient", "weights")
Delays = Callable[[], dict[torch.Tensor, int]]  # each parameter's delay, computed when asked
Wrap = Callable[[OptimizerLike, TrainConfig, Delays], OptimizerLike]


@dataclass(frozen=True)
class Correction:
    name: str
    acts_on: str  # one of ACTS_ON
    rule: str  # in the notation of docs/corrections.md
    memory: str  # extra memory per parameter
    needs: str  # what it needs from the optimizer
    schedules: str  # the schedules it is meant for
    source: str
    refuses: Callable[[TrainConfig], str | None] = lambda cfg: None  # why not, or None
    wrap: Wrap | None = None  # update and gradient ones: optimizer -> corrected optimizer


REGISTRY: dict[str, Correction] = {}


def register(correction: Correction) -> None:
    if correction.acts_on not in ACTS_ON:
        raise ValueError(f"{correction.name}: acts_on must be one of {ACTS_ON}")
    if correction.name in REGISTRY:
        raise ValueError(f"correction {correction.name!r} is registered twice")
    REGISTRY[correction.name] = correction


def check(cfg: TrainConfig) -> None:
    """Refuse a correction that is not implemented or cannot serve ``cfg``, saying why."""
    for name in chosen_corrections(cfg):
        if name not in REGISTRY:
            raise ConfigError(f"correction {name} is not implemented yet")
        reason = REGISTRY[name].refuses(cfg)
        if reason:
            raise ConfigError(f"correction {name}: {reason}")


def wrap_optimizer(
    optimizer: OptimizerLike,
    named_params: list[tuple[str, torch.nn.Parameter]],
    cfg: TrainConfig,
) -> OptimizerLike:
    """``optimizer`` (over ``named_params``) wrapped in the update or gradient correction ``cfg``
    chooses, if any."""

    def delays() -> dict[torch.Tensor, int]:
        of_name = parameter_delays([name for name, _ in named_params], cfg)
        return {param: of_name[name] for name, param in named_params}

    for name in chosen_corrections(cfg):
        correction = REGISTRY[name]
        if correction.wrap is not None:
            return correction.wrap(optimizer, cfg, delays)
    return optimizer


def parameter_delays(names: list[str], cfg: TrainConfig) -> dict[str, int]:
    """Each parameter's gradient delay under ``cfg``'s schedule and stage split, from its name
    (the names are the same in both backends)."""

    delays = schedule_spec(cfg.schedule).delays(cfg.model_stages())
    if len(set(delays)) == 1:
        return dict.fromkeys(names, delays[0])
    mc = model_config(cfg, tokenizer_vocab=1)
    specs = stage_specs(cfg, mc)
    owned = stage_parameter_names(names, specs)
    return {name: delays[stage] for stage, group in enumerate(owned) for name in group}


def _spike_refuses(cfg: TrainConfig) -> str | None:
    if cfg.optim not in SPIKE_OPTIMIZERS:
        return (
            f"spike compensation is defined for optimizers whose update is linear in the "
            f"momentum ({', '.join(SPIKE_OPTIMIZERS)}); {cfg.optim} is not (docs/corrections.md)"
        )
    if cfg.optim == "sgd" and cfg.nesterov and cfg.momentum > 0:
        return "spike compensation is for heavy-ball momentum; set nesterov=false"
    return None


def _dc_refuses(cfg: TrainConfig) -> str | None:
    if "predict" in chosen_corrections(cfg):
        return (
            "dc compensates for the distance from the stale weights the gradient was computed at, "
            "and predict computes it elsewhere (at ŵ); drop one of them"
        )
    return None


register(
    Correction(
        name="ef",
        acts_on="update",
        rule="w[t+1] = w[t] - Δ[t] - γ·(Δ[t] - Δ[t-1]), γ = ef_gamma",
        memory="1 buffer (Δ[t-1]) + a transient snapshot during the step",
        needs="nothing but step() (any optimizer)",
        schedules="2bw (delay 1); runs under any",
        source="Zmushko et al. 2026 (error-feedback-style correction)",
        wrap=lambda opt, cfg, _delays: ErrorFeedback(opt, cfg.ef_gamma),
    )
)
register(
    Correction(
        name="nesterov",
        acts_on="update",
        rule=(
            "u[t] = γ·u[t-1] + (1-γ)·Δ[t]; w[t+1] = w[t] - γ·u[t] - (1-γ)·Δ[t], γ = nesterov_gamma"
        ),
        memory="1 buffer (u[t-1]) + a transient snapshot during the step",
        needs="nothing but step() (any optimizer)",
        schedules="2bw, pipedream; runs under any",
        source="Ajanthan et al., ICML 2025, arXiv 2505.01099",
        wrap=lambda opt, cfg, _delays: NesterovCorrection(opt, cfg.nesterov_gamma),
    )
)
register(
    Correction(
        name="spike",
        acts_on="update",
        rule=(
            "w[t+1] = w[t] - η·(a·v[t] + b·g[t]), a = m^D, b = (1 - m^D)/(1 - m) "
            "(adamw: numerator a·m[t] + (1 - a)·g[t], a = β1^D)"
        ),
        memory="none (a transient snapshot during the step)",
        needs="the optimizer's momentum: torch SGD (heavy ball) or AdamW",
        schedules="pipedream (D = P-1-s), 2bw (D = 1)",
        source="Kosson et al., MLSys 2021, arXiv 2003.11666",
        refuses=_spike_refuses,
        wrap=lambda opt, cfg, delays: SpikeCompensation(opt, delays()),
    )
)
register(
    Correction(
        name="dc",
        acts_on="gradient",
        rule="g̃ = g + λ·g⊙g⊙(w[t] - w[t-D]), λ = dc_lambda; with dc_mean_square_decay m > 0, "
        "λ/√(ms + ε), ms = m·ms + (1-m)·g⊙g",
        memory="D buffers (the last D applied changes), one more for the adaptive variant's "
        "mean square, + a transient snapshot during the step",
        needs="nothing but step() (any optimizer)",
        schedules="2bw, pipedream; nothing to do at delay 0",
        source="Zheng et al., ICML 2017, arXiv 1609.08326",
        refuses=_dc_refuses,
        wrap=lambda opt, cfg, delays: DelayCompensation(
            opt, cfg.dc_lambda, delays(), cfg.dc_mean_square_decay
        ),
    )
)

# -- weight-side corrections ---------------------------------------------------------------------


def _predict_refuses(cfg: TrainConfig) -> str | None:
    if max(schedule_spec(cfg.schedule).delays(cfg.model_stages())) == 0:
        return (
            f"{cfg.schedule} with stages={cfg.stages} has no gradient delay to extrapolate over "
            "(every step would run at its weights themselves, a plain run under another name); "
            "use schedule=2bw, or pipedream with stages >= 2, or drop predict"
        )
    return None


register(
    Correction(
        name="predict",
        acts_on="weights",
        rule=(
            "F and B of step t run at ŵ[t] = w[c] + D·(w[c] - w[c-1]), c = max(t - D, 0), "
            "w[-1] = w[0]; the gradient is applied to the true w[t]"
        ),
        memory=(
            "1 weight copy per stage under 2bw (3 instead of 2: ŵ of the step in flight, the "
            "next ŵ or w[t-1], w[t]); pipedream: D+2 versions plus ŵ per step in flight"
        ),
        needs="nothing (any optimizer)",
        schedules="2bw (D = 1), pipedream (D = P-1-s); refused where every delay is 0",
        source=(
            "weight prediction as in SpecTrain (Chen et al. 2018, arXiv 1809.02839) and Kosson "
            "et al. (arXiv 2003.11666), which extrapolate the momentum; here the applied change"
        ),
        refuses=_predict_refuses,
    )
)
