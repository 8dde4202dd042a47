"""Argument checks, written once: every public entry point validates through these, and every error
names the argument (in the caller's words) and what was wrong with it."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import torch
from torch import Tensor

__all__ = ["number", "positive", "nonnegative", "integer", "choice", "flag", "host_sequence", "host_flags", "tensor"]


def number(name: str, value: object, *, finite: bool = True) -> float:
    """``value`` as a float: a real number (never a bool or a string), finite unless ``finite=False``
    (NaN is always rejected)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def positive(name: str, value: object) -> float:
    """A finite number ``> 0``."""
    value = number(name, value)
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def nonnegative(name: str, value: object) -> float:
    """A finite number ``>= 0``."""
    value = number(name, value)
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def integer(name: str, value: object, *, minimum: int | None = None) -> int:
    """A Python int (never a bool or a float), at least ``minimum`` when given."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def choice(name: str, value: object, allowed: Collection[str]) -> str:
    """One of ``allowed``."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value


def flag(name: str, value: object) -> bool:
    """A bool (not an int or a string that reads as one)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def host_sequence(name: str, value: object, length: int, kind: str = "values") -> tuple:
    """``value`` as a tuple of ``length`` host values, one per sequence (a list or tuple, never a tensor:
    reading one would be a sync); ``kind`` names the elements in the errors ("ints", "bools")."""
    if isinstance(value, Tensor):
        raise TypeError(f"{name} must be host-side Python {kind} (a list or tuple), not a tensor")
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list or tuple of {kind}, got {type(value).__name__}")
    items = tuple(value)
    if len(items) != length:
        raise ValueError(f"{name} holds {len(items)} values for S={length} sequences")
    return items


def host_flags(name: str, value: object, length: int) -> tuple[bool, ...]:
    """``value`` as a tuple of ``length`` host bools (:func:`host_sequence`)."""
    return tuple(flag(name, f) for f in host_sequence(name, value, length, "bools"))


def tensor(
    name: str,
    value: object,
    *,
    shape: tuple[int, ...] | None = None,
    floating: bool = False,
    boolean: bool = False,
    integer: bool = False,
    device: torch.device | None = None,
) -> Tensor:
    """``value`` as a tensor of ``shape`` (when given), floating-point, bool or integer (when asked), on
    ``device`` (when given). Reads shapes, dtypes and devices only: never a value."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(value.shape)}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if boolean and value.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {value.dtype}")
    if integer and (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} is on {value.device}, expected {device}")
    return value


def same_device(reference: str, device: torch.device, **tensors: Tensor | None) -> None:
    """Raise ``ValueError`` unless every given tensor is on ``device``, the device of ``reference``;
    a tensor on the meta device (deferred initialisation) has no values and is refused by name."""
    for name, dev in ((reference, device), *((k, t.device) for k, t in tensors.items() if t is not None)):
        if dev.type == "meta":
            raise ValueError(f"{name} is on the meta device (deferred initialisation): materialise it first")
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(
                f"{name} is on {t.device} but {reference} is on {device}: the tensors of one loss share a device"
            )


def mask_dtype(name: str, value: Tensor) -> None:
    """A mask is bool or integer: a floating one would be read as ``≠ 0`` and its fractions lost."""
    if value.is_floating_point() or value.is_complex():
        raise TypeError(
            f"{name} must be a bool (or integer) tensor, got {value.dtype}: a fractional mask would be "
            "binarised; weight the tokens with the loss's coefficients (or weights) instead"
        )
