"""The one padded ``[B, T]`` call path of the trainer adapters: check the peer's streams, pack the
rows as sequences (row ``b`` → sequence ``b``), build the plan and the outputs, and compute the loss."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from packloss.core import checks
from packloss.core.bin import Component, Plan
from packloss.core.dtypes import upcast
from packloss.core.layout import PaddedLayout
from packloss.core.metrics import masked_mean
from packloss.core.outputs import Outputs

__all__ = ["PACKINGS", "check_padded", "PaddedBatch", "log_ratio_mean"]

PACKINGS = ("rows", "members")
Packing = Literal["rows", "members"]


def check_padded(streams: Mapping[str, object], shape: tuple[int, ...], owner: str = "") -> None:
    """Raise unless every given stream is a floating-point tensor of ``shape`` (``[B, T]``); errors
    name the stream as ``{owner}{name}``."""
    for name, value in streams.items():
        if value is None:
            continue
        value = checks.tensor(f"{owner}{name}", value, floating=True)
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{owner}{name} must have shape [B, T] = {list(shape)}, got {list(value.shape)}")


@dataclass(frozen=True, eq=False)
class PaddedBatch:
    """A padded ``[B, T]`` batch as one packed bin, every row a sequence: ``layout`` packs ``[B, T,
    ...]`` tensors into ``[N, ...]``; ``members`` ``[N]`` bool are the loss's tokens."""

    layout: PaddedLayout
    members: Tensor

    @classmethod
    def of(cls, members: Tensor, packing: Packing = "rows", positions: Tensor | None = None) -> PaddedBatch:
        """The bin of ``members`` (``[B, T]`` bool). ``packing="rows"``: every position (``N = B·T``;
        the layout follows from the shape, nothing is read on the host, and packing a contiguous
        ``[B, T, ...]`` tensor is a view of it). ``"members"``: each row's
        ``positions`` (``[B, T]`` bool, default the members), and the first position of a row without
        any (so it stays a sequence, as a non-member); reading the row lengths is one device→host read."""
        checks.choice("packing", packing, PACKINGS)
        checks.tensor("members", members, boolean=True)
        if members.dim() != 2 or 0 in members.shape:
            raise ValueError(f"members must be a non-empty [B, T] tensor, got {list(members.shape)}")
        b, t = members.shape
        if packing == "rows":
            layout = PaddedLayout.whole_rows((b, t), members.device)
        else:
            kept = members if positions is None else checks.tensor("positions", positions, shape=(b, t)).bool()
            first = torch.arange(t, device=members.device) == 0  # [T]
            layout = PaddedLayout.from_attention_mask(kept | (first & ~kept.any(dim=1, keepdim=True)))
        return cls(layout, layout.pack(members, "members"))

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return self.layout.seq_lens

    @property
    def rows(self) -> int:
        return self.layout.batch_shape[0]

    def pack(self, x: Tensor | None, name: str) -> Tensor | None:
        """``[B, T, ...]`` → ``[N, ...]`` (None stays None); autograd flows through."""
        return None if x is None else self.layout.pack(x, name)

    def plan(self, components: Mapping[str, Component], **streams: Tensor | None) -> Plan:
        """The bin's :class:`~packloss.Plan` with each given ``[B, T]`` pre-forward stream (``Plan``'s
        field names) packed and detached."""
        packed = {k: self.pack(None if v is None else v.detach(), k) for k, v in streams.items()}
        return Plan(self.seq_lens, components, **packed)

    def outputs(self, **outputs: Tensor | None) -> Outputs:
        """The bin's :class:`~packloss.Outputs` with each given ``[B, T]`` output packed."""
        return Outputs(**{k: self.pack(v, k) for k, v in outputs.items()})


def log_ratio_mean(m: Tensor, numerator: Tensor, denominator: Tensor, count: Tensor | None = None) -> Tensor:
    """The mean of ``numerator − denominator`` over the members ``m`` (detached, at least float32;
    verl's and OpenRLHF's ``ppo_kl``); ``count`` is ``m.sum()`` (float32) when the caller has it.
    ``[N]`` → 0-d."""
    return masked_mean(upcast(numerator.detach()) - upcast(denominator.detach()), m, count=count)[0]
