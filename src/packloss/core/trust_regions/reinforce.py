"""REINFORCE-style regions, detached weights on ``A · log π``: ``gpg`` (none), ``topr`` (tapered
off-policy REINFORCE) and ``vespo`` (a Gamma weight of the sequence ratio)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from packloss.core import checks
from packloss.core.corrections import RolloutCorrection
from packloss.core.trust_regions.base import (
    LOG_RATIO_CLAMP,
    PolicyTerms,
    Surrogate,
    TrustRegion,
    member_trn,
    nonnegative,
    positive,
    register_trust_region,
    required,
)

__all__ = ["GPG", "TOPR", "VESPO"]

_LOG_EPS = math.log(1e-8)  # VESPO's lower clamp of log-weights (TRL's log(1e-8))


@register_trust_region("gpg")
@dataclass(frozen=True)
class GPG(TrustRegion):
    """GPG, Group Policy Gradient (Chu et al. 2025, arXiv:2504.02546); verl's ``gpg``.

    Plain REINFORCE on the sampled tokens, no ratio and no trust region::

        J_t = A'_t · log π_θ(y_t)

    Its loss *value* is ``−A' · trn`` (verl's); its gradient equals ``"none"``'s on-policy. The
    objective's ``ratio`` is not read. GPG's group advantage (with its valid-sample correction) is
    verl's ``gpg`` advantage estimator, outside the loss: ship it as ``advantages``.
    """

    reads_token_ratio: ClassVar[bool] = False

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        return Surrogate(torch.where(t.m, t.a * member_trn(t), 0.0), {})


@register_trust_region("topr")
@dataclass(frozen=True)
class TOPR(TrustRegion):
    """TOPR, Tapered Off-Policy REINFORCE (Le Roux et al. 2025, arXiv:2503.14286). No verl loss mode.

    REINFORCE without IS on positive examples and with a truncated, detached sequence-level IS
    weight on negative ones::

        w_i = [π_θ(y_i) / μ(y_i)]_low^high = clamp(exp(Σ_{t∈i} log r_t), low, high)
        J_t = sg(1 if A'_t ≥ 0 else w_{s(t)}) · A'_t · log π_θ(y_t)

    ``μ`` is the behaviour policy, ``t.base`` (``ratio="rollout"``: π_rollout; ``"old"``: π_old;
    on-policy ``w = 1``: plain REINFORCE). The paper's truncation is ``[·]_0^1`` (the defaults); the
    ratio is the whole sequence's, as in the paper (computed in log space, so it never overflows).
    The sum over a sequence's tokens is ``w_i A'_i log π_θ(y_i)`` (with a sequence-level advantage):
    ``normalize="sequence_sum"`` gives the paper's mean over examples. Metrics: ``truncated_frac_high``
    / ``_low``: negative-advantage members whose ratio is cut to ``high`` / raised to ``low``;
    ``negative_is_weight``: mean ``w`` over the negative-advantage members. No token is dropped.
    """

    reads_token_ratio: ClassVar[bool] = False
    token_local: ClassVar[bool] = False

    low: float = 0.0
    high: float = 1.0

    def check(self) -> None:
        super().check()
        required(self)
        nonnegative(self, "low")
        positive(self, "high")
        if not self.low <= self.high:
            raise ValueError(f"TOPR.low must be <= TOPR.high, got {self.low} > {self.high}")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        log_seq_ratio = t.segments.sum(t.log_r.detach())  # [S]; log_r is 0 off the members
        log_high = math.log(self.high)
        weight = torch.exp(log_seq_ratio.clamp(max=log_high)).clamp(min=self.low)  # [S]
        negative = t.a < 0  # [N]
        token_weight = torch.where(negative, t.segments.broadcast(weight), 1.0)  # [N]
        objective = torch.where(t.m, token_weight * t.a * member_trn(t), 0.0)
        log_seq_ratio_t = t.segments.broadcast(log_seq_ratio)  # [N]
        metrics = {
            "truncated_frac_high": negative & (log_seq_ratio_t > log_high),
            "truncated_frac_low": negative & (torch.exp(log_seq_ratio_t) < self.low),
            "negative_is_weight": (token_weight, t.m & negative),
        }
        return Surrogate(objective, metrics)


@register_trust_region("vespo")
@dataclass(frozen=True)
class VESPO(TrustRegion):
    """VESPO (arXiv:2602.10693) as TRL 1.16 computes it: REINFORCE weighted by a Gamma function of the
    sequence's importance weight, detached::

        log w_i = clamp(Σ_{t∈i} clamp(log r_t, ±20) + Σ_{t∈i} clamp(log c_t, log 1e-8, 20), log 1e-8, 20)
        φ_t     = exp(λ + k·log w_i − λ·w_i)     (k, λ = k_pos, λ_pos if A_t ≥ 0 else k_neg, λ_neg;
                                                   λ ≥ 1e-4; φ(1) = 1; NaN/inf → 0)
        J_t     = sg(φ_t) · A'_t · trn_t

    ``c_t`` is the weight of ``correction`` (token-level, or None): VESPO folds the rollout mismatch
    into ``w`` instead of multiplying its loss by ``c``, so its objective carries no correction of its
    own. Metric ``phi``: mean ``φ`` over the members. No token is dropped.
    """

    reads_token_ratio: ClassVar[bool] = False
    token_local: ClassVar[bool] = False

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0
    correction: RolloutCorrection | None = None

    def check(self) -> None:
        for name in ("k_pos", "lambda_pos", "k_neg", "lambda_neg"):
            checks.number(f"VESPO.{name}", getattr(self, name))
        c = self.correction
        if c is not None:
            if not isinstance(c, RolloutCorrection):
                raise TypeError(f"VESPO.correction must be a RolloutCorrection or None, got {type(c).__name__}")
            if c.level != "token":
                raise ValueError(f"VESPO.correction must be token-level, got level={c.level!r}")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        log_r = t.log_r.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N], 0 off the members
        if self.correction is not None:
            if t.rollout is None:
                raise ValueError("VESPO.correction needs the plan's rollout_logprobs, got None")
            c, _ = self.correction.weights(t.numerator(), t.rollout, t.m, t.segments)  # [N]; token level: local
            log_c = torch.log(torch.where(t.m, c, 1.0)).clamp(_LOG_EPS, LOG_RATIO_CLAMP)  # log 0 → log 1e-8
            log_r = log_r + log_c  # one reduction of both sums
        seq = t.segments.sum(log_r)  # [S]
        log_w = t.segments.broadcast(seq.clamp(_LOG_EPS, LOG_RATIO_CLAMP))  # [N]
        nonneg = t.adv >= 0
        # filled, not torch.where(cond, float, float), which would be float32 in a float64 bin
        k = torch.full_like(log_w, self.k_neg).masked_fill(nonneg, self.k_pos)  # [N]
        lam = torch.full_like(log_w, self.lambda_neg).masked_fill(nonneg, self.lambda_pos).clamp_min(1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        objective = torch.where(t.m, phi * t.a * member_trn(t), 0.0)
        return Surrogate(objective, {"phi": (phi, t.m)})
