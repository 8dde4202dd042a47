"""The compute dtype: losses are computed in at least float32 whatever the inputs' dtype (bf16 and
fp16 are promoted, float64 stays, so ``gradcheck`` and 1e-12 tests work)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["upcast", "compute_dtype"]


def upcast(x: Tensor) -> Tensor:
    """``x`` in the compute dtype: at least float32."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 if any of ``dtypes`` is float64, else float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32
