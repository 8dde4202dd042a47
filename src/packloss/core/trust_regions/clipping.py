"""Clipped and gated trust regions: PPO's family (``ppo_clip`` with dual clip, ``cispo``, ``gspo``) and
the soft / geometric variants (``sapo``, ``geo_mean``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from packloss.core.segments import broadcast, segment_mean, segment_sum
from packloss.core.trust_regions.base import (
    PolicyTerms,
    Surrogate,
    TrustRegion,
    _clamped_ratio,
    _nonnegative,
    _positive,
    _required,
    register_trust_region,
)

__all__ = ["PPOClip", "CISPO", "GSPO", "SAPO", "GMPO"]


def _check_clip(region: TrustRegion) -> None:
    if not 0 <= region.clip_low < 1:
        raise ValueError(f"{type(region).__name__}.clip_low must be in [0, 1), got {region.clip_low}")
    _nonnegative(region, "clip_high")


def _clip_metrics(ratio: Tensor, a: Tensor, low: float, high: float) -> dict[str, Tensor]:
    """Members whose gradient the clip zeroes: ``A<0 & r<1−ε_low``, ``A>0 & r>1+ε_high``."""
    r = ratio.detach()
    return {"clip_frac_low": (a < 0) & (r < 1 - low), "clip_frac_high": (a > 0) & (r > 1 + high)}


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
        _check_clip(self)
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            raise ValueError(f"PPOClip.dual_clip_c must be > 1, got {self.dual_clip_c}")

    def clipped(self, ratio: Tensor, a: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``(J [N], metrics)`` of the clipped surrogate of ``ratio`` (token or sequence ratio)."""
        surrogate = torch.minimum(ratio * a, ratio.clamp(1 - self.clip_low, 1 + self.clip_high) * a)
        metrics = _clip_metrics(ratio, a, self.clip_low, self.clip_high)
        is_masked = metrics["clip_frac_low"] | metrics["clip_frac_high"]
        if self.dual_clip_c is not None:
            surrogate = torch.where(a < 0, torch.maximum(surrogate, self.dual_clip_c * a), surrogate)
            metrics["dual_clip_frac"] = (a < 0) & (ratio.detach() > self.dual_clip_c)
            is_masked = is_masked | metrics["dual_clip_frac"]
        metrics["is_masked"] = is_masked
        return surrogate, metrics

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        surrogate, metrics = self.clipped(t.r, t.a)
        return Surrogate(torch.where(t.m, surrogate, 0.0), metrics)


@register_trust_region("cispo")
@dataclass(frozen=True)
class CISPO(TrustRegion):
    """MiniMax-M1: ``J = sg(clip(r, 1−ε_low, 1+ε_high)) · A' · trn`` (REINFORCE with a detached,
    clipped importance weight; no token is dropped)."""

    clip_low: float = 0.2
    clip_high: float = 0.2

    def check(self) -> None:
        super().check()
        _check_clip(self)

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        weight = t.r.clamp(1 - self.clip_low, 1 + self.clip_high).detach()
        objective = torch.where(t.m, weight * t.a * torch.where(t.m, t.trn, 0.0), 0.0)
        return Surrogate(objective, _clip_metrics(t.r, t.a, self.clip_low, self.clip_high))


@register_trust_region("gspo")
@dataclass(frozen=True)
class GSPO(TrustRegion):
    """GSPO-token (Zheng et al. 2025): PPO clip on ``s_t = sg(s_i) · exp(trn − sg(trn))`` with the
    sequence ratio ``s_i = exp(mean_{t∈i} log_r)``. Metrics ``seq_ratio_mean``/``_min``/``_max``."""

    clip_low: float = 3e-4
    clip_high: float = 4e-4

    def check(self) -> None:
        super().check()
        _check_clip(self)

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        seq_log_r, count = segment_mean(t.log_r.detach(), t.m, t.seq_ids, t.num_seqs)  # [S]
        seq_ratio = torch.exp(seq_log_r)  # [S]
        trn_m = torch.where(t.m, t.trn, 0.0)
        token_ratio = broadcast(seq_ratio, t.seq_ids) * torch.exp(trn_m - trn_m.detach())  # [N]
        surrogate, metrics = PPOClip(self.clip_low, self.clip_high).clipped(token_ratio, t.a)
        return Surrogate(torch.where(t.m, surrogate, 0.0), metrics, sequence_ratio=(seq_ratio, count > 0))


@register_trust_region("sapo")
@dataclass(frozen=True)
class SAPO(TrustRegion):
    """SAPO, Soft Adaptive Policy Optimization (Gao et al. 2025, arXiv:2511.20347); verl's ``sapo``.

    A smooth sigmoid gate replaces the hard clip::

        J_t = f_τ(r_t) · A'_t,   f_τ(x) = (4/τ) · σ(τ (x − 1)),   τ = τ_pos if A'_t > 0 else τ_neg

    so ``∇J_t = 4 σ(1 − σ) · r_t A'_t ∇log π_θ``: the plain IS gradient at ``r = 1``, decaying smoothly
    as ``r`` leaves 1 (faster for the larger ``τ``; the paper takes ``τ_neg > τ_pos`` to damp
    negative-advantage tokens). Defaults are verl's ``actor.tau_pos = 1.0``, ``actor.tau_neg = 1.05``.

    As verl: ``r = exp(clamp(log_r, −20, 20))`` (the paper does not clamp; no gradient past ±20), and
    ``A' = 0`` takes ``τ_neg``. verl always aggregates ``sapo`` by ``seq-mean-token-mean`` (its
    ``loss_agg_mode`` is ignored), which is ``normalize="sequence_mean"`` here; verl's ``old_log_prob``
    is ``t.base`` (the objective's ``ratio``). Metric ``soft_gate``: the gradient's factor
    ``4 σ(1 − σ) ∈ (0, 1]`` relative to the IS gradient. No token is dropped.
    """

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def check(self) -> None:
        super().check()
        _required(self)
        _positive(self, "tau_pos", "tau_neg")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        # filled, not torch.where(cond, float, float): that makes float32 and loses τ's digits in float64
        tau = torch.full_like(t.trn.detach(), self.tau_neg).masked_fill(t.a > 0, self.tau_pos)  # [N]
        gate = torch.sigmoid(tau * (_clamped_ratio(t) - 1))  # [N]
        objective = torch.where(t.m, (4 / tau) * gate * t.a, 0.0)
        g = gate.detach()
        return Surrogate(objective, {"soft_gate": 4 * g * (1 - g)})


@register_trust_region("geo_mean")
@dataclass(frozen=True)
class GMPO(TrustRegion):
    """GMPO, Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv:2507.20673); verl's ``geo_mean``.

    The clip acts on the token log-ratios, pessimistically for the sign of the advantage, and the
    objective is the geometric mean of the clipped ratios over the sequence's members::

        ℓ_t  = sgn(A'_t) · min(sgn(A'_t) · log r_t, sgn(A'_t) · clip(log r_t, −ε_low, ε_high))
        ρ_i  = exp(Σ_{t∈i} ℓ_t / (n_i + eps)),   Â_i = Σ_{t∈i} A'_t / (n_i + eps)
        J_t  = Â_i · ρ_i                 for every member t of sequence i

    so the token mean of ``J`` over sequence ``i`` is the paper's ``Â_i · ρ_i``: with
    ``normalize="sequence_mean"`` the loss is the paper's (and verl's ``mean`` over the rows, which
    also counts rows without members). A token with ``A' = 0`` contributes ``ℓ_t = 0`` (as verl).

    ``eps`` (default 0: the paper's exact mean; a sequence without members is never divided by 0) is
    added to both denominators. verl's code adds ``1e-8`` to a float32 count, where it rounds away for
    any sequence with members, so the default is what verl computes. No clamp of ``log r``.
    The defaults ``ε_low = ε_high = 0.2`` are verl's ``clip_ratio_low``/``_high``; the paper uses 0.4
    (ratio range ``(e^−0.4, e^0.4)``). verl's ``old_log_prob`` is ``t.base``. Metrics
    ``clip_frac_high`` / ``clip_frac_low``: members with ``log r`` outside ``[−ε_low, ε_high]`` and
    ``A' > 0`` / ``A' < 0`` (verl's ``pg_clipfrac`` / ``pg_clipfrac_lower``); ``is_masked``: members
    whose clip binds (their ``ℓ_t`` carries no gradient); ``seq_ratio_*`` of ``ρ_i``.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    eps: float = 0.0

    def check(self) -> None:
        super().check()
        _required(self)
        _nonnegative(self, "clip_low", "clip_high", "eps")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        log_r, a = t.log_r, t.a  # [N], both 0 off the members
        high = (a > 0) & (log_r > self.clip_high)  # the clip binds from above
        low = (a < 0) & (log_r < -self.clip_low)  # ... from below
        clipped_log_r = torch.where(high, self.clip_high, torch.where(low, -self.clip_low, log_r))
        clipped_log_r = torch.where(t.m & (a != 0), clipped_log_r, 0.0)  # [N]
        count = segment_sum(t.m.to(log_r.dtype), t.seq_ids, t.num_seqs)  # [S]
        denominator = torch.where(count > 0, count + self.eps, 1.0)  # [S]
        seq_ratio = torch.exp(segment_sum(clipped_log_r, t.seq_ids, t.num_seqs) / denominator)  # [S]
        seq_adv = segment_sum(a, t.seq_ids, t.num_seqs) / denominator  # [S]
        objective = torch.where(t.m, broadcast(seq_adv * seq_ratio, t.seq_ids), 0.0)  # [N]
        outside = (log_r > self.clip_high) | (log_r < -self.clip_low)
        metrics = {"is_masked": high | low, "clip_frac_high": outside & (a > 0), "clip_frac_low": outside & (a < 0)}
        return Surrogate(objective, metrics, sequence_ratio=(seq_ratio, count > 0))
