"""Context-parallel shards: which positions of a packed bin one rank holds when the bin's tokens are
split across the ranks of a context-parallel (CP) group. A plan built with ``shard=`` holds the
shard's ``[N_r]`` streams and computes every per-sequence statistic over the whole bin
(``docs/design.md``, "Context-parallel bins")."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from packloss.core import checks
from packloss.core.layout import Layout, check_seq_lens
from packloss.core.segments import Segments

__all__ = ["ContextShard", "gradient_scale"]


def gradient_scale(averaged_over: object = None) -> float:
    """The factor by which each rank multiplies its loss before ``backward`` when DDP or FSDP2 average
    the gradients over ``averaged_over``: a process group, a ``DeviceMesh`` (all of its ranks: the
    flattened ``(dp, cp)`` mesh FSDP2 shards over) or None (the default group).

    With the step's denominators every rank's loss is its share of the step's loss, and the shares
    sum to it (a context-parallel rank's backward also carries the other ranks' gradient through the
    per-sequence sums it shares), so the step's gradient is the *sum* over ranks of their gradients:
    ``mean × world``. A host read of the group's size, no collective.
    """
    if hasattr(averaged_over, "mesh") and callable(getattr(averaged_over, "size", None)):
        return float(averaged_over.size())
    return float(dist.get_world_size(averaged_over))


def _rank_and_size(rank: object, size: object) -> tuple[int, int]:
    size = checks.integer("size", size, minimum=1)
    rank = checks.integer("rank", rank, minimum=0)
    if rank >= size:
        raise ValueError(f"rank must be in [0, size={size}), got {rank}")
    return rank, size


@dataclass(frozen=True, eq=False)
class ContextShard:
    """The positions of one packed bin that this rank holds, and the CP group holding the rest.

    ``seq_lens`` (host ints) is the whole bin's layout, the same on every rank of ``group``;
    ``positions`` (a host long tensor ``[N_r]``) the bin positions of this rank's tokens, in the
    order of its streams; ``group`` the CP process group (None: the default group). The shards of a
    group partition the bin's positions. Build one with :meth:`contiguous` (prime-rl's
    ``torch.chunk`` of the packed row, Ulysses), :meth:`zigzag` (ring attention: every sequence in
    ``2·size`` chunks, rank ``r`` holding chunks ``r`` and ``2·size − 1 − r``) or :meth:`of_positions`.
    """

    seq_lens: tuple[int, ...]
    positions: Tensor
    group: object = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_lens", check_seq_lens(self.seq_lens))
        p = self.positions
        if not isinstance(p, Tensor) or p.dtype != torch.long or p.dim() != 1 or p.device.type != "cpu":
            raise TypeError("positions must be a 1-d host (CPU) long tensor; build it with ContextShard.of_positions")

    @property
    def num_tokens(self) -> int:
        """``N_r``, the tokens this rank holds."""
        return self.positions.numel()

    def layout(self, device: torch.device | str = "cpu") -> Layout:
        """The shard's :class:`~packloss.core.layout.Layout`: the bin's ``S`` sequences, this rank's
        ``seq_ids [N_r]`` and ``owned [S]`` (the sequences whose first position it holds), built on
        the host and copied to ``device``."""
        whole = Layout.build(self.seq_lens)  # host
        seq_ids = whole.seq_ids.index_select(0, self.positions)  # [N_r]
        firsts = whole.cu_seqlens[:-1].to(torch.long)  # [S]
        owned = torch.zeros(sum(self.seq_lens) + 1, dtype=torch.bool).index_fill(0, self.positions, True)[firsts]
        seq_ids, owned = seq_ids.to(device), owned.to(device)
        segments = Segments(seq_ids, whole.num_seqs, sharded=True, group=self.group, owned=owned)
        return Layout(whole.seq_lens, whole.cu_seqlens.to(device), seq_ids, whole.num_seqs, self.num_tokens, segments)

    @classmethod
    def of_positions(
        cls, seq_lens: Sequence[int], positions: Sequence[int] | Tensor, group: object = None
    ) -> ContextShard:
        """The shard holding ``positions`` (distinct host ints in ``[0, N)``, any order)."""
        lens = check_seq_lens(seq_lens)
        if isinstance(positions, Tensor):
            if positions.device.type != "cpu" or positions.dtype not in (torch.int32, torch.int64):
                raise TypeError("positions must be host ints or a CPU integer tensor")
            p = positions.to(torch.long).reshape(-1)
        else:
            p = torch.tensor(list(positions), dtype=torch.long)
        n = sum(lens)
        if p.numel() and (int(p.min()) < 0 or int(p.max()) >= n):  # host tensor: no device read
            raise ValueError(f"positions must lie in [0, N={n}), got values in [{int(p.min())}, {int(p.max())}]")
        if p.unique().numel() != p.numel():
            raise ValueError("positions holds a position twice")
        return cls(lens, p, group)

    @classmethod
    def contiguous(cls, seq_lens: Sequence[int], rank: int, size: int, group: object = None) -> ContextShard:
        """Rank ``rank`` of ``size`` holds the ``rank``-th of ``torch.chunk(row, size)`` of the packed row
        (chunks of ``⌈N / size⌉`` positions; the last ranks may hold fewer, or none)."""
        lens = check_seq_lens(seq_lens)
        rank, size = _rank_and_size(rank, size)
        n = sum(lens)
        chunk = -(-n // size)
        return cls(lens, torch.arange(min(rank * chunk, n), min((rank + 1) * chunk, n)), group)

    @classmethod
    def zigzag(cls, seq_lens: Sequence[int], rank: int, size: int, group: object = None) -> ContextShard:
        """Every sequence of length ``L`` cut at ``⌊j·L / (2·size)⌋`` into ``2·size`` chunks (short ones
        may be empty); rank ``r`` holds chunks ``r`` and ``2·size − 1 − r`` of every sequence, in bin order."""
        lens = check_seq_lens(seq_lens)
        rank, size = _rank_and_size(rank, size)
        parts = 2 * size
        lengths = torch.tensor(lens, dtype=torch.long)  # [S]
        starts = torch.tensor((0, *itertools.accumulate(lens[:-1])), dtype=torch.long)  # [S]
        j = torch.tensor([rank, parts - 1 - rank])  # [2], the chunks this rank holds
        lo = (starts[:, None] + j * lengths[:, None] // parts).reshape(-1)  # [2S], per sequence its two chunks
        hi = (starts[:, None] + (j + 1) * lengths[:, None] // parts).reshape(-1)
        counts = hi - lo
        total = int(counts.sum())
        offsets = torch.repeat_interleave(lo - torch.cumsum(counts, 0) + counts, counts, output_size=total)
        return cls(lens, torch.arange(total) + offsets, group)
