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

_EXACT_COUNT = 1 << 24  # float32 holds every integer below it: a float32 sum of fewer 0/1 values is exact


def _eager_cpu(flags: Tensor) -> bool:
    """Whether ``flags`` are read by eager CPU kernels, whose bool reductions and conversions are scalar
    code and their byte ones vectorised (Inductor's code is the other way round)."""
    return flags.device.type == "cpu" and not torch.compiler.is_compiling()


def _count(flags: Tensor) -> Tensor:
    """``flags.sum(dtype=float32)`` of bools, 0-d; eager on CPU below 2^24 flags, the same 0/1 values
    summed as bytes (~8× faster). The value is the same: every partial sum is an integer float32 holds."""
    if _eager_cpu(flags) and flags.numel() < _EXACT_COUNT:
        return flags.view(torch.uint8).sum(dtype=torch.float32)
    return flags.sum(dtype=torch.float32)


def _flags(flags: Tensor) -> Tensor:
    """``flags.to(float32)`` of bools (eager on CPU through their bytes: the same 0/1 values).  ``[N]``."""
    return (flags.view(torch.uint8) if _eager_cpu(flags) else flags).to(torch.float32)


def _members_only(values: Tensor, mask: Tensor) -> Tensor:
    """``values`` (detached, compute dtype; bools as 0/1 float32) with exact zeros off ``mask``,
    whatever they held.  ``[N]``."""
    if values.dtype == torch.bool:
        return _flags(values & mask)
    return upcast(values.detach()).masked_fill(~mask, 0.0)


def masked_mean(
    values: Tensor,
    mask: Tensor,
    segments: Segments | None = None,
    per_sequence: bool = False,
    count: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Sync-free mean of ``values [N]`` over ``mask [N]`` and its member count: scalars (this rank's
    tokens), or ``([S], [S])`` per sequence of ``segments`` (over the whole bin). Values off ``mask``
    never enter (inf/NaN safe); bools count as 0/1. ``count`` is the member count (``mask.sum()``,
    or ``segments.count(mask)`` per sequence) when the caller already has it."""
    if per_sequence:
        if segments is None:
            raise ValueError("per_sequence=True needs segments")
        if segments.sharded:  # one all_reduce carries the sum and the count
            return segments.mean(upcast(values.detach()), mask)
        # segments.mean's sums, divisor and dtypes, without re-counting a known count
        if count is None:
            count = segments.sum(_flags(mask))
        return segments.sum(_members_only(values, mask)) / count.clamp_min(1), count
    if count is None:
        count = _count(mask)
    if values.dtype == torch.bool:  # a fraction: count the members where it holds, no float copy
        total = _count(values & mask)
    else:
        total = _members_only(values, mask).sum()
    return total / count.clamp_min(1), count


def metric_means(named: Mapping[str, tuple[Tensor, Tensor]], segments: Segments, per_sequence: bool = False) -> Metrics:
    """``(metrics, counts)``: metric ``name`` is the mean of ``values`` over ``mask`` for
    ``{name: (values [N], mask [N])}``; metrics over the same mask share one count (per sequence too,
    unless the bin is sharded: there one ``all_reduce`` carries each metric's sum and count)."""
    metrics, counts = {}, {}
    seen: list[tuple[Tensor, Tensor]] = []  # (mask, count)
    share = not (per_sequence and segments.sharded)
    if not per_sequence:
        for mask, (keys, fractions) in _fraction_groups(named).items():
            count = _fraction_means(keys, fractions, mask, metrics)
            counts.update(dict.fromkeys(keys, count))
            seen.append((mask, count))
    for key, (values, mask) in named.items():
        if key in metrics:
            continue
        count = next((c for m, c in seen if m is mask), None) if share else None
        metrics[key], counts[key] = masked_mean(values, mask, segments, per_sequence, count)
        seen.append((mask, counts[key]))
    return {key: metrics[key] for key in named}, {key: counts[key] for key in named}


def _fraction_groups(named: Mapping[str, tuple[Tensor, Tensor]]) -> dict[Tensor, tuple[list[str], list[Tensor]]]:
    """The bool metrics that eager CPU kernels count together: ``{mask: (keys, values)}`` for each mask
    (by identity) that two or more of them share."""
    groups: dict[int, tuple[Tensor, list[str], list[Tensor]]] = {}
    for key, (values, mask) in named.items():
        if values.dtype == torch.bool and _eager_cpu(values) and values.shape == mask.shape and mask.dim() == 1:
            _, keys, fractions = groups.setdefault(id(mask), (mask, [], []))
            keys.append(key)
            fractions.append(values)
    return {mask: (keys, fractions) for mask, keys, fractions in groups.values() if len(keys) > 1}


def _fraction_means(keys: list[str], fractions: list[Tensor], mask: Tensor, metrics: dict[str, Tensor]) -> Tensor:
    """Each ``fractions[k]`` ``[N]`` bool counted over ``mask`` ``[N]`` and divided by the members' count,
    into ``metrics[keys[k]]``, as :func:`masked_mean` computes them (integer counts, exact in any order)
    from one ``[K + 1, N]`` byte sum; returns the count."""
    if mask.numel() >= _EXACT_COUNT:
        total = _count(mask)
        for key, values in zip(keys, fractions, strict=True):
            metrics[key] = _count(values & mask) / total.clamp_min(1)
        return total
    flags = torch.stack([*fractions, mask]) & mask  # [K + 1, N]
    sums = flags.view(torch.uint8).sum(dim=1, dtype=torch.float32)  # [K + 1]
    count = sums[-1]
    metrics.update(zip(keys, (sums[:-1] / count.clamp_min(1)).unbind(0), strict=True))
    return count


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
