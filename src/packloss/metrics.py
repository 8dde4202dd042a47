"""Exact merging of metrics across micro-batches and data-parallel ranks.

Every metric comes with the member count it was taken over, so the merged value is the
token-weighted mean ``Σ_i value_i · count_i / max(Σ_i count_i, 1)``, exactly what one call over all
the tokens would have reported.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["merge_metrics", "all_reduce_metrics"]

Metrics = tuple[dict[str, Tensor], dict[str, Tensor]]


def merge_metrics(parts: Iterable[object]) -> Metrics:
    """Merge scalar metrics of several results (``LossResult`` or ``(metrics, counts)`` pairs).

    A name missing from a part counts as zero members there. Returns ``(metrics, counts)``.
    """
    sums: dict[str, Tensor] = {}
    totals: dict[str, Tensor] = {}
    for part in parts:
        metrics, counts = (part.metrics, part.counts) if hasattr(part, "metrics") else part
        for key, value in metrics.items():
            count = counts[key]
            if value.dim() != 0:
                raise ValueError(f"metric {key!r} is per-sequence (shape {tuple(value.shape)}); merge scalars only")
            sums[key] = sums.get(key, 0) + value * count
            totals[key] = totals.get(key, 0) + count
    return {k: sums[k] / totals[k].clamp_min(1) for k in sums}, totals


def all_reduce_metrics(metrics: dict[str, Tensor], counts: dict[str, Tensor], group=None) -> Metrics:
    """Token-weighted merge over the ranks of ``group`` with one ``all_reduce`` of a ``[2, K]`` tensor.

    Every rank must pass the same metric names (in any order).
    """
    keys = sorted(metrics)
    packed = torch.stack(
        [torch.stack([metrics[k] * counts[k] for k in keys]), torch.stack([counts[k] for k in keys])]
    ).to(torch.float32)  # [2, K]
    dist.all_reduce(packed, group=group)
    merged = packed[0] / packed[1].clamp_min(1)
    return {k: merged[i] for i, k in enumerate(keys)}, {k: packed[1, i] for i, k in enumerate(keys)}
