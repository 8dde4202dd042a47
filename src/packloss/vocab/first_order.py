"""First-order autograd Functions: a backward that refuses to build a graph of the gradient."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

__all__ = ["first_order"]


def first_order(name: str) -> Callable[[Callable], Callable]:
    """Decorate the ``backward`` of the Function behind ``name`` (a public function): ``once_differentiable``,
    and a ``RuntimeError`` when the gradient's own graph is asked for (``create_graph=True``, as a
    gradient penalty does), where ``once_differentiable`` alone would hand back a detached gradient."""

    def decorate(backward: Callable) -> Callable:
        inner = once_differentiable(backward)

        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():  # only create_graph=True runs a backward with grad mode on
                raise RuntimeError(
                    f"{name} is first order only: its gradient has no graph, so create_graph=True (a "
                    "gradient penalty, double backward) would differentiate nothing; compute it without "
                    "create_graph, or through plain autograd ops"
                )
            return inner(ctx, *grads)

        return checked

    return decorate
