"""The sequence layout of a packed bin, and packing/unpacking of padded ``[B, T]`` tensors.

A bin is one row of ``N`` tokens holding ``S`` sequences back to back. ``seq_lens`` (host ints)
gives the layout, from which ``cu_seqlens [S+1]`` and ``seq_ids [N]`` are built once on the host and
copied to the device (a host→device copy, never a device→host sync).
"""

from __future__ import annotations

import array
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from packloss.core.segments import Segments

__all__ = ["Layout", "PaddedLayout", "check_seq_lens"]


def check_seq_lens(seq_lens: Sequence[int], num_tokens: int | None = None, name: str = "seq_lens") -> tuple[int, ...]:
    """``seq_lens`` as a tuple of positive host ints (summing to ``num_tokens`` when given)."""
    if isinstance(seq_lens, Tensor):
        raise TypeError(f"{name} must be host-side Python ints (a list or tuple), not a tensor")
    if seq_lens is None or isinstance(seq_lens, str | bytes) or not isinstance(seq_lens, Sequence):
        raise TypeError(f"{name} must be a list or tuple of ints, got {type(seq_lens).__name__}")
    lens = tuple(seq_lens)
    if not lens:
        raise ValueError(f"{name} is empty: a bin holds at least one sequence")
    if set(map(type, lens)) != {int} or min(lens) <= 0:  # C-level scan; the loop finds the culprit
        for n in lens:
            if isinstance(n, bool) or not isinstance(n, int):
                raise TypeError(f"{name} must hold Python ints, got {type(n).__name__}")
            if n <= 0:
                raise ValueError(f"{name} must hold positive lengths, got {n} in {list(lens)}")
    if num_tokens is not None and sum(lens) != num_tokens:
        raise ValueError(f"{name} sums to {sum(lens)} but the streams hold N={num_tokens} tokens")
    return lens


def _host_ints(values: Sequence[int], dtype: torch.dtype) -> Tensor:
    """Non-empty host ints as a CPU ``[len(values)]`` tensor, through one C-level buffer copy
    (``torch.tensor`` converts each Python int on its own: 44 vs 7 µs for 256 ints); under
    ``torch.compile`` through ``torch.tensor``, which it traces (``array`` would break the graph)."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=dtype)
    return torch.frombuffer(array.array(_TYPECODES[dtype], values), dtype=dtype)


_TYPECODES = {torch.int32: "i", torch.int64: "q"}


@dataclass(frozen=True, eq=False)
class Layout:
    """``seq_lens`` (host ints) and the device tensors derived from them.

    ``cu_seqlens [S+1]`` int32 offsets, ``seq_ids [N]`` long (the sequence of every token),
    ``num_seqs`` (= S, a plain int so that ``torch.compile`` can treat it as dynamic), ``num_tokens``,
    ``segments`` (its per-sequence reductions). A context-parallel shard's layout
    (:meth:`ContextShard.layout <packloss.ContextShard.layout>`) has the whole bin's ``seq_lens``,
    ``cu_seqlens`` and ``S``, and ``seq_ids`` / ``num_tokens`` of this rank's ``N_r`` tokens.
    """

    seq_lens: tuple[int, ...]
    cu_seqlens: Tensor
    seq_ids: Tensor
    num_seqs: int
    num_tokens: int
    segments: Segments

    @property
    def sharded(self) -> bool:
        """Whether the bin's other tokens live on other context-parallel ranks."""
        return self.segments.sharded

    @classmethod
    def build(cls, seq_lens: Sequence[int], device: torch.device | str = "cpu") -> Layout:
        lens = check_seq_lens(seq_lens)
        n = sum(lens)
        cu = _host_ints((0, *itertools.accumulate(lens)), torch.int32)  # [S+1]
        seq_ids = torch.repeat_interleave(torch.arange(len(lens)), _host_ints(lens, torch.int64), output_size=n)  # [N]
        seq_ids = seq_ids.to(device)
        return cls(lens, cu.to(device), seq_ids, len(lens), n, Segments(seq_ids, len(lens)))

    def _whole(self, what: str) -> None:
        if self.sharded:
            raise ValueError(f"{what} needs the whole bin; this layout is one context-parallel shard of it")

    def broadcast_ints(self, per_seq: Sequence[int], device: torch.device | str) -> Tensor:
        """``[N]`` long: the host ints ``per_seq`` (one per sequence) spread to their tokens."""
        if self.sharded:
            values = torch.tensor(list(per_seq), dtype=torch.long).to(self.seq_ids.device)  # [S]
            return values.index_select(0, self.seq_ids)
        values = torch.tensor(list(per_seq), dtype=torch.long)  # [S]; any Python int (checked by torch)
        lens = _host_ints(self.seq_lens, torch.int64)  # [S]
        return torch.repeat_interleave(values, lens, output_size=self.num_tokens).to(device)

    def to_padded(self, stream: Tensor, pad_value: float = 0.0) -> tuple[Tensor, Tensor]:
        """Unpack a ``[N, ...]`` stream to ``([S, T_max, ...] right-padded, attention_mask [S, T_max])``."""
        self._whole("to_padded")
        if stream.dim() < 1 or stream.shape[0] != self.num_tokens:
            raise ValueError(f"stream must have shape [N, ...] with N={self.num_tokens}, got {tuple(stream.shape)}")
        t_max = max(self.seq_lens)
        device = stream.device
        seq_ids = self.seq_ids.to(device)
        pos = torch.arange(self.num_tokens, device=device) - self.cu_seqlens.to(device)[seq_ids]  # [N]
        flat = seq_ids * t_max + pos  # [N]
        rest = tuple(stream.shape[1:])
        padded = torch.full((self.num_seqs * t_max, *rest), pad_value, dtype=stream.dtype, device=device)
        padded = padded.index_put((flat,), stream)
        attention = torch.zeros(self.num_seqs * t_max, dtype=torch.bool, device=device).index_fill(0, flat, True)
        return padded.view(self.num_seqs, t_max, *rest), attention.view(self.num_seqs, t_max)


@dataclass(frozen=True, eq=False)
class PaddedLayout:
    """How the attended positions of a padded ``[B, T]`` batch (the TRL/verl layout) pack into a bin.

    Row ``b`` becomes sequence ``b`` with its attended tokens in order (left, right or any padding).
    :meth:`pack` turns any ``[B, T, ...]`` tensor into ``[N, ...]`` (autograd flows through),
    :meth:`unpack` the other way. :meth:`whole_rows` is the layout of every position (``N = B·T``),
    whose :meth:`pack` is a reshape.
    """

    seq_lens: tuple[int, ...]
    index: Tensor  # [N] long, flat positions in [0, B·T)
    batch_shape: tuple[int, int]

    @classmethod
    def from_attention_mask(cls, attention_mask: Tensor, seq_lens: Sequence[int] | None = None) -> PaddedLayout:
        """The layout of ``attention_mask [B, T]``. Reading the row lengths is one device→host sync
        unless ``seq_lens`` (host ints, one per row) is given; given, they are checked against the
        mask only by :meth:`validate`."""
        if not isinstance(attention_mask, Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be [B, T], got shape {tuple(attention_mask.shape)}")
        attended = attention_mask.bool()
        b, t = attended.shape
        if seq_lens is None:
            seq_lens = attended.sum(1).tolist()  # sync-ok: one documented read of the row lengths
        lens = check_seq_lens(seq_lens)
        if len(lens) != b:
            raise ValueError(f"seq_lens holds {len(lens)} lengths for B={b} rows of attention_mask")
        return cls(lens, _attended_first(attended.reshape(-1))[: sum(lens)], (b, t))

    @classmethod
    def whole_rows(cls, batch_shape: tuple[int, int], device: torch.device | str = "cpu") -> PaddedLayout:
        """The layout of every position of a ``[B, T]`` batch: row ``b`` is sequence ``b`` of length
        ``T``; nothing is read, and :meth:`pack` is a reshape (a view of a contiguous input)."""
        b, t = batch_shape
        if not (isinstance(b, int) and isinstance(t, int) and b > 0 and t > 0):
            raise ValueError(f"batch_shape must be two positive ints (B, T), got {batch_shape!r}")
        return _WholeRows((t,) * b, (b, t), torch.device(device))

    def validate(self, attention_mask: Tensor) -> PaddedLayout:
        """Check (one sync) that the given ``seq_lens`` are the mask's row lengths."""
        rows = attention_mask.bool().sum(1).tolist()  # sync-ok: opt-in check
        if list(self.seq_lens) != rows:
            raise ValueError(f"seq_lens {list(self.seq_lens)} disagree with attention_mask's row lengths {rows}")
        return self

    def _check_batch(self, x: Tensor, name: str) -> None:
        b, t = self.batch_shape
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape[:2]) != (b, t):
            raise ValueError(f"{name} must have shape [B, T, ...] = ({b}, {t}, ...), got {tuple(x.shape)}")

    def pack(self, x: Tensor, name: str = "stream") -> Tensor:
        """``[B, T, ...]`` → ``[N, ...]`` (the attended positions, row by row)."""
        self._check_batch(x, name)
        b, t = self.batch_shape
        return x.reshape(b * t, *x.shape[2:]).index_select(0, self.index.to(x.device))

    def unpack(self, x: Tensor, pad_value: float = 0.0) -> Tensor:
        """``[N, ...]`` → ``[B, T, ...]`` with ``pad_value`` at the padding."""
        n = sum(self.seq_lens)
        if x.dim() == 0 or x.shape[0] != n:
            raise ValueError(f"x must be [N, ...] with N={n} (this layout's tokens), got {list(x.shape)}")
        b, t = self.batch_shape
        out = torch.full((b * t, *x.shape[1:]), pad_value, dtype=x.dtype, device=x.device)
        return out.index_put((self.index.to(x.device),), x).view(b, t, *x.shape[1:])


class _WholeRows(PaddedLayout):
    """:meth:`PaddedLayout.whole_rows`: ``index`` is every position in order (built only when read),
    so :meth:`pack` reshapes instead of gathering, forward and backward."""

    def __init__(self, seq_lens: tuple[int, ...], batch_shape: tuple[int, int], device: torch.device) -> None:
        object.__setattr__(self, "seq_lens", seq_lens)
        object.__setattr__(self, "batch_shape", batch_shape)
        object.__setattr__(self, "_device", device)

    @functools.cached_property
    def index(self) -> Tensor:  # type: ignore[override]  # [B·T] long
        b, t = self.batch_shape
        return torch.arange(b * t, device=self._device)

    def pack(self, x: Tensor, name: str = "stream") -> Tensor:
        self._check_batch(x, name)
        b, t = self.batch_shape
        return x.reshape(b * t, *x.shape[2:])


def _attended_first(attended: Tensor) -> Tensor:
    """The permutation of ``[M]`` positions that puts the ``attended`` ones (``[M]`` bool) first and
    keeps each group in order: the stable ``argsort`` of ``¬attended``, built in linear time. An
    attended position goes to its rank among the attended, any other to the attended count plus its
    rank among the others; scattering the positions there inverts that map.  ``[M]`` long."""
    position = torch.arange(attended.numel(), device=attended.device)  # [M]
    before = attended.cumsum(0)  # [M]: attended positions up to and including each one
    destination = torch.where(attended, before - 1, before[-1] + position - before)  # a permutation of [M]
    return torch.empty_like(position).scatter_(0, destination, position)
