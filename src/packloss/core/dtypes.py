"""The compute dtype: losses are computed in at least float32 whatever the inputs' dtype (bf16 and
fp16 are promoted, float64 stays, so ``gradcheck`` and 1e-12 tests work)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["upcast", "compute_dtype", "finite_exp"]


def upcast(x: Tensor) -> Tensor:
    """``x`` in the compute dtype: at least float32."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 if any of ``dtypes`` is float64, else float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _largest_exp_argument(dtype: torch.dtype) -> float:
    """The largest ``x`` of ``dtype`` with a finite ``exp(x)``, one step lower still: a margin for
    ``exp`` kernels that round differently (CUDA's)."""
    x = torch.tensor(math.log(torch.finfo(dtype).max), dtype=dtype)
    below = torch.zeros_like(x)
    while not torch.isfinite(torch.exp(x)):
        x = torch.nextafter(x, below)
    return float(torch.nextafter(x, below))


_EXP_BOUND = {d: _largest_exp_argument(d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def finite_exp(x: Tensor) -> Tensor:
    """``exp(x)``, but near the dtype's largest finite value where it would overflow, with no gradient there.

    A ratio ``exp(log r)`` that overflows only matters in a branch a trust region clips or drops: the
    bound keeps such a branch's backward at ``0 · finite`` instead of ``0 · inf = NaN``, and leaves every
    ratio that does not overflow as ``exp`` computes it.
    """
    return torch.exp(x.clamp(max=_EXP_BOUND[x.dtype]))
