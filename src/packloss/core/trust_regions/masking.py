"""Trust regions that drop tokens: prime-rl's family (``dppo``, ``ipo``, ``one_sided``, ``icepop_log``),
``none``, ``icepop``, and verl's DPPO-Binary losses (``dppo_tv``, ``dppo_kl``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from packloss.core.trust_regions.base import (
    PolicyTerms,
    Surrogate,
    TrustRegion,
    clamped_ratio,
    masked,
    member_trn,
    nonnegative,
    positive,
    register_trust_region,
    required,
)

__all__ = ["DPPOMask", "IPOMask", "OneSided", "NoRegion", "IcePop", "IcePopLogBand", "DPPOTV", "DPPOKL"]


@register_trust_region("dppo")
@dataclass(frozen=True)
class DPPOMask(TrustRegion):
    """prime-rl's DPPO-Binary TV: drop ``A > 0 & dp > high`` and ``A ≤ 0 & dp < −low``
    (``dp = π_θ − π_base``). Metrics ``is_masked_high``/``_low``, ``masked_advantage_positive``/
    ``_negative`` (over the dropped tokens)."""

    low: float = 0.2
    high: float = 0.2

    def check(self) -> None:
        super().check()
        nonnegative(self, "low", "high")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        dp = t.prob_diff()
        high, low = dp > self.high, dp < -self.low
        drop = torch.where(t.adv > 0, high, low)
        dropped = t.m & drop
        return masked(
            t,
            drop,
            {
                "is_masked_high": (t.adv > 0) & high,
                "is_masked_low": (t.adv < 0) & low,
                "masked_advantage_positive": (t.adv > 0, dropped),
                "masked_advantage_negative": (t.adv < 0, dropped),
            },
        )


@register_trust_region("ipo")
@dataclass(frozen=True)
class IPOMask(TrustRegion):
    """prime-rl's IPO (#2951 era): drop ``|dp| > threshold``."""

    threshold: float = 0.1

    def check(self) -> None:
        super().check()
        nonnegative(self, "threshold")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        return masked(t, t.prob_diff().abs() > self.threshold, {})


@register_trust_region("one_sided")
@dataclass(frozen=True)
class OneSided(TrustRegion):
    """Drop ``dp < −threshold`` (prime-rl's ref_kl loss)."""

    threshold: float = 0.2

    def check(self) -> None:
        super().check()
        nonnegative(self, "threshold")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        return masked(t, t.prob_diff() < -self.threshold, {})


@register_trust_region("none")
@dataclass(frozen=True)
class NoRegion(TrustRegion):
    """``J = a · r``: the plain importance-weighted policy gradient (REINFORCE on-policy)."""

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        return masked(t, torch.zeros_like(t.m), {})


@register_trust_region("icepop")
@dataclass(frozen=True)
class IcePop(TrustRegion):
    """Drop tokens whose ratio leaves ``[low, high]``."""

    low: float = 0.5
    high: float = 5.0

    def check(self) -> None:
        super().check()
        if not 0 <= self.low < self.high:
            raise ValueError(f"IcePop needs 0 <= low < high, got {self.low}, {self.high}")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        r = t.r.detach()
        low, high = r < self.low, r > self.high
        return masked(t, low | high, {"is_masked_low": low, "is_masked_high": high})


@register_trust_region("icepop_log")
@dataclass(frozen=True)
class IcePopLogBand(TrustRegion):
    """prime-rl's IcePop band (#3526): keep a member iff ``log(ratio_low) ≤ log_r ≤ log(ratio_high)``::

        J_t = keep_t · a_t · exp(where(keep_t, log_r_t, 0))

    Both bounds included, compared in log space with the bounds' logs in ``log_r``'s dtype (a ratio
    read back from ``log(0.2)`` sits on the bound; :class:`IcePop` compares ``exp(log r)`` and drops
    it); the ratio of a dropped token is replaced before ``exp`` (an overflowing one gives no NaN).
    Metric ``is_masked``.
    """

    reads_token_ratio: ClassVar[bool] = False

    ratio_low: float = 0.2
    ratio_high: float = 5.0

    def check(self) -> None:
        super().check()
        if not 0 < self.ratio_low <= self.ratio_high:
            raise ValueError(
                f"IcePopLogBand needs 0 < ratio_low <= ratio_high, got {self.ratio_low}, {self.ratio_high}"
            )

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        log_r = t.log_r.detach()  # [N], 0 off the members
        # the bounds' logs in log_r's dtype, as prime-rl takes them, without a host copy
        low = torch.full((), self.ratio_low, dtype=log_r.dtype, device=log_r.device).log()
        high = torch.full((), self.ratio_high, dtype=log_r.dtype, device=log_r.device).log()
        drop = (log_r < low) | (log_r > high)  # [N]
        keep = t.m & ~drop
        ratio = torch.exp(torch.where(keep, t.log_r, 0.0))  # masked before exp
        return Surrogate(torch.where(keep, t.a * ratio, 0.0), {"is_masked": drop})


@dataclass(frozen=True)
class _DPPOBinary(TrustRegion):
    """verl's DPPO-Binary losses (arXiv:2602.04879): REINFORCE with a truncated, detached IS weight
    (in place of a dual clip, after the paper's Section 5.4, as verl notes) on the tokens the
    divergence keeps::

        J_t = keep_t · sg(min(r_t, ratio_cap)) · A'_t · log π_θ(y_t)

    ``r = exp(clamp(log_r, −20, 20))`` as verl. ``keep_t`` (subclasses) is decided by the sign of
    ``A'`` (``A' = 0`` takes the negative side, as verl). ``low``/``high`` are verl's
    ``clip_ratio_low``/``_high`` (divergence thresholds here, default 0.2); ``ratio_cap`` is verl's
    ``clip_ratio_c``: its ``ActorConfig`` default 3.0 is what verl runs with (the loss's own fallback,
    20.0, applies only to a config without the key; verl's comment recommends a large cap). verl's
    ``old_log_prob`` (``π_old``, ``p_old``) is ``t.base``. Metrics: ``is_masked`` (verl's
    ``pg_clipfrac``), ``is_masked_high`` / ``_low`` (``A' > 0`` / ``A' < 0`` among them) and
    ``is_truncated``: kept members with ``r > ratio_cap`` (verl's ``pg_clipfrac_lower``).
    """

    reads_token_ratio: ClassVar[bool] = False

    low: float = 0.2
    high: float = 0.2
    ratio_cap: float = 3.0

    def check(self) -> None:
        super().check()
        required(self)
        nonnegative(self, "low", "high")
        positive(self, "ratio_cap")

    def keep(self, t: PolicyTerms) -> Tensor:
        """Members kept by the divergence (bool ``[N]``)."""
        raise NotImplementedError

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        keep = self.keep(t)  # [N]
        ratio = clamped_ratio(t).detach()  # [N]
        weight = ratio.clamp(max=self.ratio_cap)
        objective = torch.where(t.m & keep, weight * t.a * member_trn(t), 0.0)
        drop = t.m & ~keep
        metrics = {
            "is_masked": drop,
            "is_masked_high": drop & (t.a > 0),
            "is_masked_low": drop & (t.a < 0),
            "is_truncated": keep & (ratio > self.ratio_cap),
        }
        return Surrogate(objective, metrics)


def _probs(t: PolicyTerms) -> tuple[Tensor, Tensor]:
    """``(p, p_old) = (exp(trn), exp(base))`` of the sampled tokens on masked values, detached.  ``[N]``."""
    return torch.exp(member_trn(t).detach()), torch.exp(torch.where(t.m, t.base, 0.0))


@register_trust_region("dppo_tv")
@dataclass(frozen=True)
class DPPOTV(_DPPOBinary):
    """DPPO-Binary-TV as verl 0.9.1's ``dppo_tv`` (arXiv:2602.04879, the paper verl cites)::

        keep_t = p − p_old ≤ high    if A'_t > 0
                 p − p_old ≥ −low    otherwise
        J_t    = keep_t · sg(min(r_t, ratio_cap)) · A'_t · log π_θ(y_t)

    with ``p = π_θ(y_t)``, ``p_old = exp(base)``. The same tokens as prime-rl's ``"dppo"``
    (:class:`DPPOMask`), which differs in the surrogate (``r · A'``, no cap); that one is untouched.
    See :class:`_DPPOBinary` for ``r``, the cap, the defaults and the metrics.
    """

    def keep(self, t: PolicyTerms) -> Tensor:
        p, p_old = _probs(t)
        dp = p - p_old  # [N]
        return torch.where(t.a > 0, dp <= self.high, dp >= -self.low)


@register_trust_region("dppo_kl")
@dataclass(frozen=True)
class DPPOKL(_DPPOBinary):
    """DPPO-Binary-KL as verl 0.9.1's ``dppo_kl`` (arXiv:2602.04879, the paper verl cites)::

        D_t    = p_old · log(p_old / p) + (1 − p_old) · log((1 − p_old + 1e-8) / (1 − p + 1e-8))
        keep_t = D_t ≤ high  or  p ≤ p_old     if A'_t > 0
                 D_t ≤ low   or  p ≥ p_old     otherwise
        J_t    = keep_t · sg(min(r_t, ratio_cap)) · A'_t · log π_θ(y_t)

    ``D`` is the KL of the binary distributions (sampled token vs the rest) from π_old to π_θ; the
    ``1e-8`` is verl's guard (not in the paper), kept so the masks agree. A token only drops when it
    moved past the threshold in the direction its advantage pushes. See :class:`_DPPOBinary` for
    ``r``, the cap, the defaults and the metrics.
    """

    def keep(self, t: PolicyTerms) -> Tensor:
        p, p_old = _probs(t)
        base = torch.where(t.m, t.base, 0.0)
        binary_kl = p_old * (base - member_trn(t).detach()) + (1 - p_old) * torch.log(
            (1 - p_old + 1e-8) / (1 - p + 1e-8)
        )
        keep_pos = (binary_kl <= self.high) | (p <= p_old)
        keep_neg = (binary_kl <= self.low) | (p >= p_old)
        return torch.where(t.a > 0, keep_pos, keep_neg)
