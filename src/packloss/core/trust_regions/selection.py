"""Trust regions that select their tokens over the whole step: ``clip_cov``, ``kl_cov`` (Cui et al.
2025; verl's loss modes) and ``m2po`` (Zheng et al. 2025). Each is a :class:`StepSelector`: its
statistic reads pre-forward streams only, so ``count_denominators`` selects before the forward and the
engine hands every bin its selection (``PolicyTerms.selected``). The math, how the selection crosses
ranks, and where it differs from verl: ``docs/design.md``, "Step-wide token selection"."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from packloss.core.trust_regions.base import (
    PolicyTerms,
    SelectionStreams,
    StepSelector,
    Surrogate,
    TrustRegion,
    register_trust_region,
)
from packloss.core.trust_regions.clipping import clipped

__all__ = ["ClipCov", "KLCov", "M2PO"]

_F64 = torch.float64


def _check_ratio(region: TrustRegion, name: str) -> None:
    value = getattr(region, name)
    if not 0 < value <= 1:
        raise ValueError(f"{type(region).__name__}.{name} must be in (0, 1], got {value}")


class _Covariance(StepSelector):
    """Clip-Cov and KL-Cov: sums ``[Σ_m A, Σ_m p, M]``, the ``k = max(1, ⌊ρ M⌋)`` members of largest
    covariance ``cov_t = (A_t − Ā)(p_t − p̄)``."""

    num_sums: ClassVar[int] = 3

    @property
    def ratio(self) -> float:
        raise NotImplementedError

    def sums(self, s: SelectionStreams) -> Tensor:
        name = type(self).__name__
        adv, p = s.shipped_advantages(name), s.logprobs(name)  # [N], [N]
        return torch.stack([adv.sum(), p.sum(), s.m.sum(dtype=_F64)])

    def covariance(self, s: SelectionStreams, sums: Tensor) -> Tensor:
        """``cov [N]`` float64, zero off the members."""
        name = type(self).__name__
        adv, p = s.shipped_advantages(name), s.logprobs(name)
        count = sums[2].clamp_min(1)
        return torch.where(s.m, (adv - sums[0] / count) * (p - sums[1] / count), 0.0)

    def bound(self, num_tokens: int) -> int:
        return max(1, math.floor(self.ratio * num_tokens))

    def threshold(self, top: Tensor, sums: Tensor) -> Tensor:
        count = sums[2]
        k = torch.where(count > 0, torch.floor(self.ratio * count).clamp_min(1), 0.0).clamp_max(top.numel())
        kth = top.gather(0, (k - 1).clamp_min(0).long().reshape(1)).squeeze(0)  # the k-th largest score
        return torch.where(k > 0, kth, float("inf"))


@register_trust_region("clip_cov")
@dataclass(frozen=True)
class ClipCov(_Covariance):
    """Clip-Cov over the step, deterministic: PPO clip on the live ratio, and the policy gradient of
    the ``k = max(1, ⌊clip_cov_ratio · M⌋)`` band tokens (``clip_cov_lb < cov < clip_cov_ub``, not
    already clipped at the pre-forward ratio ``r̂``) of **largest** covariance is zeroed (verl draws them
    at random). Defaults are verl's. Metrics ``cov_selected``, ``clip_frac_low``/``_high``, ``is_masked``.
    """

    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    clip_low: float = 0.2
    clip_high: float = 0.2

    @property
    def ratio(self) -> float:
        return self.clip_cov_ratio

    def check(self) -> None:
        super().check()
        _check_ratio(self, "clip_cov_ratio")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"ClipCov needs clip_cov_lb < clip_cov_ub, got {self.clip_cov_lb}, {self.clip_cov_ub}")
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"ClipCov.clip_low must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0:
            raise ValueError(f"ClipCov.clip_high must be >= 0, got {self.clip_high}")

    def scores(self, s: SelectionStreams, sums: Tensor) -> Tensor:
        cov = self.covariance(s, sums)
        p = s.logprobs("ClipCov")
        # r̂: the ratio before the forward; ≠ 1 only for ratio="rollout" with an old stream
        base = s.rollout if s.ratio == "rollout" and s.rollout is not None else p
        r_hat = torch.exp(p - base)  # [N]; both zero off the members
        a = s.adv_coef * s.shipped_advantages("ClipCov")
        clipped = -a * r_hat.clamp(1 - self.clip_low, 1 + self.clip_high) > -a * r_hat  # verl's clip_by_origin
        band = s.m & (cov > self.clip_cov_lb) & (cov < self.clip_cov_ub) & ~clipped
        return torch.where(band, cov, float("-inf"))

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        selected = self.selected(t)
        surrogate, metrics = clipped(t.r, t.a, self.clip_low, self.clip_high)
        metrics["is_masked"] = metrics["is_masked"] | selected
        metrics["cov_selected"] = selected
        return Surrogate(torch.where(t.m & ~selected, surrogate, 0.0), metrics)


@register_trust_region("kl_cov")
@dataclass(frozen=True)
class KLCov(_Covariance):
    """KL-Cov over the step: ``J_t = r A' − ppo_kl_coef · |log r| · [t among the k = max(1,
    ⌊kl_cov_ratio · M⌋) members of largest covariance]``, no clip. Defaults are verl's config. Metrics
    ``cov_selected`` and ``abs_log_ratio`` (mean ``|log r|``, verl's ``ppo_kl``)."""

    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1

    @property
    def ratio(self) -> float:
        return self.kl_cov_ratio

    def check(self) -> None:
        super().check()
        _check_ratio(self, "kl_cov_ratio")
        if not self.ppo_kl_coef >= 0:
            raise ValueError(f"KLCov.ppo_kl_coef must be >= 0, got {self.ppo_kl_coef}")

    def scores(self, s: SelectionStreams, sums: Tensor) -> Tensor:
        return torch.where(s.m, self.covariance(s, sums), float("-inf"))

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        selected = self.selected(t)
        abs_log_r = t.log_r.abs()  # [N]; log_r is zero off the members
        objective = t.a * t.r - self.ppo_kl_coef * torch.where(selected, abs_log_r, 0.0)
        metrics = {"cov_selected": selected, "abs_log_ratio": abs_log_r.detach()}
        return Surrogate(torch.where(t.m, objective, 0.0), metrics)


@register_trust_region("m2po")
@dataclass(frozen=True)
class M2PO(StepSelector):
    """M2PO, the second-moment trust region, over the step: drops the members of largest
    ``x = (old − rollout)²``, the fewest such that the mean ``x`` of the kept members is
    ``≤ m2_threshold`` (AReaL's, default 0.04), and keeps ``J = r A'`` on the rest (no clip). The count
    has no bound below the step's size, so the selection gathers every member's ``x``. Metrics
    ``is_masked``, ``m2`` (mean ``x`` over the members), ``m2_kept`` (over the kept members)."""

    m2_threshold: float = 0.04
    num_sums: ClassVar[int] = 2

    def check(self) -> None:
        super().check()
        if not self.m2_threshold >= 0:
            raise ValueError(f"M2PO.m2_threshold must be >= 0, got {self.m2_threshold}")

    def _x(self, s: SelectionStreams) -> Tensor:
        """``x = (old − rollout)²`` float64, zero off the members.  ``[N]``."""
        if s.old is None or s.rollout is None:
            raise ValueError(
                "M2PO measures log(π_old / π_rollout) before the forward: it needs the plan's old_logprobs and "
                "rollout_logprobs"
            )
        return (s.old - s.rollout) ** 2

    def sums(self, s: SelectionStreams) -> Tensor:
        return torch.stack([self._x(s).sum(), s.m.sum(dtype=_F64)])

    def scores(self, s: SelectionStreams, sums: Tensor) -> Tensor:
        return torch.where(s.m, self._x(s), float("-inf"))

    def bound(self, num_tokens: int) -> int:
        return max(1, num_tokens)

    def threshold(self, top: Tensor, sums: Tensor) -> Tensor:
        total, count = sums[0], sums[1]
        kept_sum = total - torch.cat([top.new_zeros(1), torch.where(top > float("-inf"), top, 0.0).cumsum(0)])
        j = torch.arange(top.numel() + 1, dtype=_F64, device=top.device)  # tokens dropped  [K+1]
        # mean of the kept ≤ τ, without dividing; dropping every member always satisfies it
        ok = (kept_sum <= self.m2_threshold * (count - j)) | (j >= count)
        first = ok.to(torch.int8).argmax()  # the fewest dropped (argmax returns the first maximum)
        kth = top.gather(0, (first - 1).clamp_min(0).reshape(1)).squeeze(0)
        return torch.where(first > 0, kth, float("inf"))

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        dropped = self.selected(t)
        keep = t.m & ~dropped
        x = torch.where(t.m, t.scores, 0.0).to(t.r.dtype)  # [N]
        return Surrogate(keep * t.a * t.r, {"is_masked": dropped, "m2": (x, t.m), "m2_kept": (x, keep)})
