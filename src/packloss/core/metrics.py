"""Metrics: masked means over a bin with the member count they were taken over, and their exact
merge across micro-batches and ranks (the token-weighted mean ``Σ_i value_i · count_i / max(Σ_i
count_i, 1)``; ``*_min`` / ``*_max`` by min / max over the parts with members)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from packloss.core.agreement import check_agreement, raised_on_every_rank
from packloss.core.dtypes import upcast
from packloss.core.segments import Segments

__all__ = ["masked_mean", "metric_means", "merge_metrics", "all_reduce_metrics"]

Metrics = tuple[dict[str, Tensor], dict[str, Tensor]]


def masked_mean(
    values: Tensor,
    mask: Tensor,
    segments: Segments | None = None,
    per_sequence: bool = False,
    count: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Sync-free mean of ``values [N]`` over ``mask [N]`` and its member count: scalars (this rank's
    tokens), or ``([S], [S])`` per sequence of ``segments`` (over the whole bin). Values off ``mask``
    never enter (inf/NaN safe); bools count as 0/1. ``count`` (scalar mode) is ``mask.sum()`` when the
    caller already has it."""
    if per_sequence:
        if segments is None:
            raise ValueError("per_sequence=True needs segments")
        return segments.mean(upcast(values.detach()), mask)
    if count is None:
        count = mask.sum(dtype=torch.float32)
    if values.dtype == torch.bool:  # a fraction: count the members where it holds, no float copy
        total = (values & mask).sum(dtype=torch.float32)
    else:
        total = torch.where(mask, upcast(values.detach()), 0.0).sum()
    return total / count.clamp_min(1), count


def metric_means(named: Mapping[str, tuple[Tensor, Tensor]], segments: Segments, per_sequence: bool = False) -> Metrics:
    """``(metrics, counts)``: metric ``name`` is the mean of ``values`` over ``mask`` for
    ``{name: (values [N], mask [N])}``; metrics over the same mask share one count."""
    metrics, counts = {}, {}
    seen: list[tuple[Tensor, Tensor]] = []  # (mask, count)
    for key, (values, mask) in named.items():
        count = None if per_sequence else next((c for m, c in seen if m is mask), None)
        metrics[key], counts[key] = masked_mean(values, mask, segments, per_sequence, count)
        seen.append((mask, counts[key]))
    return metrics, counts


def merge_metrics(parts: Iterable[object]) -> Metrics:
    """Merge scalar metrics of several results (``LossResult`` or ``(metrics, counts)`` pairs).

    A name missing from a part counts as zero members there. Returns ``(metrics, counts)``.
    """
    if hasattr(parts, "metrics") or isinstance(parts, dict | str) or not isinstance(parts, Iterable):
        raise TypeError(f"parts must be a list of LossResult or (metrics, counts) pairs, got {type(parts).__name__}")
    sums: dict[str, Tensor] = {}
    totals: dict[str, Tensor] = {}
    for part in parts:
        metrics, counts = (part.metrics, part.counts) if hasattr(part, "metrics") else part
        _check_metrics(metrics, counts)
        for key, value in metrics.items():
            count = counts[key]
            reduce = _extreme(key)
            if reduce is None:
                sums[key] = sums.get(key, 0) + value * count
            else:
                fill = torch.full_like(value, float("inf") if reduce is torch.minimum else float("-inf"))
                candidate = torch.where(count > 0, value, fill)
                sums[key] = reduce(sums[key], candidate) if key in sums else candidate
            totals[key] = totals.get(key, 0) + count
    merged = {}
    for key, total in totals.items():
        if _extreme(key) is None:
            merged[key] = sums[key] / total.clamp_min(1)
        else:
            merged[key] = torch.where(total > 0, sums[key], 0.0)
    return merged, totals


def _check_metrics(metrics: object, counts: object) -> None:
    if not isinstance(metrics, dict) or not isinstance(counts, dict):
        raise TypeError(
            f"metrics and counts must be dicts of tensors, got {type(metrics).__name__}, {type(counts).__name__}"
        )
    for key, value in metrics.items():
        if key not in counts:
            raise ValueError(f"counts has no entry for metric {key!r}")
        for kind, t in (("metrics", value), ("counts", counts[key])):
            if not isinstance(t, Tensor):
                raise TypeError(f"{kind}[{key!r}] must be a tensor, got {type(t).__name__}")
        if value.dim() != 0:
            raise ValueError(
                f"metric {key!r} is per-sequence (shape {tuple(value.shape)}); merge scalars only (a per-sequence "
                "metric belongs to its bin's sequences: compute the loss without per_sequence_metrics to merge)"
            )


def _extreme(key: str):
    if key.endswith("_min"):
        return torch.minimum
    if key.endswith("_max"):
        return torch.maximum
    return None


def all_reduce_metrics(
    metrics: dict[str, Tensor], counts: dict[str, Tensor], group=None, *, check: bool = True
) -> Metrics:
    """Token-weighted merge over the ranks of ``group`` with one ``all_reduce`` of a ``[2, K]`` tensor
    (plus one MIN and one MAX all-reduce when ``*_min`` / ``*_max`` metrics are present).

    Every rank must pass the same metric names (in any order), one number each (per-sequence metrics
    are refused). With ``check`` (the default) a 3-number agreement check runs first
    (:func:`~packloss.core.agreement.check_agreement`): ranks with different names, or a rank whose
    metrics fail their checks, raise the same ``ValueError`` on every rank instead of aborting, hanging
    or averaging different metrics.
    """
    with raised_on_every_rank("metric names", group, enabled=check):
        _check_metrics(metrics, counts)
        if not metrics:
            raise ValueError("metrics is empty: nothing to all-reduce")
    keys = sorted(metrics)
    device = metrics[keys[0]].device
    if check:
        check_agreement("metrics " + ",".join(keys), "metric names", device, group)
    packed = torch.stack(
        [torch.stack([metrics[k] * counts[k] for k in keys]), torch.stack([counts[k] for k in keys])]
    ).to(torch.float32)  # [2, K]
    dist.all_reduce(packed, group=group)
    merged = {k: packed[0, i] / packed[1, i].clamp_min(1) for i, k in enumerate(keys)}
    extremes = ((torch.minimum, dist.ReduceOp.MIN, float("inf")), (torch.maximum, dist.ReduceOp.MAX, float("-inf")))
    for reduce, op, fill in extremes:
        extreme_keys = [k for k in keys if _extreme(k) is reduce]
        if extreme_keys:
            values = torch.stack([torch.where(counts[k] > 0, metrics[k], fill) for k in extreme_keys]).to(torch.float32)
            dist.all_reduce(values, op=op, group=group)
            for i, k in enumerate(extreme_keys):
                merged[k] = torch.where(packed[1, keys.index(k)] > 0, values[i], 0.0)
    return merged, {k: packed[1, i] for i, k in enumerate(keys)}
