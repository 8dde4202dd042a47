"""prime-rl's trainer loss module (``prime_rl.trainer.rl.loss``, before PR #2951), on packloss.

Switch by changing one import::

    # from prime_rl.trainer.rl.loss import compute_loss, setup_rl_loss_fn, LossInputs, LossOutputs
    from packloss.compat.prime_rl import compute_loss, setup_rl_loss_fn, LossInputs, LossOutputs

``compute_loss`` keeps its signature (lists of per-sequence tensors) but concatenates the bin and
runs every component once over it, with no device→host sync. Gradients equal the per-sequence
implementation's bit for bit; the loss equals it up to summation order.

Differences a caller can see, as PR #2951 states them:

* Metrics are one token-weighted value per micro-batch, as 1-element tensors (before: one value per
  sequence, stacked). A component whose mask is empty reports its metrics with value 0 (before: the
  metric was missing when every sequence was skipped).
* Loss functions (built-in and custom) are called **once per bin** with the concatenated streams and
  the layout fields ``seq_ids``, ``cu_seqlens``, ``num_seqs`` of :class:`LossInputs`. A custom loss
  that is additive over tokens is unaffected; one that normalises per sequence must use the layout
  (``packloss check MODULE:FUNCTION`` tells which).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from packloss.batch import PackedBatch
from packloss.ce import ce_loss
from packloss.component import LossFn, LossInputs, LossOutputs
from packloss.compute import compute_loss as _native_compute_loss
from packloss.pg import REF_KL, PGParams, pg_loss

__all__ = [
    "LossInputs",
    "LossOutputs",
    "LossFn",
    "DefaultLossConfig",
    "IPOLossConfig",
    "CustomLossConfig",
    "LossConfig",
    "setup_rl_loss_fn",
    "default_loss_fn",
    "ipo_loss_fn",
    "ref_kl_loss_fn",
    "ce_loss_fn",
    "compute_loss",
    "selective_log_softmax",
    "compute_entropy",
    "shift_tensor_left",
    "shift_tensor_right",
]


@dataclass(frozen=True)
class DefaultLossConfig:
    """prime-rl's default (DPPO + KL) loss settings."""

    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2
    adv_tau: float = 1.0
    kl_tau: float = 1e-3


@dataclass(frozen=True)
class IPOLossConfig:
    """prime-rl's IPO loss settings."""

    ipo_threshold: float = 0.1
    adv_tau: float = 1.0
    kl_tau: float = 1e-3


@dataclass(frozen=True)
class CustomLossConfig:
    """A custom rl loss: ``import_path`` (``"pkg.module.function"`` or ``"pkg.module:function"``)
    called as ``function(inputs, **kwargs)``."""

    import_path: str
    kwargs: dict[str, Any] = field(default_factory=dict)


LossConfig = DefaultLossConfig | IPOLossConfig | CustomLossConfig


def _pg_params(loss_config: DefaultLossConfig | IPOLossConfig) -> PGParams:
    if isinstance(loss_config, IPOLossConfig):
        return PGParams(
            trust_region="ipo",
            ipo_threshold=loss_config.ipo_threshold,
            adv_tau=loss_config.adv_tau,
            kl_tau=loss_config.kl_tau,
        )
    return PGParams(
        trust_region="dppo",
        dppo_mask_low=loss_config.dppo_mask_low,
        dppo_mask_high=loss_config.dppo_mask_high,
        adv_tau=loss_config.adv_tau,
        kl_tau=loss_config.kl_tau,
    )


def default_loss_fn(inputs: LossInputs, loss_config: DefaultLossConfig) -> LossOutputs:
    """DPPO trust region + squared-log-ratio KL (the skeleton with ``trust_region="dppo"``)."""
    return pg_loss(inputs, _pg_params(loss_config))


def ipo_loss_fn(inputs: LossInputs, loss_config: IPOLossConfig) -> LossOutputs:
    """IPO: symmetric trust region ``|dp| > ipo_threshold`` (the skeleton with ``trust_region="ipo"``)."""
    return pg_loss(inputs, _pg_params(loss_config))


def ref_kl_loss_fn(inputs: LossInputs) -> LossOutputs:
    """On-policy distillation (:data:`packloss.pg.REF_KL`); its mean ``ref − trn`` is named ``ref_kl``."""
    out = pg_loss(inputs, REF_KL)
    rename = {"ref_kl/ref_kl": "ref_kl"}
    return LossOutputs(
        loss=out.loss,
        metrics={rename.get(k, k): v for k, v in out.metrics.items()},
        counts={rename.get(k, k): v for k, v in out.counts.items()},
    )


def ce_loss_fn(inputs: LossInputs) -> LossOutputs:
    """Masked negative log-likelihood; metric ``nll``."""
    return ce_loss(inputs)


def import_object(import_path: str) -> Any:
    """``"pkg.module.name"`` or ``"pkg.module:name"`` → the object."""
    module_name, sep, attr = import_path.partition(":")
    if not sep:
        module_name, _, attr = import_path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"import_path must look like 'pkg.module.function', got {import_path!r}")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {import_path!r}: {exc}") from exc


def setup_rl_loss_fn(loss_config: LossConfig) -> LossFn:
    """The rl component's loss function for a prime-rl loss config."""
    if isinstance(loss_config, CustomLossConfig):
        custom_fn = import_object(loss_config.import_path)
        kwargs = dict(loss_config.kwargs)
        return lambda inputs: custom_fn(inputs, **kwargs)
    if isinstance(loss_config, DefaultLossConfig | IPOLossConfig):
        return _pg_params(loss_config)
    raise TypeError(
        f"loss_config must be DefaultLossConfig, IPOLossConfig or CustomLossConfig, got {type(loss_config).__name__}"
    )


def compute_loss(
    trainer_logprobs: list[Tensor],
    inference_logprobs: list[Tensor],
    ref_logprobs: list[Tensor] | None,
    advantages: list[Tensor],
    loss_mask: list[Tensor],
    rl_weights: list[Tensor] | None,
    ce_weights: list[Tensor] | None,
    ref_kl_weights: list[Tensor] | None,
    rl_loss_fn: LossFn,
    rl_scale: int,
    ce_scale: int,
    ref_kl_scale: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """prime-rl's ``compute_loss``: lists of per-sequence ``[n_i]`` tensors in, ``(loss, metrics)`` out.

    ``loss = Σ rl / rl_scale + Σ ce / ce_scale + Σ ref_kl / ref_kl_scale``; metrics are 1-element
    token-weighted tensors (see the module docstring).
    """
    batch = PackedBatch.from_sequences(
        trainer_logprobs=trainer_logprobs,
        inference_logprobs=inference_logprobs,
        loss_mask=loss_mask,
        advantages=advantages,
        ref_logprobs=ref_logprobs,
        rl_weights=rl_weights,
        ce_weights=ce_weights,
        ref_kl_weights=ref_kl_weights,
    )
    result = _native_compute_loss(
        batch,
        rl_loss_fn,
        ref_kl=ref_kl_loss_fn,
        rl_scale=rl_scale,
        ce_scale=ce_scale,
        ref_kl_scale=ref_kl_scale,
    )
    return result.loss, {k: v.reshape(1) for k, v in result.metrics.items()}


def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """``log_softmax(logits)[..., index]`` without materialising the log-softmax: ``[B, T, V], [B, T] → [B, T]``."""
    picked = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return picked.to(torch.float32) - torch.logsumexp(logits.to(torch.float32), dim=-1)


def compute_entropy(shifted_logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` per position, no gradient: ``[B, T, V] → [B, T]``."""
    with torch.no_grad():
        logits = shifted_logits.to(torch.float32)
        probs = torch.softmax(logits, dim=-1)
        return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def shift_tensor_left(t: Tensor) -> Tensor:
    """``out[:, i] = t[:, i+1]``, last column 0 (labels from input ids): ``[B, T] → [B, T]``."""
    return torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], dim=1)


def shift_tensor_right(t: Tensor, pad_value: float | None = None) -> Tensor:
    """``out[:, i] = t[:, i-1]``, first column ``pad_value`` (default 0): ``[B, T] → [B, T]``."""
    pad = torch.full_like(t[:, :1], 0.0 if pad_value is None else pad_value)
    return torch.cat([pad, t[:, :-1]], dim=1)
