"""``compute_loss``: every component of a packed bin, each once over the concatenated bin (DESIGN.md §3).

Components:

* ``rl`` — the rl loss (a :class:`~packloss.pg.PGParams` or any ``LossFn``) on ``loss_mask``, or on
  ``loss_mask & (rl_weights != 0)`` weighted by ``rl_weights``. It always runs, so the returned loss
  is attached to the graph and every rank runs backward even when every component is empty.
* ``ce`` — masked NLL on ``ce_weights != 0`` (not intersected with ``loss_mask``), if ``ce_weights``.
* ``ref_kl`` — the ref_kl loss on ``ref_kl_weights != 0``, if ``ref_kl_weights``.

``total = Σ rl / rl_scale + Σ ce / ce_scale + Σ ref_kl / ref_kl_scale``. A scale left ``None`` is the
component's member count in this bin (a per-micro-batch token mean); pass global counts (summed over
the micro-batches of the step and the data-parallel ranks) to make the step's gradient independent of
how it was split. No step reads a device value on the host, and the number of tensor operations does
not depend on the number of sequences.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from packloss.batch import PackedBatch
from packloss.ce import ce_loss
from packloss.component import LossFn, LossInputs, LossOutputs, upcast
from packloss.normalize import COMPONENTS, check_mode, local_denominator
from packloss.pg import DPPO, REF_KL
from packloss.segments import broadcast, segment_count

__all__ = ["LossResult", "compute_loss"]

Scale = float | int | Tensor | None


@dataclass(frozen=True)
class LossResult:
    """``loss``: scalar (float32; float64 for float64 inputs) to call ``backward()`` on.
    ``metrics[name]``: tensor (scalar, or ``[S]`` with per-sequence metrics); ``counts[name]``: the
    member count it was taken over (same shape), so micro-batches and ranks merge exactly (see
    :mod:`packloss.metrics`)."""

    loss: Tensor
    metrics: dict[str, Tensor]
    counts: dict[str, Tensor]


def _check_scale(name: str, scale: Scale) -> None:
    if scale is None or isinstance(scale, Tensor):
        return
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"{name} must be a number, a tensor or None, got {type(scale).__name__}")
    if not scale > 0:
        raise ValueError(f"{name} must be > 0, got {scale}")


def _graph_anchor(trn: Tensor) -> Tensor:
    """A zero attached to ``trn``'s graph that reads no value (a sum over an empty slice)."""
    return trn[:0].sum(dtype=torch.float32)


def _modes(normalize: str | Mapping[str, str]) -> dict[str, str]:
    if isinstance(normalize, str):
        modes = dict.fromkeys(COMPONENTS, normalize)
    elif isinstance(normalize, Mapping):
        unknown = set(normalize) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"normalize has unknown component(s) {sorted(unknown)}; choose from {COMPONENTS}")
        modes = {c: normalize.get(c, "token") for c in COMPONENTS}
    else:
        raise TypeError(f"normalize must be a str or a mapping, got {type(normalize).__name__}")
    for name, mode in modes.items():
        check_mode(name, mode)
    return modes


def _per_sequence_mean_weights(batch: PackedBatch, mask: Tensor, weights: Tensor | None) -> Tensor:
    """``w_t / n_{s(t)}``: the weights that turn a token sum into a sum of per-sequence means."""
    per_seq = segment_count(mask, batch.seq_ids, batch.num_seqs).clamp_min(1)  # [S]
    inv = 1.0 / broadcast(per_seq, batch.seq_ids)  # [N]
    return inv if weights is None else upcast(weights) * inv


def compute_loss(
    batch: PackedBatch,
    rl: LossFn = DPPO,
    *,
    ref_kl: LossFn = REF_KL,
    rl_scale: Scale = None,
    ce_scale: Scale = None,
    ref_kl_scale: Scale = None,
    normalize: str | Mapping[str, str] = "token",
    per_sequence_metrics: bool = False,
) -> LossResult:
    """Loss and metrics of one packed bin.

    Args:
        batch: the bin's streams (``[N]``) and layout.
        rl: the rl component's loss — a ``PGParams`` (``DPPO``, ``IPO``, ...) or a custom
            ``LossFn(LossInputs) -> LossOutputs`` called once with the whole bin and its layout.
        ref_kl: the ref_kl component's loss (default :data:`~packloss.pg.REF_KL`).
        rl_scale, ce_scale, ref_kl_scale: each component's denominator (number or tensor), e.g. from
            :func:`~packloss.normalize.count_denominators`; ``None`` uses this bin's own count for the
            component's mode (required for ``constant``).
        normalize: one mode of :data:`~packloss.normalize.NORMALIZE_MODES` for every component, or
            ``{"rl": ..., "ce": ..., "ref_kl": ...}`` (missing components: ``token``). ``sequence_mean``
            divides each token's loss by its sequence's member count (through the weights) before
            the sum.
        per_sequence_metrics: report ``[S]`` metrics and counts instead of scalars.

    Returns:
        :class:`LossResult`. Metric names: the rl loss's own (``is_masked``, ...), ``nll`` for ce,
        ``ref_kl/...`` for ref_kl. A name produced by two components raises ``ValueError``.
    """
    if not isinstance(batch, PackedBatch):
        raise TypeError(f"batch must be a PackedBatch, got {type(batch).__name__}")
    for name, fn in (("rl", rl), ("ref_kl", ref_kl)):
        if not callable(fn):
            raise TypeError(f"{name} must be a PGParams or a callable LossFn, got {type(fn).__name__}")
    scales = {"rl": rl_scale, "ce": ce_scale, "ref_kl": ref_kl_scale}
    for name, scale in scales.items():
        _check_scale(f"{name}_scale", scale)
    modes = _modes(normalize)

    fns = {"rl": rl, "ce": ce_loss, "ref_kl": ref_kl}
    weights = {"rl": batch.rl_weights, "ce": batch.ce_weights, "ref_kl": batch.ref_kl_weights}

    trn = batch.trainer_logprobs
    total: Tensor | None = None
    metrics: dict[str, Tensor] = {}
    counts: dict[str, Tensor] = {}
    for name, mask in batch.component_masks().items():
        fn, w, scale, mode = fns[name], weights[name], scales[name], modes[name]
        if mode == "constant" and scale is None:
            raise ValueError(f"normalize[{name!r}]='constant' needs {name}_scale (the constant C)")
        if mode == "sequence_mean":
            w = _per_sequence_mean_weights(batch, mask, w)
        inputs = LossInputs(
            trainer_logprobs=trn,
            inference_logprobs=batch.inference_logprobs,
            ref_logprobs=batch.ref_logprobs,
            advantages=batch.advantages,
            loss_mask=mask,
            loss_weights=w,
            seq_ids=batch.seq_ids,
            cu_seqlens=batch.cu_seqlens,
            num_seqs=batch.num_seqs,
            per_sequence_metrics=per_sequence_metrics,
        )
        out = fn(inputs)
        if not isinstance(out, LossOutputs):
            raise TypeError(f"the {name} loss function must return LossOutputs, got {type(out).__name__}")
        loss = upcast(out.loss)
        if not loss.requires_grad and trn.requires_grad:
            loss = loss + _graph_anchor(trn)
        denom = scale if scale is not None else local_denominator(batch, mask, mode)
        total = loss / denom if total is None else total + loss / denom

        members = (
            segment_count(mask, batch.seq_ids, batch.num_seqs)
            if per_sequence_metrics
            else mask.sum(dtype=torch.float32)
        )
        for key, value in out.metrics.items():
            if key in metrics:
                raise ValueError(f"metric {key!r} is produced by two components; give one a metric_prefix")
            metrics[key] = value
            counts[key] = out.counts.get(key, members)
    assert total is not None  # the rl component always runs
    return LossResult(loss=total, metrics=metrics, counts=counts)
