"""packloss.core.checks: every argument check accepts what it should, raises the right error type for the
rest, and names the argument in the message."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from packloss.core import checks


@pytest.mark.parametrize(
    "call, expected",
    [
        (lambda: checks.number("x", 3), 3.0),
        (lambda: checks.number("x", -2.5), -2.5),
        (lambda: checks.number("x", math.inf, finite=False), math.inf),
        (lambda: checks.positive("x", 1e-12), 1e-12),
        (lambda: checks.nonnegative("x", 0), 0.0),
        (lambda: checks.integer("x", 0, minimum=0), 0),
        (lambda: checks.integer("x", -7), -7),
        (lambda: checks.choice("x", "b", ("a", "b")), "b"),
        (lambda: checks.flag("x", False), False),
    ],
)
def test_accepted_values_come_back(call, expected):
    got = call()
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: checks.number("Foo.coef", True), TypeError, "Foo.coef must be a number, got bool True"),
        (lambda: checks.number("Foo.coef", "0.1"), TypeError, "Foo.coef must be a number, got str '0.1'"),
        (lambda: checks.number("Foo.coef", None), TypeError, "Foo.coef must be a number, got NoneType None"),
        (lambda: checks.number("Foo.c", torch.tensor(1.0)), TypeError, "Foo.c must be a number, got Tensor tensor(1.)"),
        (lambda: checks.number("Foo.coef", math.nan), ValueError, "Foo.coef must be finite, got nan"),
        (lambda: checks.number("Foo.coef", math.nan, finite=False), ValueError, "Foo.coef must be finite, got nan"),
        (lambda: checks.number("Foo.coef", -math.inf), ValueError, "Foo.coef must be finite, got -inf"),
        (lambda: checks.positive("Foo.tau", 0.0), ValueError, "Foo.tau must be > 0, got 0.0"),
        (lambda: checks.positive("Foo.tau", math.inf), ValueError, "Foo.tau must be finite, got inf"),
        (lambda: checks.positive("Foo.tau", False), TypeError, "Foo.tau must be a number, got bool False"),
        (lambda: checks.nonnegative("Foo.low", -1e-9), ValueError, "Foo.low must be >= 0, got -1e-09"),
        (lambda: checks.nonnegative("Foo.low", "1"), TypeError, "Foo.low must be a number, got str '1'"),
        (lambda: checks.integer("steps", 2.0), TypeError, "steps must be an int, got float 2.0"),
        (lambda: checks.integer("steps", True), TypeError, "steps must be an int, got bool True"),
        (lambda: checks.integer("steps", 0, minimum=1), ValueError, "steps must be >= 1, got 0"),
        (lambda: checks.choice("mode", "c", ("a", "b")), ValueError, "mode must be one of ('a', 'b'), got 'c'"),
        (lambda: checks.choice("mode", 1, ("a", "b")), ValueError, "mode must be one of ('a', 'b'), got 1"),
        (lambda: checks.flag("strict", 1), TypeError, "strict must be a bool, got int 1"),
        (lambda: checks.flag("strict", "True"), TypeError, "strict must be a bool, got str 'True'"),
    ],
)
def test_errors_have_the_right_type_and_name_the_argument(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert str(info.value) == message


def test_tensor_checks_shape_dtype_and_device_without_reading_values():
    x = torch.tensor([float("nan"), 1.0, 2.0])  # values are never read: NaN passes
    assert checks.tensor("plan.x", x, shape=(3,), floating=True, device=torch.device("cpu")) is x
    mask = torch.tensor([True, False])
    assert checks.tensor("plan.mask", mask, boolean=True) is mask


@pytest.mark.parametrize(
    "value, kwargs, error, message",
    [
        ([1.0, 2.0], {}, TypeError, "plan.x must be a torch.Tensor, got list"),
        (torch.zeros(2, 3), {"shape": (3,)}, ValueError, "plan.x must have shape [3], got [2, 3]"),
        (torch.zeros(3, dtype=torch.long), {"floating": True}, TypeError,
         "plan.x must be a floating-point tensor, got torch.int64"),
        (torch.zeros(3), {"boolean": True}, TypeError, "plan.x must be a bool tensor, got torch.float32"),
        (torch.zeros(3), {"device": torch.device("meta")}, ValueError, "plan.x is on cpu, expected meta"),
    ],
)  # fmt: skip
def test_tensor_errors_name_the_argument(value, kwargs, error, message):
    with pytest.raises(error) as info:
        checks.tensor("plan.x", value, **kwargs)
    assert str(info.value) == message


def test_same_device_names_the_tensor_on_another_device_and_refuses_meta():
    cpu = torch.zeros(2)
    checks.same_device("hidden", cpu.device, labels=cpu, mask=None)
    elsewhere = SimpleNamespace(device=torch.device("cuda", 1))  # same_device reads .device only
    with pytest.raises(ValueError, match=r"labels is on cuda:1 but hidden is on cpu"):
        checks.same_device("hidden", cpu.device, labels=elsewhere)
    with pytest.raises(ValueError, match=r"weight is on the meta device \(deferred initialisation\)"):
        checks.same_device("hidden", cpu.device, weight=torch.empty(2, device="meta"))
    with pytest.raises(ValueError, match=r"hidden is on the meta device"):
        checks.same_device("hidden", torch.device("meta"), weight=cpu)
