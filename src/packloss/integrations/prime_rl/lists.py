"""Reading prime-rl's lists of per-sequence tensors as one packed bin.

The trainer's list (``trainer_logprobs``, with grad) is read as the row it was split from when it is
one: consecutive contiguous views of one row, outputs of one autograd node whose gradient reaches that
row. Then the bin's backward has one edge instead of one per sequence. Every other list is
``torch.cat``'d in one call. Only public tensor and autograd-graph attributes are read.
"""

from __future__ import annotations

import itertools
import operator

import torch
from torch import Tensor

__all__ = ["packed_lists", "packed_trainer", "concatenate"]

_GRAD_FN = operator.attrgetter("grad_fn")
_OUTPUT_NR = operator.attrgetter("output_nr")
_VIEW_CHAIN_DEPTH = 8  # autograd nodes between a split's input and its view root (squeeze, select, view…)


def concatenate(name: str, seqs: list[Tensor], seq_lens: tuple[int, ...]) -> Tensor:
    """``torch.cat(seqs)``, every element checked to be ``[n_i]`` at C speed (``numel`` per element and
    a 1-D result); only a failing list is walked in Python, to name the element that is wrong."""
    if not isinstance(seqs, list | tuple):
        raise TypeError(f"{name} must be a list of per-sequence tensors, got {type(seqs).__name__}")
    if len(seqs) != len(seq_lens):
        raise ValueError(f"{name} holds {len(seqs)} sequences, trainer_logprobs {len(seq_lens)}")
    try:
        out = torch.cat(seqs)
        if out.dim() == 1 and tuple(map(Tensor.numel, seqs)) == seq_lens:
            return out
    except (TypeError, RuntimeError):  # the walk below names the element
        pass
    for i, (t, n) in enumerate(zip(seqs, seq_lens, strict=True)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != (n,):
            raise ValueError(f"{name}[{i}] must have shape ({n},), got {tuple(t.shape)}")
    return torch.cat(list(seqs))  # elements well formed: any error left is torch's (devices, dtypes)


def _reaches(node: object, root: Tensor) -> bool:
    """Whether the gradient of ``node``'s input flows into ``root``: following first edges, the walk
    meets ``root``'s own node (or, for a leaf, the node that accumulates into it) within a few steps.
    A leaf made from a view (``row[:].requires_grad_()`` under ``no_grad``) keeps its own gradient."""
    target = root.grad_fn
    for _ in range(_VIEW_CHAIN_DEPTH):
        node = node.next_functions[0][0] if node.next_functions else None
        if node is None:
            return False
        if target is not None and node is target:
            return True
        if target is None and getattr(node, "variable", None) is root:
            return True
    return False


def _split_row(seqs: list[Tensor] | tuple[Tensor, ...], seq_lens: tuple[int, ...]) -> Tensor | None:
    """The row ``seqs`` were split from, as a narrow of its view root (the root itself, flattened,
    when they cover all of it); None when they are anything else.

    Two C-level ``map``s over the list, no Python frame per element: one autograd node for every
    element, at output ``i``; the first and last contiguous, where a split of consecutive rows puts
    them. Views that autograd tracks cannot be modified in place, so they still hold the root's data.
    """
    first = seqs[0]
    node, root = first.grad_fn, first._base
    if node is None or root is None or root.dtype != first.dtype or not root.is_contiguous():
        return None
    if not all(map(operator.is_, map(_GRAD_FN, seqs), itertools.repeat(node))):
        return None
    if list(map(_OUTPUT_NR, seqs)) != list(range(len(seqs))):
        return None
    # outputs of one view node share their strides: contiguous first and last, at the offsets a split
    # of consecutive rows puts them, leave no room for a gap between them
    start, total = first.storage_offset() - root.storage_offset(), sum(seq_lens)
    last = seqs[-1]
    if first.stride() != (1,) or last.stride() != (1,) or start < 0 or start + total > root.numel():
        return None
    if last.storage_offset() - root.storage_offset() != start + total - seq_lens[-1]:
        return None
    if not _reaches(node, root):
        return None
    flat = root if root.dim() == 1 else root.view(-1)  # contiguous (checked above)
    if start == 0 and total == flat.numel():  # the whole row: no slice, whose backward zero-fills a copy
        return flat
    return flat.narrow(0, start, total)


def packed_trainer(seqs: list[Tensor] | tuple[Tensor, ...]) -> tuple[Tensor, tuple[int, ...]]:
    """``trainer_logprobs`` as one ``[N]`` tensor, and the sequence lengths (one C-level ``numel`` per
    element); the row it was split from when it is one (:func:`_split_row`), else a ``cat``."""
    if not isinstance(seqs, list | tuple) or not seqs:
        raise ValueError("trainer_logprobs must be a non-empty list of per-sequence tensors")
    try:
        seq_lens = tuple(map(Tensor.numel, seqs))
    except TypeError:
        i, t = next((i, t) for i, t in enumerate(seqs) if not isinstance(t, Tensor))
        raise TypeError(f"trainer_logprobs[{i}] must be a torch.Tensor, got {type(t).__name__}") from None
    if seqs[0].requires_grad and all(s.dim() == 1 for s in (seqs[0], seqs[-1])):
        row = _split_row(seqs, seq_lens)
        if row is not None:
            return row, seq_lens
    return concatenate("trainer_logprobs", seqs, seq_lens), seq_lens


def packed_lists(
    trainer_logprobs: list[Tensor], lists: dict[str, list[Tensor] | None]
) -> tuple[dict[str, Tensor | None], tuple[int, ...]]:
    """``({name: [N] tensor or None}, seq_lens)`` of prime-rl's list arguments."""
    trainer, seq_lens = packed_trainer(trainer_logprobs)
    streams: dict[str, Tensor | None] = {"trainer_logprobs": trainer}
    for name, seqs in lists.items():
        streams[name] = None if seqs is None else concatenate(name, seqs, seq_lens)
    return streams, seq_lens
