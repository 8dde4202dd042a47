"""``PackedBatch``: the per-token streams of one packed bin and its sequence layout.

A bin is one row of ``N`` tokens holding ``S`` sequences back to back. Every stream is a ``[N]``
tensor over the concatenated bin; ``seq_lens`` (host ints) gives the layout, from which
``cu_seqlens [S+1]`` and ``seq_ids [N]`` are derived once, on the host, then copied to the device
(a host→device copy, never a device→host sync).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

__all__ = ["PackedBatch", "layout_tensors"]

_LOGPROB_STREAMS = ("trainer_logprobs", "inference_logprobs", "ref_logprobs")
_FLOAT_STREAMS = ("advantages", "rl_weights", "ce_weights", "ref_kl_weights")
_STREAMS = ("trainer_logprobs", "inference_logprobs", "loss_mask", *_LOGPROB_STREAMS[2:], *_FLOAT_STREAMS)


def _check_seq_lens(seq_lens: Sequence[int], num_tokens: int | None = None) -> tuple[int, ...]:
    if isinstance(seq_lens, Tensor):
        raise TypeError("seq_lens must be host-side Python ints (a list or tuple), not a tensor")
    lens = tuple(seq_lens)
    for n in lens:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"seq_lens must hold Python ints, got {type(n).__name__}")
        if n <= 0:
            raise ValueError(f"seq_lens must hold positive lengths, got {n} in {list(lens)}")
    if not lens:
        raise ValueError("seq_lens is empty: a bin holds at least one sequence")
    if num_tokens is not None and sum(lens) != num_tokens:
        raise ValueError(f"seq_lens sums to {sum(lens)} but trainer_logprobs holds N={num_tokens} tokens")
    return lens


def layout_tensors(seq_lens: Sequence[int], device: torch.device | str) -> tuple[Tensor, Tensor]:
    """``(cu_seqlens [S+1] int32, seq_ids [N] long)`` for host-side ``seq_lens``, built on the host."""
    lens = _check_seq_lens(seq_lens)
    cu = torch.tensor((0, *itertools.accumulate(lens)), dtype=torch.int32)
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens), output_size=sum(lens))
    return cu.to(device), seq_ids.to(device)


@dataclass(frozen=True)
class PackedBatch:
    """The streams of one packed bin (all ``[N]``) and its layout.

    Args:
        trainer_logprobs: ``[N]`` float, log-probs of the sampled tokens under the trained policy
            (the tensor gradients flow into).
        inference_logprobs: ``[N]`` float, log-probs under the policy that sampled (inference engine).
        loss_mask: ``[N]`` bool, tokens the rl component trains on.
        seq_lens: host-side lengths of the ``S`` packed sequences, each > 0, summing to ``N``.
        advantages: ``[N]`` float or None (needed by the shipped-advantage rl losses).
        ref_logprobs: ``[N]`` float or None, reference/teacher log-probs (needed by ``ref_kl``).
        rl_weights, ce_weights, ref_kl_weights: ``[N]`` float per-component weights or None. Weight 0
            removes a token from a component; an absent rl stream means weight 1 on ``loss_mask``;
            an absent ce / ref_kl stream switches that component off.

    Derived: ``cu_seqlens [S+1]`` (int32), ``seq_ids [N]`` (long), ``num_seqs`` (= S), ``num_tokens`` (= N).
    Construction runs the cheap, sync-free :meth:`validate`.
    """

    trainer_logprobs: Tensor
    inference_logprobs: Tensor
    loss_mask: Tensor
    seq_lens: tuple[int, ...]
    advantages: Tensor | None = None
    ref_logprobs: Tensor | None = None
    rl_weights: Tensor | None = None
    ce_weights: Tensor | None = None
    ref_kl_weights: Tensor | None = None
    cu_seqlens: Tensor = field(init=False, repr=False)
    seq_ids: Tensor = field(init=False, repr=False)
    num_seqs: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.trainer_logprobs, Tensor):
            raise TypeError("trainer_logprobs must be a torch.Tensor")
        lens = _check_seq_lens(self.seq_lens)
        object.__setattr__(self, "seq_lens", lens)
        self.validate()
        cu_seqlens, seq_ids = layout_tensors(lens, self.trainer_logprobs.device)
        object.__setattr__(self, "cu_seqlens", cu_seqlens)
        object.__setattr__(self, "seq_ids", seq_ids)
        # A plain int field (not len(seq_lens)) so torch.compile can treat it as dynamic.
        object.__setattr__(self, "num_seqs", len(lens))

    @property
    def num_tokens(self) -> int:
        return self.trainer_logprobs.shape[0]

    def component_masks(self) -> dict[str, Tensor]:
        """The member mask ``[N]`` of each active component: ``rl`` always (``loss_mask``, intersected
        with ``rl_weights != 0`` when given), ``ce`` / ``ref_kl`` when their weight stream is given."""
        rl = self.loss_mask if self.rl_weights is None else self.loss_mask & (self.rl_weights != 0)
        masks = {"rl": rl}
        if self.ce_weights is not None:
            masks["ce"] = self.ce_weights != 0
        if self.ref_kl_weights is not None:
            masks["ref_kl"] = self.ref_kl_weights != 0
        return masks

    def validate(self, deep: bool = False) -> PackedBatch:
        """Raise a ``TypeError``/``ValueError`` naming the bad argument; return ``self``.

        The default checks read only shapes, dtypes and devices (no sync). ``deep=True`` also reads
        values (one sync per check): member log-probs finite and ≤ 0, weights and advantages finite
        on members.
        """
        ref = self.trainer_logprobs
        if ref.dim() != 1:
            raise ValueError(f"trainer_logprobs must be 1-D [N], got shape {tuple(ref.shape)}")
        n = ref.shape[0]
        _check_seq_lens(self.seq_lens, n)
        for name in _STREAMS:
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(value).__name__}")
            if tuple(value.shape) != (n,):
                raise ValueError(f"{name} must have shape [N]=({n},), got {tuple(value.shape)}")
            if value.device != ref.device:
                raise ValueError(f"{name} is on {value.device} but trainer_logprobs is on {ref.device}")
            if name == "loss_mask":
                if value.dtype != torch.bool:
                    raise TypeError(f"loss_mask must be a bool tensor, got {value.dtype}")
            elif not value.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")
        if self.ref_kl_weights is not None and self.ref_logprobs is None:
            raise ValueError("ref_kl_weights is given but ref_logprobs is None: the ref_kl component needs them")
        if deep:
            self._validate_values()
        return self

    def _validate_values(self) -> None:
        mask = self.loss_mask
        for name in _LOGPROB_STREAMS:
            value = getattr(self, name)
            if value is None:
                continue
            member = value.detach()[mask]
            if not bool(torch.isfinite(member).all()):  # sync-ok: opt-in deep validation
                raise ValueError(f"{name} holds a non-finite value on a loss_mask token")
            if bool((member > 1e-4).any()):  # sync-ok: opt-in deep validation
                raise ValueError(f"{name} holds a positive log-probability on a loss_mask token")
        for name in _FLOAT_STREAMS:
            value = getattr(self, name)
            if value is not None and not bool(torch.isfinite(value.detach()[mask]).all()):  # sync-ok: opt-in
                raise ValueError(f"{name} holds a non-finite value on a loss_mask token")

    @classmethod
    def from_sequences(
        cls,
        trainer_logprobs: Sequence[Tensor],
        inference_logprobs: Sequence[Tensor],
        loss_mask: Sequence[Tensor],
        advantages: Sequence[Tensor] | None = None,
        ref_logprobs: Sequence[Tensor] | None = None,
        rl_weights: Sequence[Tensor] | None = None,
        ce_weights: Sequence[Tensor] | None = None,
        ref_kl_weights: Sequence[Tensor] | None = None,
    ) -> PackedBatch:
        """Pack lists of per-sequence ``[n_i]`` tensors into one bin (concatenation keeps autograd)."""
        lists = dict(
            trainer_logprobs=trainer_logprobs,
            inference_logprobs=inference_logprobs,
            loss_mask=loss_mask,
            advantages=advantages,
            ref_logprobs=ref_logprobs,
            rl_weights=rl_weights,
            ce_weights=ce_weights,
            ref_kl_weights=ref_kl_weights,
        )
        seq_lens = tuple(t.shape[0] for t in trainer_logprobs)
        for name, seqs in lists.items():
            if seqs is None:
                continue
            if len(seqs) != len(seq_lens):
                raise ValueError(f"{name} holds {len(seqs)} sequences, trainer_logprobs {len(seq_lens)}")
            for i, (t, n) in enumerate(zip(seqs, seq_lens, strict=True)):
                if tuple(t.shape) != (n,):
                    raise ValueError(f"{name}[{i}] must have shape ({n},), got {tuple(t.shape)}")
        streams = {k: (torch.cat(list(v)) if v is not None else None) for k, v in lists.items()}
        return cls(seq_lens=seq_lens, **streams)

    @classmethod
    def from_padded(
        cls,
        attention_mask: Tensor,
        trainer_logprobs: Tensor,
        inference_logprobs: Tensor,
        loss_mask: Tensor,
        seq_lens: Sequence[int] | None = None,
        **streams: Tensor | None,
    ) -> PackedBatch:
        """Pack ``[B, T]`` streams (the TRL/verl layout) into one bin of the attended tokens.

        ``attention_mask [B, T]`` marks real tokens (left, right or any padding); row ``b`` becomes
        sequence ``b`` with its tokens in order. Other streams (``advantages``, ``ref_logprobs``,
        ``*_weights``) are keyword arguments of shape ``[B, T]``. Reading the row lengths is one
        device→host sync unless ``seq_lens`` (host ints, one per row) is given.
        """
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be [B, T], got shape {tuple(attention_mask.shape)}")
        known = {f.name for f in fields(cls) if f.init} - {"seq_lens"}
        unknown = set(streams) - known
        if unknown:
            raise TypeError(f"from_padded got unknown stream(s): {sorted(unknown)}")
        attended = attention_mask.bool()
        if seq_lens is None:
            seq_lens = attended.sum(1).tolist()  # sync-ok: one read of the row lengths, documented
        lens = _check_seq_lens(seq_lens)
        if len(lens) != attended.shape[0]:
            raise ValueError(f"seq_lens holds {len(lens)} lengths for B={attended.shape[0]} rows")
        b, t = attended.shape
        # Stable sort puts the attended positions first, in row-major order, without boolean indexing.
        key = (~attended).reshape(-1).to(torch.long) * (b * t) + torch.arange(b * t, device=attended.device)
        index = torch.argsort(key)[: sum(lens)]  # [N]
        all_streams = dict(
            trainer_logprobs=trainer_logprobs, inference_logprobs=inference_logprobs, loss_mask=loss_mask, **streams
        )
        packed = {}
        for name, value in all_streams.items():
            if value is None:
                packed[name] = None
                continue
            if tuple(value.shape) != (b, t):
                raise ValueError(f"{name} must have shape [B, T]=({b}, {t}), got {tuple(value.shape)}")
            packed[name] = value.reshape(-1).index_select(0, index)
        return cls(seq_lens=lens, **packed)

    def to_padded(self, stream: Tensor, pad_value: float = 0.0) -> tuple[Tensor, Tensor]:
        """Unpack a ``[N]`` stream of this bin to ``([S, T_max] right-padded, attention_mask [S, T_max])``."""
        if tuple(stream.shape) != (self.num_tokens,):
            raise ValueError(f"stream must have shape [N]=({self.num_tokens},), got {tuple(stream.shape)}")
        t_max = max(self.seq_lens)
        pos = torch.arange(self.num_tokens, device=stream.device) - self.cu_seqlens[self.seq_ids]  # [N]
        flat = self.seq_ids * t_max + pos  # [N]
        padded = torch.full((self.num_seqs * t_max,), pad_value, dtype=stream.dtype, device=stream.device)
        padded = padded.index_put((flat,), stream)
        attention = torch.zeros(self.num_seqs * t_max, dtype=torch.bool, device=stream.device)
        attention = attention.index_fill(0, flat, True)
        return padded.view(self.num_seqs, t_max), attention.view(self.num_seqs, t_max)
