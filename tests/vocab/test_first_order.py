"""packloss.vocab.first_order: the vocabulary Functions refuse create_graph=True, where a gradient
penalty added to another loss used to differentiate to nothing, silently."""

from __future__ import annotations

import pytest
import torch

from packloss.vocab.distill import reverse_kl
from packloss.vocab.first_order import first_order
from packloss.vocab.head import linear_logprobs
from packloss.vocab.head_distill import linear_distill

F64 = torch.float64


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 3, generator=g, dtype=F64, requires_grad=True)
    weight = torch.randn(7, 3, generator=g, dtype=F64, requires_grad=True)
    return hidden, weight, torch.randn(5, 7, generator=g, dtype=F64), torch.randint(0, 7, (5,), generator=g)


LOSSES = {
    "divergence": lambda h, w, t, y: reverse_kl(h @ w.T, t).sum(),
    "linear_logprobs": lambda h, w, t, y: linear_logprobs(h, w, y)[0].sum(),
    "linear_distill": lambda h, w, t, y: linear_distill(h, w, t)[0],
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_a_gradient_penalty_beside_another_loss_raises_instead_of_vanishing(name):
    h, w, t, y = _inputs()
    loss = LOSSES[name](h, w, t, y)
    with pytest.raises(RuntimeError, match=f"{name} is first order only"):
        torch.autograd.grad(loss, (h, w), create_graph=True, retain_graph=True)
    (h.square().sum() + loss).backward()  # the first-order path is unchanged
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


def test_first_order_keeps_the_backward_of_an_ordinary_function():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        @first_order("double")
        def backward(ctx, g):
            return 2 * g

    x = torch.ones(3, requires_grad=True)
    (grad,) = torch.autograd.grad(Double.apply(x).sum(), x)
    assert grad.tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(RuntimeError, match="double is first order only"):
        torch.autograd.grad(Double.apply(x).sum(), x, create_graph=True)
