"""A plain PyTorch training step, written out, that the engines are checked against."""

import torch

from nobubble.model.layers import lm_loss
from nobubble.optim.lr_schedule import lr_at, set_lr


def plain_step(
    model, optimizer, batch, cfg, t, grad_model=None, stage_of=lambda name: 0, adjust=None
):
    """Gradient accumulation over M microbatches, clipping per stage (per ``stage_of`` key), one
    optimizer step.

    With ``grad_model`` the gradient is computed there (old weights) and applied to ``model``;
    ``adjust(model)`` may change the gradients before the clip.
    """
    source = grad_model or model
    total = 0.0
    for micro in batch.chunk(cfg.microbatches):
        loss = lm_loss(source(micro[:, :-1]), micro[:, 1:])
        (loss / cfg.microbatches).backward()
        total += loss.item()
    if grad_model is not None:
        for p, q in zip(model.parameters(), grad_model.parameters(), strict=True):
            p.grad, q.grad = q.grad, None
    if adjust is not None:
        adjust(model)
    stages: dict[int, list] = {}
    for name, p in model.named_parameters():
        stages.setdefault(stage_of(name), []).append(p)
    for params in stages.values():
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    set_lr(optimizer, lr_at(t, cfg))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total / cfg.microbatches
