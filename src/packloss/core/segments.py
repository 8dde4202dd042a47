"""Sync-free segment reductions over the sequences of a packed bin.

A packed bin of ``N`` tokens holds ``S`` sequences; ``seq_ids`` (``[N]``, long) names the sequence of
each token. ``S`` is known on the host (it comes from ``seq_lens``), so every output shape is known
without reading the device: these functions never synchronise, and their number of tensor
operations does not depend on ``S``. :class:`Segments` does the same over a bin split across
context-parallel ranks (``docs/design.md``, "Context-parallel bins").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Segments", "segment_sum", "segment_count", "segment_mean", "segment_max", "segment_min", "broadcast"]


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


class _SumAcross(torch.autograd.Function):
    """``all_reduce`` (sum) over ``group``; its backward is the all-reduced gradient, since every rank's
    loss reads the sum."""

    @staticmethod
    def forward(ctx, x: Tensor, group: object) -> Tensor:  # noqa: ANN001
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


@dataclass(frozen=True, eq=False)
class Segments:
    """The sequences of a bin, or of a context-parallel shard of one, for per-sequence reductions.

    ``seq_ids [N]`` (long) names the sequence of each token this rank holds, ``num_seqs`` the bin's
    ``S``. With ``sharded`` the bin's other tokens live on the ranks of ``group`` (the context-parallel
    group; None: the default group): every reduction is this rank's partial ``[S]`` result combined
    by one ``all_reduce`` over ``group`` (differentiable for :meth:`sum` and :meth:`mean`: its backward
    is one more). ``owned [S]`` bool (or None: all) marks the sequences whose per-sequence values this
    rank reports in scalar metrics, so that a metric over sequences counts each once over the group.
    ``known`` is ``(mask, count [S])``, the whole bin's member counts of one mask already reduced:
    :meth:`count` and :meth:`mean` over that very mask reuse them (one collective fewer).
    """

    seq_ids: Tensor
    num_seqs: int
    sharded: bool = False
    group: object = None
    owned: Tensor | None = None
    known: tuple[Tensor, Tensor] | None = None

    def _known_count(self, mask: Tensor) -> Tensor | None:
        return self.known[1] if self.known is not None and mask is self.known[0] else None

    def across(self, partial: Tensor) -> Tensor:
        """This rank's additive ``partial`` summed over the ranks holding the bin (itself unless
        sharded), differentiable."""
        if not self.sharded:
            return partial
        if partial.requires_grad:
            return _SumAcross.apply(partial, self.group)
        out = partial.clone()
        dist.all_reduce(out, group=self.group)
        return out

    def sum(self, x: Tensor) -> Tensor:
        """``out[s] = Σ_{t∈s} x[t]`` over the whole bin.  ``x [N, ...]`` → ``[S, ...]``, differentiable."""
        return self.across(segment_sum(x, self.seq_ids, self.num_seqs))

    def count(self, mask: Tensor) -> Tensor:
        """Members per sequence over the whole bin, float32.  ``mask [N]`` bool → ``[S]``."""
        known = self._known_count(mask)
        if known is not None:
            return known
        return self.across(segment_count(mask, self.seq_ids, self.num_seqs))

    def mean(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``(mean [S], count [S])`` over the members of the whole bin, as :func:`segment_mean` (one
        ``all_reduce`` of both when sharded)."""
        if not self.sharded:
            return segment_mean(x, mask, self.seq_ids, self.num_seqs)
        known = self._known_count(mask)
        if known is not None:
            return self.sum(torch.where(mask, x, torch.zeros_like(x))) / known.clamp_min(1), known
        both = torch.stack([torch.where(mask, x, torch.zeros_like(x)), mask.to(x.dtype)], dim=1)  # [N, 2]
        total, count = self.sum(both).unbind(1)  # [S] each
        return total / count.clamp_min(1), count.detach().to(torch.float32)

    def max(self, x: Tensor, mask: Tensor) -> Tensor:
        """:func:`segment_max` over the whole bin (detached when sharded).  ``[N]`` → ``[S]``."""
        local = segment_max(x, mask, self.seq_ids, self.num_seqs)
        if not self.sharded:
            return local
        out = local.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out

    def broadcast(self, values: Tensor) -> Tensor:
        """Per-sequence values spread to this rank's tokens.  ``[S]`` → ``[N]``."""
        return broadcast(values, self.seq_ids)

    def reported(self, has_members: Tensor) -> Tensor:
        """``has_members [S]`` restricted to the sequences this rank reports (:attr:`owned`)."""
        return has_members if self.owned is None else has_members & self.owned
