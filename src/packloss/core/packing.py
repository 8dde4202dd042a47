"""Packing variable-length sequences into bins of a token budget, and the per-sequence attention layout.

* :func:`pack_ffd` — first-fit-decreasing: sequence indices grouped into bins of at most ``budget``
  tokens (deterministic: ties keep input order).
* :func:`shard_bins` — deal a step's bins round-robin to data-parallel ranks and pad every rank to
  the same number of micro-batches with ``None`` (an *empty bin*), so every rank runs forward and
  backward the same number of times (DDP/FSDP collectives stay matched).
* :func:`position_ids` / :func:`block_causal_mask` — the layout of one packed bin: positions that
  restart at 0 for every sequence (Hugging Face models detect packing from them when no attention
  mask is given), or an explicit ``[N, N]`` block-diagonal causal mask for models that need one.

Everything here is host-side bookkeeping on Python ints; the tensors are built on the host and
copied to ``device`` (never a device→host sync).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["pack_ffd", "shard_bins", "position_ids", "block_causal_mask"]


def pack_ffd(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing packing of sequences into bins of at most ``budget`` tokens.

    Args:
        lengths: ``[M]`` positive host ints, the length of each sequence.
        budget: the token budget of a bin (``≥ max(lengths)``).

    Returns:
        Bins as lists of sequence indices into ``lengths``; within a bin, indices are in the order
        they were placed (longest first). Every index appears exactly once.
    """
    if budget <= 0:
        raise ValueError(f"budget must be positive, got {budget}")
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"lengths must be positive ints, got {n!r} at index {i}")
        if n > budget:
            raise ValueError(f"sequence {i} has {n} tokens, more than the bin budget {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        slot = next((b for b, room in enumerate(free) if room >= lengths[i]), None)
        if slot is None:
            bins.append([i])
            free.append(budget - lengths[i])
        else:
            bins[slot].append(i)
            free[slot] -= lengths[i]
    return bins


def shard_bins(num_bins: int, world_size: int) -> list[list[int | None]]:
    """Deal bins ``0 … num_bins−1`` round-robin to ``world_size`` ranks, padded with ``None``.

    Returns ``[world_size]`` lists of equal length ``ceil(num_bins / world_size)`` (at least 1): rank
    ``r`` gets bins ``r, r + W, …`` and then ``None`` (an empty bin to run so that its backward count
    matches the other ranks').
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if num_bins < 0:
        raise ValueError(f"num_bins must be >= 0, got {num_bins}")
    per_rank = max(1, -(-num_bins // world_size))
    shards: list[list[int | None]] = []
    for rank in range(world_size):
        own: list[int | None] = list(range(rank, num_bins, world_size))
        shards.append(own + [None] * (per_rank - len(own)))
    return shards


def position_ids(seq_lens: Sequence[int], device: torch.device | str = "cpu") -> Tensor:
    """``[N]`` long positions that restart at 0 at every sequence: ``[0..n_0−1, 0..n_1−1, …]``."""
    return torch.cat([torch.arange(n) for n in seq_lens]).to(device)


def block_causal_mask(seq_lens: Sequence[int], device: torch.device | str = "cpu") -> Tensor:
    """``[N, N]`` bool, ``True`` where query ``i`` may attend key ``j``: same sequence and ``j ≤ i``."""
    seq_ids = torch.cat([torch.full((n,), s) for s, n in enumerate(seq_lens)])  # [N]
    pos = torch.arange(len(seq_ids))
    same = seq_ids[:, None] == seq_ids[None, :]  # [N, N]
    causal = pos[:, None] >= pos[None, :]
    return (same & causal).to(device)
