"""clip_grad_norm: total L2 norm before clipping; max_norm 0 only measures."""

import pytest
import torch

from nobubble.optim.clipping import clip_grad_norm


def _params() -> list[torch.nn.Parameter]:
    a, b, frozen = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    a.grad = torch.tensor([3.0, 0.0])
    b.grad = torch.tensor([0.0, 4.0])
    return [a, b, frozen]  # frozen has no gradient and is ignored


def test_returns_the_norm_and_leaves_gradients_alone_when_disabled() -> None:
    params = _params()
    assert clip_grad_norm(params, 0.0) == pytest.approx(5.0)
    assert params[0].grad.tolist() == [3.0, 0.0]
    assert params[1].grad.tolist() == [0.0, 4.0]


def test_clips_to_max_norm_and_returns_the_norm_before_clipping() -> None:
    params = _params()
    assert clip_grad_norm(iter(params), 1.0) == pytest.approx(5.0)
    assert params[0].grad.tolist() == pytest.approx([0.6, 0.0], rel=1e-5)
    assert params[1].grad.tolist() == pytest.approx([0.0, 0.8], rel=1e-5)


def test_norm_below_max_norm_is_untouched() -> None:
    params = _params()
    assert clip_grad_norm(params, 10.0) == pytest.approx(5.0)
    assert params[1].grad.tolist() == [0.0, 4.0]


def test_no_gradients_gives_zero() -> None:
    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(3))], 1.0) == 0.0
