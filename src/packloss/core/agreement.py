"""Checking that every rank of a process group describes the same thing before a collective whose
shape depends on it (the metric names of a step, the components and modes of its denominators).

Ranks that disagree would otherwise abort (gloo's size check), hang, or silently combine different
quantities. :func:`check_agreement` all-reduces a fixed-size ``[2]`` fingerprint — the CRC-32 of a
canonical description — with ``MAX`` (``[fp, −fp]`` gives the maximum and the minimum over ranks in one
call) and raises the same ``ValueError`` on every rank when they differ. It reads the two numbers on
the host: one small sync, once per step, outside the loss's forward and backward.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

__all__ = ["check_agreement"]


def check_agreement(description: str, what: str, device: torch.device | str, group: object | None = None) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all ranks pass the same ``description``."""
    fingerprint = zlib.crc32(description.encode())
    both = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, neg_low = both.tolist()  # sync-ok: one read of a [2] tensor, once per step
    if high != -neg_low:
        raise ValueError(
            f"{what} differ across ranks (fingerprints {-neg_low:#010x}..{high:#010x}); this rank has {description}"
        )
