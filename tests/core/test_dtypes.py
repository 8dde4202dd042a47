"""packloss.core.dtypes: upcast promotes to at least float32 (float64 stays), compute_dtype picks float64
only when an input is float64, finite_exp is exp bounded below overflow."""

from __future__ import annotations

import math

import pytest
import torch

from packloss.core.dtypes import _EXP_BOUND, compute_dtype, finite_exp, upcast


@pytest.mark.parametrize(
    "dtype, expected",
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        (torch.int64, torch.float32),
        (torch.bool, torch.float32),
    ],
)
def test_upcast_promotes_to_at_least_float32(dtype, expected):
    x = torch.tensor([0, 1, 1], dtype=dtype)
    y = upcast(x)
    assert y.dtype == expected
    assert y.tolist() == [0.0, 1.0, 1.0]


def test_upcast_is_the_identity_when_nothing_changes_and_keeps_the_gradient():
    x = torch.tensor([-1.5, 0.25], dtype=torch.float64, requires_grad=True)
    assert upcast(x) is x
    low = torch.tensor([-1.5, 0.25], dtype=torch.bfloat16, requires_grad=True)
    (upcast(low) * torch.tensor([2.0, 3.0])).sum().backward()
    assert low.grad.dtype == torch.bfloat16 and low.grad.tolist() == [2.0, 3.0]


@pytest.mark.parametrize(
    "dtypes, expected",
    [
        ((), torch.float32),
        ((torch.bfloat16,), torch.float32),
        ((torch.float16, torch.bfloat16, torch.float32), torch.float32),
        ((torch.float32, torch.float64), torch.float64),
        ((torch.bfloat16, torch.float64), torch.float64),
    ],
)
def test_compute_dtype(dtypes, expected):
    assert compute_dtype(*dtypes) == expected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_finite_exp_is_exp_where_exp_is_finite(dtype):
    edge = 1.2 * _EXP_BOUND[dtype]
    x = torch.linspace(-edge, edge, 4001, dtype=torch.float64).to(dtype)
    exact = torch.exp(x)
    below = torch.isfinite(exact) & (x < _EXP_BOUND[dtype])
    assert below.any() and (~below).any()
    assert torch.equal(finite_exp(x)[below], exact[below])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finite_exp_is_finite_with_no_gradient_where_exp_overflows(dtype):
    x = torch.tensor([1e4, math.inf, 0.0], dtype=dtype, requires_grad=True)
    y = finite_exp(x)
    assert torch.isfinite(y).all()
    assert y[0] == y[1] and y[0] > torch.finfo(dtype).max / 2
    (g,) = torch.autograd.grad((y * torch.tensor([0.0, 0.0, 1.0], dtype=dtype)).sum(), x)
    assert g.tolist() == [0.0, 0.0, 1.0]  # torch.exp gives 0 · inf = NaN for the first two
