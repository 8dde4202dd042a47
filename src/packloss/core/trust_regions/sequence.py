"""Trust regions on a sequence's ratio: ``gspo`` (GSPO-token), ``sequence_level`` (an inner region on
the differentiable ``s_i``), ``sequence_ratio_clip`` (PPO's clip on ``s_i``) and ``geo_mean`` (GMPO)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor

from packloss.core.dtypes import finite_exp
from packloss.core.trust_regions.base import (
    PolicyTerms,
    Surrogate,
    TrustRegion,
    check_clip,
    nonnegative,
    register_trust_region,
    required,
)
from packloss.core.trust_regions.clipping import PPOClip, clipped

__all__ = ["GSPO", "SequenceLevel", "SequenceRatioClip", "GMPO"]


def _sequence_log_ratio(t: PolicyTerms) -> tuple[Tensor, Tensor]:
    """``(log s_i [S], count [S])`` with ``log s_i = mean_{u∈i} log r_u`` over the members, differentiable."""
    return t.segments.mean(t.log_r, t.m)


@register_trust_region("gspo")
@dataclass(frozen=True)
class GSPO(TrustRegion):
    """GSPO-token (Zheng et al. 2025): PPO clip on ``s_t = sg(s_i) · exp(trn − sg(trn))`` with the
    sequence ratio ``s_i = exp(mean_{t∈i} log_r)``. Metrics ``seq_ratio_mean``/``_min``/``_max``."""

    reads_token_ratio: ClassVar[bool] = False
    token_local: ClassVar[bool] = False

    clip_low: float = 3e-4
    clip_high: float = 4e-4

    def check(self) -> None:
        super().check()
        check_clip(self)

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        seq_log_r, count = t.segments.mean(t.log_r.detach(), t.m)  # [S]
        seq_ratio = finite_exp(seq_log_r)  # [S]
        trn_m = torch.where(t.m, t.trn, 0.0)
        token_ratio = t.segments.broadcast(seq_ratio) * torch.exp(trn_m - trn_m.detach())  # [N]
        surrogate, metrics = clipped(token_ratio, t.a, self.clip_low, self.clip_high)
        return Surrogate(torch.where(t.m, surrogate, 0.0), metrics, sequence_ratio=(seq_ratio, count > 0))


@register_trust_region("sequence_level")
@dataclass(frozen=True)
class SequenceLevel(TrustRegion):
    """An inner token-level region on the sequence ratio (TRL's ``importance_sampling_level="sequence"``)::

        s_i = exp(mean_{u∈i} log r_u)      (differentiable: ∂s_i/∂trn_u = s_i / n_i)
        J_t = inner.surrogate(r_t := s_{i(t)})

    Unlike GSPO-token the gradient of every token's term flows to all tokens of its sequence, so the
    two differ when the tokens of a sequence carry different weights. Metrics: the inner region's and
    ``seq_ratio_*``.
    """

    reads_token_ratio: ClassVar[bool] = False
    token_local: ClassVar[bool] = False

    inner: TrustRegion = PPOClip()

    def check(self) -> None:
        if not isinstance(self.inner, TrustRegion) or isinstance(self.inner, SequenceLevel):
            raise TypeError(f"SequenceLevel.inner must be a token-level TrustRegion, got {type(self.inner).__name__}")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        seq_log_r, count = _sequence_log_ratio(t)  # [S]
        log_s = torch.where(t.m, t.segments.broadcast(seq_log_r), 0.0)  # [N]
        result = self.inner.surrogate(replace(t, log_r=log_s, r=finite_exp(log_s)))
        result.sequence_ratio = (finite_exp(seq_log_r.detach()), count > 0)
        return result


@register_trust_region("sequence_ratio_clip")
@dataclass(frozen=True)
class SequenceRatioClip(PPOClip):
    """PPO's clip (with dual clip) on the sequence ratio with its full gradient (OpenRLHF's ``"gspo"``)::

        s_i = exp(Σ_{t∈i} log r_t / max(n_i, 1)),   J_t = min(s_i A_t, clip(s_i, 1−ε_low, 1+ε_high) A_t)

    ``∇s_i = s_i · mean_{u∈i} ∇log π_θ(y_u)``: every token's term moves every member of its sequence
    (GSPO-token detaches ``s_i``). No clamp. Metrics ``clip_ratio`` and ``seq_ratio_*``.
    """

    reads_token_ratio: ClassVar[bool] = False
    token_local: ClassVar[bool] = False

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        seq_log_r, count = _sequence_log_ratio(t)  # [S], differentiable
        seq_ratio = finite_exp(seq_log_r)  # [S]
        ratio = t.segments.broadcast(seq_ratio)  # [N]
        return self.clipped_with_ratio_metric(t, ratio, sequence_ratio=(seq_ratio.detach(), count > 0))


@register_trust_region("geo_mean")
@dataclass(frozen=True)
class GMPO(TrustRegion):
    """GMPO, Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv:2507.20673); verl's ``geo_mean``::

        ℓ_t  = sgn(A'_t) · min(sgn(A'_t) · log r_t, sgn(A'_t) · clip(log r_t, −ε_low, ε_high))
        ρ_i  = exp(Σ_{t∈i} ℓ_t / (n_i + eps)),   Â_i = Σ_{t∈i} A'_t / (n_i + eps)
        J_t  = Â_i · ρ_i                 for every member t of sequence i

    so with ``normalize="sequence_mean"`` the loss is the paper's. A token with ``A' = 0`` has
    ``ℓ_t = 0`` (as verl); ``eps`` (default 0) is added to both denominators. Metrics
    ``clip_frac_high`` / ``_low`` (``log r`` outside ``[−ε_low, ε_high]`` with ``A' > 0`` / ``< 0``),
    ``is_masked`` (the clip binds) and ``seq_ratio_*`` of ``ρ_i``.
    """

    reads_token_ratio: ClassVar[bool] = False
    token_local: ClassVar[bool] = False

    clip_low: float = 0.2
    clip_high: float = 0.2
    eps: float = 0.0

    def check(self) -> None:
        super().check()
        required(self)
        nonnegative(self, "clip_low", "clip_high", "eps")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        log_r, a = t.log_r, t.a  # [N], both 0 off the members
        high = (a > 0) & (log_r > self.clip_high)  # the clip binds from above
        low = (a < 0) & (log_r < -self.clip_low)  # ... from below
        clipped_log_r = torch.where(high, self.clip_high, torch.where(low, -self.clip_low, log_r))
        clipped_log_r = torch.where(t.m & (a != 0), clipped_log_r, 0.0)  # [N]
        sums = t.segments.sum(torch.stack([clipped_log_r, a, t.m.to(log_r.dtype)], dim=1))  # [S, 3], one reduction
        count = sums[:, 2].detach()  # [S]
        denominator = torch.where(count > 0, count + self.eps, 1.0)  # [S]
        seq_ratio = torch.exp(sums[:, 0] / denominator)  # [S]
        seq_adv = sums[:, 1] / denominator  # [S]
        objective = torch.where(t.m, t.segments.broadcast(seq_adv * seq_ratio), 0.0)  # [N]
        outside = (log_r > self.clip_high) | (log_r < -self.clip_low)
        metrics = {"is_masked": high | low, "clip_frac_high": outside & (a > 0), "clip_frac_low": outside & (a < 0)}
        return Surrogate(objective, metrics, sequence_ratio=(seq_ratio, count > 0))
