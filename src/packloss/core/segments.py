"""Sync-free segment reductions over the sequences of a packed bin.

A packed bin of ``N`` tokens holds ``S`` sequences; ``seq_ids`` (``[N]``, long) names the sequence of
each token. ``S`` is known on the host (it comes from ``seq_lens``), so every output shape is known
without reading the device: these functions never synchronise, and their number of tensor
operations does not depend on ``S``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["segment_sum", "segment_count", "segment_mean", "segment_max", "segment_min", "broadcast"]


def segment_sum(x: Tensor, seq_ids: Tensor, num_segments: int) -> Tensor:
    """``out[s] = Σ_{t: seq_ids[t] = s} x[t]``.  ``x [N, ...]`` → ``[S, ...]``, differentiable."""
    out = torch.zeros((num_segments, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out.index_add(0, seq_ids, x)


def segment_count(mask: Tensor, seq_ids: Tensor, num_segments: int) -> Tensor:
    """Number of member tokens per sequence, as float32.  ``mask [N]`` (bool) → ``[S]``."""
    return segment_sum(mask.to(torch.float32), seq_ids, num_segments)


def segment_mean(x: Tensor, mask: Tensor, seq_ids: Tensor, num_segments: int) -> tuple[Tensor, Tensor]:
    """Per-sequence mean of ``x`` over the members of ``mask``: ``(mean [S], count [S])``.

    ``mean[s] = Σ_{t∈s, mask[t]} x[t] / max(count[s], 1)``, so a sequence without members has mean 0.
    Non-member values never enter the result (masked with ``where`` before the sum), even inf or NaN.
    """
    count = segment_count(mask, seq_ids, num_segments)  # [S]
    total = segment_sum(torch.where(mask, x, torch.zeros_like(x)), seq_ids, num_segments)  # [S]
    return total / count.clamp_min(1), count


def _segment_extreme(x: Tensor, mask: Tensor, seq_ids: Tensor, num_segments: int, reduce: str) -> Tensor:
    fill = float("-inf") if reduce == "amax" else float("inf")
    values = torch.where(mask, x, torch.full_like(x, fill))  # [N]
    out = torch.full((num_segments,), fill, dtype=x.dtype, device=x.device)
    return out.scatter_reduce(0, seq_ids, values, reduce=reduce, include_self=True)


def segment_max(x: Tensor, mask: Tensor, seq_ids: Tensor, num_segments: int) -> Tensor:
    """Per-sequence maximum over members; ``-inf`` for a sequence without members.  ``[N]`` → ``[S]``."""
    return _segment_extreme(x, mask, seq_ids, num_segments, "amax")


def segment_min(x: Tensor, mask: Tensor, seq_ids: Tensor, num_segments: int) -> Tensor:
    """Per-sequence minimum over members; ``+inf`` for a sequence without members.  ``[N]`` → ``[S]``."""
    return _segment_extreme(x, mask, seq_ids, num_segments, "amin")


def broadcast(values: Tensor, seq_ids: Tensor) -> Tensor:
    """Spread per-sequence values back to their tokens: ``out[t] = values[seq_ids[t]]``.  ``[S]`` → ``[N]``."""
    return values.index_select(0, seq_ids)
