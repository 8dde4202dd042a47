"""The per-sequence reference: prime-rl's ``compute_loss`` as it was before PR #2951.

Written for clarity, not speed: a Python loop over the packed sequences, each component called once
per sequence with boolean-mask indexing, ``mask.any()`` skips (host syncs), and per-sequence metrics
stacked at the end. It is the ground truth of the equivalence tests and the "before" column of
``packloss bench``. It imports nothing from the code it checks: the per-token formulas, the inputs
container and the config dispatch are spelled out here independently of :mod:`packloss.core` and
:mod:`packloss.compat`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "default_loss_fn",
    "ipo_loss_fn",
    "ref_kl_loss_fn",
    "ce_loss_fn",
    "setup_rl_loss_fn",
    "compute_loss",
    "LossInputs",
    "LossOutputs",
]


@dataclass
class LossInputs:
    """One sequence's streams as prime-rl passed them (``seq_ids`` etc.: one sequence)."""

    trainer_logprobs: Tensor
    inference_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor | None
    loss_mask: Tensor
    loss_weights: Tensor | None = None
    seq_ids: Tensor | None = None
    cu_seqlens: Tensor | None = None
    num_seqs: int = 1

    def __post_init__(self) -> None:
        if self.seq_ids is None:
            n = self.trainer_logprobs.shape[0]
            self.seq_ids = torch.zeros(n, dtype=torch.long)
            self.cu_seqlens = torch.tensor([0, n], dtype=torch.int32)


@dataclass
class LossOutputs:
    loss: Tensor
    metrics: dict[str, Tensor]
    counts: dict[str, Tensor] = field(default_factory=dict)


LossFn = Callable[[LossInputs], LossOutputs]


def _safe_mean(values: Tensor, mask: Tensor) -> Tensor:
    return values[mask].float().sum() / torch.clamp_min(mask.sum(), 1)


def _ratio(inputs: LossInputs) -> tuple[Tensor, Tensor, Tensor]:
    log_ratio = inputs.trainer_logprobs - inputs.inference_logprobs
    ratio = torch.exp(log_ratio)
    return log_ratio, ratio, ratio - log_ratio - 1


def _per_token(inputs: LossInputs, keep: Tensor, adv: Tensor, ratio: Tensor, log_ratio: Tensor, kl_tau: float):
    pg_loss = keep * adv * ratio
    kl_loss = inputs.loss_mask * log_ratio**2
    per_token_loss = -pg_loss + kl_tau * kl_loss
    if inputs.loss_weights is not None:
        per_token_loss = per_token_loss * inputs.loss_weights
    return per_token_loss.sum()


def default_loss_fn(inputs: LossInputs, loss_config: Any) -> LossOutputs:
    """DPPO: drop A>0 tokens whose probability rose by more than ``dppo_mask_high``, A≤0 tokens whose
    probability fell by more than ``dppo_mask_low``; squared-log-ratio KL on every member."""
    log_ratio, ratio, mismatch_kl = _ratio(inputs)
    mask, adv = inputs.loss_mask, inputs.advantages
    probs_diff = torch.exp(inputs.trainer_logprobs) - torch.exp(inputs.inference_logprobs)
    high = probs_diff > loss_config.dppo_mask_high
    low = probs_diff < -loss_config.dppo_mask_low
    is_masked = torch.where(adv > 0, high, low)
    keep, drop = mask & ~is_masked, mask & is_masked
    loss = _per_token(inputs, keep, loss_config.adv_tau * adv, ratio, log_ratio, loss_config.kl_tau)
    return LossOutputs(
        loss=loss,
        metrics={
            "masked_mismatch_kl": _safe_mean(mismatch_kl, drop),
            "unmasked_mismatch_kl": _safe_mean(mismatch_kl, keep),
            "is_masked": _safe_mean(is_masked, mask),
            "is_masked_low": _safe_mean((adv < 0) & low, mask),
            "is_masked_high": _safe_mean((adv > 0) & high, mask),
            "masked_advantage_positive": _safe_mean(adv > 0, drop),
            "masked_advantage_negative": _safe_mean(adv < 0, drop),
        },
    )


def ipo_loss_fn(inputs: LossInputs, loss_config: Any) -> LossOutputs:
    """IPO: drop tokens whose probability moved by more than ``ipo_threshold`` either way."""
    log_ratio, ratio, mismatch_kl = _ratio(inputs)
    mask = inputs.loss_mask
    probs_diff = torch.exp(inputs.trainer_logprobs) - torch.exp(inputs.inference_logprobs)
    is_masked = probs_diff.abs() > loss_config.ipo_threshold
    keep = mask & ~is_masked
    loss = _per_token(inputs, keep, loss_config.adv_tau * inputs.advantages, ratio, log_ratio, loss_config.kl_tau)
    return LossOutputs(
        loss=loss,
        metrics={
            "masked_mismatch_kl": _safe_mean(mismatch_kl, mask & is_masked),
            "unmasked_mismatch_kl": _safe_mean(mismatch_kl, keep),
            "is_masked": _safe_mean(is_masked, mask),
        },
    )


def ref_kl_loss_fn(inputs: LossInputs) -> LossOutputs:
    """On-policy distillation: advantage ``(ref − trn).detach()``, drop tokens whose probability fell
    by more than 0.2, KL coefficient 1e-3."""
    if inputs.ref_logprobs is None:
        raise ValueError("ref_kl_loss_fn needs ref_logprobs")
    log_ratio, ratio, mismatch_kl = _ratio(inputs)
    mask = inputs.loss_mask
    probs_diff = torch.exp(inputs.trainer_logprobs) - torch.exp(inputs.inference_logprobs)
    is_masked = probs_diff < -0.2
    keep = mask & ~is_masked
    ref_kl = inputs.ref_logprobs - inputs.trainer_logprobs
    loss = _per_token(inputs, keep, ref_kl.detach(), ratio, log_ratio, 1e-3)
    return LossOutputs(
        loss=loss,
        metrics={
            "ref_kl/masked_mismatch_kl": _safe_mean(mismatch_kl, mask & is_masked),
            "ref_kl/unmasked_mismatch_kl": _safe_mean(mismatch_kl, keep),
            "ref_kl/is_masked": _safe_mean(is_masked, mask),
            "ref_kl": _safe_mean(ref_kl.detach(), mask),
        },
    )


def ce_loss_fn(inputs: LossInputs) -> LossOutputs:
    """Masked NLL ``Σ −trn · w``; metric ``nll``."""
    nll = -inputs.trainer_logprobs
    if inputs.loss_weights is not None:
        nll = nll * inputs.loss_weights
    return LossOutputs(
        loss=nll[inputs.loss_mask].sum(),
        metrics={"nll": _safe_mean(-inputs.trainer_logprobs.detach(), inputs.loss_mask)},
    )


def setup_rl_loss_fn(loss_config: Any) -> LossFn:
    """The per-sequence rl loss function for a prime-rl loss config (custom: ``import_path``; IPO:
    ``ipo_threshold``; else DPPO)."""
    if hasattr(loss_config, "import_path"):
        module_name, _, attr = loss_config.import_path.replace(":", ".").rpartition(".")
        custom_fn = getattr(importlib.import_module(module_name), attr)
        return lambda inputs: custom_fn(inputs, **loss_config.kwargs)
    if hasattr(loss_config, "ipo_threshold"):
        return lambda inputs: ipo_loss_fn(inputs, loss_config)
    return lambda inputs: default_loss_fn(inputs, loss_config)


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
) -> tuple[Tensor, dict[str, Any]]:
    """Per-sequence loop; same signature as :func:`packloss.compat.prime_rl.compute_loss`."""
    n = len(trainer_logprobs)
    none = [None] * n
    all_metrics: dict[str, list[Tensor]] = {}

    def run(fn: LossFn, inputs: LossInputs) -> Tensor:
        out = fn(inputs)
        for key, value in out.metrics.items():
            all_metrics.setdefault(key, []).append(value)
        return out.loss

    # Graph anchor: the loss must stay backward-able when every component is empty.
    rl_loss = trainer_logprobs[0].sum() * 0.0
    ce_loss: Tensor | float = 0.0
    ref_kl_loss: Tensor | float = 0.0
    for trn, inf, ref, adv, mask, rl_w, ce_w, ref_kl_w in zip(
        trainer_logprobs,
        inference_logprobs,
        ref_logprobs or none,
        advantages,
        loss_mask,
        rl_weights or none,
        ce_weights or none,
        ref_kl_weights or none,
        strict=True,
    ):

        def inputs(component_mask: Tensor, weights: Tensor | None) -> LossInputs:
            return LossInputs(trn, inf, ref, adv, component_mask, weights)  # noqa: B023

        if rl_w is None:
            rl_loss = rl_loss + run(rl_loss_fn, inputs(mask, None))
        else:
            rl_mask = mask & (rl_w != 0)
            if bool(rl_mask.any()):  # sync-ok: the reference is the slow per-sequence loop
                rl_loss = rl_loss + run(rl_loss_fn, inputs(rl_mask, rl_w))
        if ce_w is not None:
            ce_mask = ce_w != 0
            if bool(ce_mask.any()):  # sync-ok: reference
                ce_loss = ce_loss + run(ce_loss_fn, inputs(ce_mask, ce_w))
        if ref_kl_w is not None:
            ref_kl_mask = ref_kl_w != 0
            if bool(ref_kl_mask.any()):  # sync-ok: reference
                ref_kl_loss = ref_kl_loss + run(ref_kl_loss_fn, inputs(ref_kl_mask, ref_kl_w))

    loss = rl_loss / rl_scale + ce_loss / ce_scale + ref_kl_loss / ref_kl_scale
    metrics = {k: torch.stack(v) if v[0].dim() == 0 else torch.cat(v) for k, v in all_metrics.items()}
    return loss, metrics
