"""The weights each step's forwards and backwards run at, with or without weight prediction.

Without a correction, stage s with gradient delay d runs step t at its version c = max(t - d, 0)
(:mod:`nobubble.schedules.registry`). Weight prediction (``correction=predict``) runs it at

    ŵ[t] = w[c] + d·(w[c] - w[c-1]),    w[-1] = w[0]

the version step t would run at without prediction, moved on by d copies of the change that
made it. w[c+1] never enters ŵ: the first stage of a real pipeline starts step t's forwards
before that update exists (under 2bw: c = t-1, ŵ[t] = 2·w[t-1] - w[t-2], and the update of step
t-1 needs all of step t-1's backwards), and every stage follows the same rule: the last stage,
which has stepped t-1 before its first forward of step t, and the one-process engine, which has
stepped
t-1 before step t starts, read versions c and c-1 only. The gradient computed at ŵ[t] is
applied to the true weights (the optimizer's parameters, version t); ŵ[t] is what the backward
of every microbatch of step t reads (it takes the place of the stashed version). A stage with
delay 0 runs at its version as before: there ŵ would be w[t].

Memory: the stage keeps its true versions one step further back (w[c-1] until ŵ[t] is formed, so
d+2 versions instead of d+1) and holds ŵ of every step in flight. ŵ[t] is formed in the buffer of
w[c-1] where nothing reads that version again, and a step's ŵ buffer is reused once its gradient
is taken, so under 2bw a stage holds 3 weight copies instead of 2: ŵ[t] (in flight), ŵ[t+1] or
w[t-1], and the optimizer's w[t].
"""

from __future__ import annotations

import torch

from nobubble.config import TrainConfig
from nobubble.corrections.response import Response, fir
from nobubble.corrections.spec import GENERALISATION, Correction, Source
from nobubble.layout import ParallelLayout
from nobubble.schedules.registry import schedule_spec
from nobubble.versions import VersionStore, Weights, gradient_version


class StepWeights:
    """Where the steps of one stage (``store``, gradient ``delay``) run: its delayed version, or
    with ``predict`` the prediction ŵ (module docstring).

    ``history``: how many steps back the stage keeps true versions, what
    :func:`nobubble.stage_update.prepare_step` keeps and a checkpoint holds (its delay, one more
    when predicting).
    """

    def __init__(self, store: VersionStore, delay: int, predict: bool = False) -> None:
        self.store, self.delay = store, delay
        self.predict = predict and delay > 0
        self.history = delay + 1 if self.predict else delay
        self.formed: dict[int, Weights] = {}  # step -> ŵ, from its first forward to its STEP

    def at(self, step: int) -> Weights:
        """The weights every forward and backward of ``step`` runs at (formed on the first call:
        call it when the step's first forward starts, before any later version exists)."""
        if not self.predict:
            return self.store[gradient_version(step, self.delay)]
        if step not in self.formed:
            self.formed[step] = self._predict(step)
        return self.formed[step]

    @torch.no_grad()
    def _predict(self, step: int) -> Weights:
        newer = gradient_version(step, self.delay)
        older = max(newer - 1, 0)
        # the next step's prediction reads newer and max(newer, 1) - 1: past older, or older again
        last_use = older < gradient_version(step + 1, self.delay) - 1
        out = self.store.take(older) if last_use else self.store.spare()
        base, previous = self.store[newer], (out if last_use else self.store[older])
        for name, tensor in out.items():
            torch.sub(base[name], previous[name], out=tensor)
            tensor.mul_(self.delay)
            tensor.add_(base[name])
        return out

    def take_gradients(self, step: int) -> None:
        """Move the gradient of ``step`` (complete) onto the optimizer's parameters."""
        if not self.predict:
            self.store.take_gradients(gradient_version(step, self.delay))
            return
        weights = self.formed.pop(step)
        for name, param in self.store.params.items():
            param.grad, weights[name].grad = weights[name].grad, None
        self.store.recycle(weights)

    def copies(self) -> int:
        """Weight copies held now: true versions and predictions."""
        return len(self.store.held()) + len(self.formed)


def _refuses(cfg: TrainConfig) -> str | None:
    if max(schedule_spec(cfg.schedule).delays(ParallelLayout.of(cfg).model_stages)) == 0:
        return (
            f"{cfg.schedule} with stages={cfg.stages} has no gradient delay to extrapolate over "
            "(every step would run at its weights themselves, a plain run under another name); "
            "use schedule=2bw, or pipedream with stages >= 2, or drop predict"
        )
    return None


def response(delay: int) -> Response:
    """On a quadratic the gradient is affine in the weights, so the gradient at
    ŵ = w[c] + D·(w[c] - w[c-1]) is (1 + D)·g(w[c]) - D·g(w[c-1]): relative to the delay the
    finite filter [1 + D, -D], mean delay -D, which cancels the delay D in the mean (under 2bw
    the response of EF at γ = 1)."""
    return fir(1 + delay, -delay) if delay else fir(1.0)


CORRECTION = Correction(
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
    source=Source(
        GENERALISATION,
        "weight prediction as in SpecTrain (Chen et al. 2018, arXiv 1809.02839) and Kosson et "
        "al. 2021 (arXiv 2003.11666)",
        ours=(
            "they extrapolate along the optimizer's momentum; this extrapolates the last "
            "applied change, whatever the optimizer"
        ),
    ),
    response=lambda _cfg, delay: response(delay),
    refuses=_refuses,
)
