"""Checking that every rank of a process group describes the same thing before a collective whose
shape depends on it (the metric names of a step, the components and modes of its denominators).

Ranks that disagree would otherwise abort (gloo's size check), hang, or silently combine different
quantities. :func:`check_agreement` all-reduces a fixed-size ``[3]`` tensor with ``MAX``: the CRC-32
fingerprint of a canonical description as ``[fp, −fp]`` (the maximum and the minimum over ranks in one
call) and whether the rank's own checks failed. It raises the same ``ValueError`` on every rank when
they differ or any failed. It reads the three numbers on the host: one small sync, once per step,
outside the loss's forward and backward.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = ["check_agreement", "collective_device", "raised_on_every_rank"]


def collective_device(group: object | None = None, device: torch.device | str | None = None) -> torch.device:
    """Where a collective's tensor lives: ``device`` if given, else the current CUDA device under NCCL,
    else the CPU."""
    if device is not None:
        return torch.device(device)
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_agreement(
    description: str,
    what: str,
    device: torch.device | str,
    group: object | None = None,
    problem: Exception | None = None,
) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all ranks pass the same ``description``
    and none passes a ``problem`` (an error its own checks found). A problem travels as a flag in the
    same all-reduce; only when some rank has one do the ranks gather the messages, so every rank raises
    the same error naming each failing rank, and none is left waiting in a later collective."""
    fingerprint = zlib.crc32(description.encode())
    flags = torch.tensor([fingerprint, -fingerprint, problem is not None], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    high, neg_low, failed = flags.tolist()  # sync-ok: one read of a [3] tensor, once per step
    if failed:
        mine = None if problem is None else f"{type(problem).__name__}: {problem}"
        messages: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(messages, mine, group=group)
        failures = "; ".join(f"rank {rank}: {m}" for rank, m in enumerate(messages) if m is not None)
        raise ValueError(f"{what}: a rank's checks failed, so no rank goes on ({failures})") from problem
    if high != -neg_low:
        raise ValueError(
            f"{what} differ across ranks (fingerprints {-neg_low:#010x}..{high:#010x}); this rank has {description}"
        )


@contextlib.contextmanager
def raised_on_every_rank(
    what: str, group: object | None = None, device: torch.device | str | None = None, enabled: bool = True
) -> Iterator[None]:
    """Run a rank's own checks; a ``TypeError`` / ``ValueError`` they raise reaches every rank of
    ``group`` through :func:`check_agreement` (when ``enabled`` and a process group exists), so no rank
    waits in the collective the others are about to join."""
    try:
        yield
    except (TypeError, ValueError) as error:
        if enabled and dist.is_initialized():
            check_agreement("", what, collective_device(group, device), group, problem=error)
        raise
