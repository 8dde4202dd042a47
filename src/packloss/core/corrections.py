"""Rollout corrections: importance weights for the mismatch between the policy that sampled the
tokens (π_rollout, ``rollout_logprobs``) and the one the trust region is measured against, constant
in θ, on the policy-gradient term only. Formulas and peers: ``docs/objectives.md``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from packloss.core import checks
from packloss.core.segments import Segments

__all__ = ["RolloutCorrection", "GatedCorrection", "OffPolicyMask"]

LEVELS = ("token", "sequence")
MODES = ("truncate", "mask")
SEQUENCE_AGGS = ("sum", "mean")
GATINGS = ("ratio", "binary_kl", "tv")
AGAINST = ("rollout", "old")
_PROB_CLAMP = 1e-6  # the divergence gates clamp probabilities to [1e-6, 1 − 1e-6] (OpenRLHF's)

Metrics = dict[str, tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class RolloutCorrection:
    """Truncated (TIS) or masked (MIS) importance sampling for the rollout mismatch::

        log ρ_t = where(m, num − rollout, 0)        num = old (ratio="old" with an old stream), else sg(trn)
        level="token":    ρ_t = exp(log ρ_t)
        level="sequence": ρ_t = exp(Σ_{u∈i} log ρ_u) (sequence_agg="sum") | exp(mean_{u∈i} log ρ_u) ("mean")
        mode="truncate":  c_t = clamp(ρ_t, low, high)                     (low=None: no lower clamp)
        mode="mask":      c_t = where(low ≤ ρ_t ≤ high, ρ_t or 1 (weighted=False), 0)

    ``high > 0``; ``low`` in ``[0, high)`` or None. Metrics ``rollout_is_weight`` (mean ``c``) and
    ``rollout_is_truncated`` / ``rollout_is_masked`` (outside the band), over the members.
    """

    level: Literal["token", "sequence"] = "token"
    mode: Literal["truncate", "mask"] = "truncate"
    high: float = 2.0
    low: float | None = None
    sequence_agg: Literal["sum", "mean"] = "sum"
    weighted: bool = True

    def __post_init__(self) -> None:
        checks.choice("RolloutCorrection.level", self.level, LEVELS)
        checks.choice("RolloutCorrection.mode", self.mode, MODES)
        checks.choice("RolloutCorrection.sequence_agg", self.sequence_agg, SEQUENCE_AGGS)
        checks.positive("RolloutCorrection.high", self.high)
        if self.low is not None and not 0 <= checks.number("RolloutCorrection.low", self.low) < self.high:
            raise ValueError(f"RolloutCorrection.low must be in [0, high) or None, got {self.low}")
        checks.flag("RolloutCorrection.weighted", self.weighted)

    def weights(self, numerator: Tensor, rollout: Tensor, m: Tensor, segments: Segments) -> tuple[Tensor, Metrics]:
        """``(c [N], metrics)`` from the detached ``numerator`` and ``rollout`` log-probs ``[N]``."""
        log_rho = torch.where(m, numerator - rollout, 0.0)  # [N]
        if self.level == "sequence":
            if self.sequence_agg == "sum":
                seq = segments.sum(log_rho)  # [S]
            else:
                seq = segments.mean(log_rho, m)[0]  # [S]
            log_rho = segments.broadcast(seq)  # [N]
        rho = torch.exp(log_rho)  # [N]
        high = rho > self.high
        low = rho < self.low if self.low is not None else torch.zeros_like(m)
        if self.mode == "truncate":
            c = rho.clamp(min=self.low, max=self.high)
            outside_name = "rollout_is_truncated"
        else:
            inside = ~(high | low)
            c = torch.where(inside, rho if self.weighted else torch.ones_like(rho), 0.0)
            outside_name = "rollout_is_masked"
        c = torch.where(m, c, 0.0)
        return c, {"rollout_is_weight": (c, m), outside_name: (high | low, m)}


@dataclass(frozen=True)
class GatedCorrection(RolloutCorrection):
    """A masking correction that gates on one statistic and weights by the token ratio (OpenRLHF's
    ``is_correction_*`` with ``mode="mask"``)::

        g_u  = ρ_t | exp(mean_{t∈i} log ρ_t)   (gating="ratio", token | sequence)
             | D_t | mean_{t∈i} D_t            (gating="binary_kl" or "tv")
        D_t  = p log(p/q) + (1−p) log((1−p)/(1−q))  (binary_kl)  |  |p − q|  (tv)
        c_t  = where(low ≤ g_{u(t)} ≤ high, ρ_t, 0)

    with ``p = clamp(π_rollout, 1e-6, 1 − 1e-6)`` and ``q`` the numerator's probability, clamped the
    same way. A sequence gate keeps each token's ``ρ_t`` (:class:`RolloutCorrection` weights a
    sequence by its own ratio). Metrics as a masking correction.
    """

    level: Literal["token", "sequence"] = "sequence"
    mode: Literal["truncate", "mask"] = "mask"
    gating: Literal["ratio", "binary_kl", "tv"] = "ratio"

    def __post_init__(self) -> None:
        super().__post_init__()
        checks.choice("GatedCorrection.gating", self.gating, GATINGS)
        if self.mode != "mask" or not self.weighted:
            raise ValueError("GatedCorrection drops the units outside the band: it needs mode='mask', weighted=True")

    def statistic(self, numerator: Tensor, rollout: Tensor, m: Tensor, segments: Segments) -> Tensor:
        """The gated statistic: ``[N]`` per token (``level="token"``) or ``[S]`` per sequence."""
        if self.gating == "ratio":
            log_rho = torch.where(m, numerator - rollout, 0.0)  # [N]
            if self.level == "sequence":
                return torch.exp(segments.mean(log_rho, m)[0])  # [S]
            return torch.exp(log_rho)
        p = torch.exp(torch.where(m, rollout, 0.0)).clamp(_PROB_CLAMP, 1 - _PROB_CLAMP)  # [N]
        q = torch.exp(torch.where(m, numerator, 0.0)).clamp(_PROB_CLAMP, 1 - _PROB_CLAMP)  # [N]
        if self.gating == "binary_kl":
            divergence = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
        else:
            divergence = (p - q).abs()
        if self.level == "sequence":
            return segments.mean(divergence, m)[0]  # [S]
        return divergence

    def keep(self, stat: Tensor) -> Tensor:
        """``low ≤ stat ≤ high`` (NaN is never kept), same shape as ``stat``."""
        kept = stat <= self.high
        return kept if self.low is None else kept & (stat >= self.low)

    def weights(self, numerator: Tensor, rollout: Tensor, m: Tensor, segments: Segments) -> tuple[Tensor, Metrics]:
        kept = self.keep(self.statistic(numerator, rollout, m, segments))  # [N] or [S]
        if self.level == "sequence":
            kept = segments.broadcast(kept)  # [N]
        rho = torch.exp(torch.where(m, numerator - rollout, 0.0))  # [N]
        c = torch.where(m & kept, rho, 0.0)
        return c, {"rollout_is_weight": (c, m), "rollout_is_masked": (~kept, m)}


@dataclass(frozen=True)
class OffPolicyMask:
    """Off-policy sequence masking (DeepSeek-V3.2; TRL's ``off_policy_mask_threshold``): a sequence with
    a negative advantage whose sampler has drifted too far from the trainer gets no policy gradient::

        δ_i   = mean_{t∈i} nan_to_num(base_t − sg(trn_t))    base = rollout | old (sg(trn) without one)
        keep_t = A_t ≥ 0  or  δ_{i(t)} ≤ threshold

    on the policy-gradient term only (a KL penalty still applies). ``A`` is the raw advantage. Metric
    ``off_policy_masked``: the members it drops.
    """

    threshold: float
    against: Literal["rollout", "old"] = "rollout"

    def __post_init__(self) -> None:
        checks.number("OffPolicyMask.threshold", self.threshold)
        checks.choice("OffPolicyMask.against", self.against, AGAINST)

    def keep(self, base: Tensor, trn: Tensor, adv: Tensor, m: Tensor, segments: Segments) -> tuple[Tensor, Metrics]:
        """``(keep [N] bool, metrics)`` from the detached ``base`` and ``trn`` log-probs and ``adv`` ``[N]``."""
        kl = torch.where(m, torch.nan_to_num(base - trn, nan=0.0), 0.0)  # [N]
        drifted = segments.broadcast(segments.mean(kl, m)[0] > self.threshold)  # [N]
        keep = (adv >= 0) | ~drifted
        return keep, {"off_policy_masked": (m & ~keep, m)}
