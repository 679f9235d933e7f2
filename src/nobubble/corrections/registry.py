"""The delay corrections: one module each (its facts, its state and its rule), collected here.

:data:`REGISTRY` holds each module's :class:`~nobubble.corrections.spec.Correction`: its rule in
our notation, its extra memory, what it needs from the optimizer, the schedules it is meant for,
its source, the settings it reads, the configurations it refuses (and why), and for an update or
gradient correction how to wrap a stage's optimizer. docs/corrections.md is the long form.
"""

from __future__ import annotations

from nobubble.config import ConfigError, TrainConfig, correction_names
from nobubble.corrections import dc, ef, nesterov, predict, spike
from nobubble.corrections.response import Response, delay, momentum
from nobubble.corrections.spec import Correction
from nobubble.optim.composite import OptimizerLike

REGISTRY: dict[str, Correction] = {
    module.CORRECTION.name: module.CORRECTION for module in (ef, nesterov, spike, dc, predict)
}
CORRECTION_NAMES = tuple(REGISTRY)


def chosen(cfg: TrainConfig) -> tuple[str, ...]:
    """The corrections ``cfg`` asks for, in the registry's order;
    refuses a name it does not know and two that both change the update."""
    names = correction_names(cfg)
    for name in names:
        if name not in REGISTRY:
            raise ConfigError(
                f"unknown correction {name!r}; choose none or a combination with + of: "
                f"{', '.join(CORRECTION_NAMES)}"
            )
    wrappers = [n for n in CORRECTION_NAMES if n in names and REGISTRY[n].wrap is not None]
    if len(wrappers) > 1:
        raise ConfigError(
            f"corrections {' and '.join(wrappers)} both change the update; choose one of them "
            "(predict combines with any one, e.g. correction=ef+predict)"
        )
    return tuple(n for n in CORRECTION_NAMES if n in names)


def check(cfg: TrainConfig) -> None:
    """Refuse a correction that cannot serve ``cfg``, saying why."""
    for name in chosen(cfg):
        reason = REGISTRY[name].refuses(cfg)
        if reason:
            raise ConfigError(f"correction {name}: {reason}")


def predicts(cfg: TrainConfig) -> bool:
    """Whether the stages' steps run at the weight prediction ŵ (``correction=...+predict``)."""
    return "predict" in chosen(cfg)


def step_response(cfg: TrainConfig, gradient_delay: int) -> Response:
    """The whole delayed step of a stage with ``gradient_delay`` as one linear response: the
    delay, the optimizer's momentum (:func:`~nobubble.corrections.response.momentum`) and the
    corrections ``cfg`` chooses (docs/corrections.md, "Impulse responses")."""
    whole = delay(gradient_delay).then(momentum(cfg).response)
    for name in chosen(cfg):
        whole = whole.then(REGISTRY[name].response(cfg, gradient_delay))
    return whole


def wrap_optimizer(optimizer: OptimizerLike, cfg: TrainConfig, delay: int) -> OptimizerLike:
    """A stage's ``optimizer`` (whose parameters have gradient ``delay``) wrapped in the update
    or gradient correction ``cfg`` chooses, if any."""
    for name in chosen(cfg):
        wrap = REGISTRY[name].wrap
        if wrap is not None:
            return wrap(optimizer, cfg, delay)
    return optimizer
