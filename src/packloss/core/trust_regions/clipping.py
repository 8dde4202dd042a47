"""Clipped and gated token-level trust regions: PPO's family (``ppo_clip`` with dual clip,
``ppo_clip_clamped``, ``cispo``, ``cispo_cap``) and the soft gate ``sapo``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from packloss.core.trust_regions.base import (
    LOG_RATIO_CLAMP,
    PolicyTerms,
    Surrogate,
    TrustRegion,
    check_clip,
    clamped_ratio,
    member_trn,
    positive,
    register_trust_region,
    required,
)

__all__ = ["PPOClip", "ClampedPPOClip", "CISPO", "CISPOCap", "SAPO"]


def _clip_metrics(ratio: Tensor, a: Tensor, low: float, high: float) -> dict[str, Tensor]:
    """Members whose gradient the clip zeroes: ``A<0 & r<1−ε_low``, ``A>0 & r>1+ε_high``."""
    r = ratio.detach()
    return {"clip_frac_low": (a < 0) & (r < 1 - low), "clip_frac_high": (a > 0) & (r > 1 + high)}


def clipped(
    ratio: Tensor, a: Tensor, low: float, high: float, dual_clip_c: float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """``(J [N], metrics)`` of PPO's clipped surrogate ``min(r·A', clip(r, 1−low, 1+high)·A')`` of
    ``ratio`` (token or sequence ratio), with the dual clip ``max(J, c·A')`` for ``A' < 0``. A plain
    function, so regions built on it construct no region (and re-run no check) inside their surrogate."""
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - low, 1 + high) * a)
    metrics = _clip_metrics(ratio, a, low, high)
    is_masked = metrics["clip_frac_low"] | metrics["clip_frac_high"]
    if dual_clip_c is not None:
        surrogate = torch.where(a < 0, torch.maximum(surrogate, dual_clip_c * a), surrogate)
        metrics["dual_clip_frac"] = (a < 0) & (ratio.detach() > dual_clip_c)
        is_masked = is_masked | metrics["dual_clip_frac"]
    metrics["is_masked"] = is_masked
    return surrogate, metrics


@register_trust_region("ppo_clip")
@dataclass(frozen=True)
class PPOClip(TrustRegion):
    """``J = min(r·A', clip(r, 1−ε_low, 1+ε_high)·A')``; with ``dual_clip_c`` and ``A' < 0``:
    ``max(J, c·A')`` (Ye et al. 2020). DAPO's clip-higher: ``clip_high=0.28``."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float | None = None

    def check(self) -> None:
        super().check()
        check_clip(self)
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            raise ValueError(f"{type(self).__name__}.dual_clip_c must be > 1, got {self.dual_clip_c}")

    def clipped(self, ratio: Tensor, a: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``(J [N], metrics)`` of the clipped surrogate of ``ratio`` (token or sequence ratio)."""
        return clipped(ratio, a, self.clip_low, self.clip_high, self.dual_clip_c)

    def clipped_with_ratio_metric(self, t: PolicyTerms, ratio: Tensor, sequence_ratio=None) -> Surrogate:
        """:meth:`clipped` of ``ratio [N]`` plus the metric ``clip_ratio``: members whose clipped
        surrogate is the smaller, ``clip(r)·A < r·A`` (OpenRLHF's ``clip_ratio``)."""
        surrogate, metrics = self.clipped(ratio, t.a)
        r = ratio.detach()
        metrics["clip_ratio"] = r.clamp(1 - self.clip_low, 1 + self.clip_high) * t.a < r * t.a
        return Surrogate(torch.where(t.m, surrogate, 0.0), metrics, sequence_ratio=sequence_ratio)

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        surrogate, metrics = self.clipped(t.r, t.a)
        return Surrogate(torch.where(t.m, surrogate, 0.0), metrics)


@register_trust_region("ppo_clip_clamped")
@dataclass(frozen=True)
class ClampedPPOClip(PPOClip):
    """PPO's clip (with dual clip) on ``r = exp(clamp(log_r, −20, 20))`` (OpenRLHF's ``"ppo"``): equal
    to :class:`PPOClip` where ``|log_r| ≤ 20``, past it ``r = e^±20`` with no gradient. Metric
    ``clip_ratio``: members with ``clip(r)·A < r·A``."""

    reads_token_ratio: ClassVar[bool] = False

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        ratio = torch.exp(t.log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [N]
        return self.clipped_with_ratio_metric(t, ratio)


@register_trust_region("cispo")
@dataclass(frozen=True)
class CISPO(TrustRegion):
    """MiniMax-M1: ``J = sg(clip(r, 1−ε_low, 1+ε_high)) · A' · trn`` (REINFORCE with a detached,
    clipped importance weight; no token is dropped). Metrics ``clip_frac_low`` / ``_high`` (as PPO's)
    and ``clip_frac``: members whose weight the clip changes, whatever the advantage (verl's)."""

    clip_low: float = 0.2
    clip_high: float = 0.2

    def check(self) -> None:
        super().check()
        check_clip(self)

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        weight = t.r.clamp(1 - self.clip_low, 1 + self.clip_high).detach()
        objective = torch.where(t.m, weight * t.a * member_trn(t), 0.0)
        metrics = _clip_metrics(t.r, t.a, self.clip_low, self.clip_high)
        metrics["clip_frac"] = weight != t.r.detach()
        return Surrogate(objective, metrics)


@register_trust_region("cispo_cap")
@dataclass(frozen=True)
class CISPOCap(TrustRegion):
    """CISPO with an absolute cap and no lower bound (MiniMax-M1 with ``ε_low`` unset; ScaleRL's
    ``ε_max``; TRL's ``loss_type="cispo"``): ``J_t = sg(min(r_t, cap)) · A'_t · trn_t``. Metric
    ``clip_frac_high``: members with ``A' > 0`` and ``r > cap``. No token is dropped."""

    cap: float = 5.0

    def check(self) -> None:
        super().check()
        positive(self, "cap")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        r = t.r.detach()  # [N]
        objective = torch.where(t.m, r.clamp(max=self.cap) * t.a * member_trn(t), 0.0)
        return Surrogate(objective, {"clip_frac_high": (t.a > 0) & (r > self.cap)})


@register_trust_region("sapo")
@dataclass(frozen=True)
class SAPO(TrustRegion):
    """SAPO, Soft Adaptive Policy Optimization (Gao et al. 2025, arXiv:2511.20347); verl's ``sapo``::

        J_t = f_τ(r_t) · A'_t,   f_τ(x) = (4/τ) · σ(τ (x − 1)),   τ = τ_pos if A'_t > 0 else τ_neg

    so ``∇J_t = 4 σ(1 − σ) · r_t A'_t ∇log π_θ``: the plain IS gradient at ``r = 1``, decaying smoothly
    as ``r`` leaves 1. Defaults are verl's (``tau_pos = 1.0``, ``tau_neg = 1.05``). As verl:
    ``r = exp(clamp(log_r, −20, 20))`` and ``A' = 0`` takes ``τ_neg``. Metric ``soft_gate``: the
    gradient's factor ``4 σ(1 − σ) ∈ (0, 1]``. No token is dropped.
    """

    reads_token_ratio: ClassVar[bool] = False

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def check(self) -> None:
        super().check()
        required(self)
        positive(self, "tau_pos", "tau_neg")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        # filled, not torch.where(cond, float, float): that makes float32 and loses τ's digits in float64
        tau = torch.full_like(t.trn.detach(), self.tau_neg).masked_fill(t.a > 0, self.tau_pos)  # [N]
        gate = torch.sigmoid(tau * (clamped_ratio(t) - 1))  # [N]
        objective = torch.where(t.m, (4 / tau) * gate * t.a, 0.0)
        g = gate.detach()
        return Surrogate(objective, {"soft_gate": 4 * g * (1 - g)})
