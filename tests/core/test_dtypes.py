"""packloss.core.dtypes: upcast promotes to at least float32 (float64 stays), compute_dtype picks float64
only when an input is float64."""

from __future__ import annotations

import pytest
import torch

from packloss.core.dtypes import compute_dtype, upcast


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
