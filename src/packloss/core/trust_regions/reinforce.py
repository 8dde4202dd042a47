"""REINFORCE-style regions: ``gpg`` (plain ``A · log π``) and ``topr`` (tapered off-policy REINFORCE)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from packloss.core.segments import broadcast, segment_sum
from packloss.core.trust_regions.base import (
    PolicyTerms,
    Surrogate,
    TrustRegion,
    _nonnegative,
    _positive,
    _required,
    _trn,
    register_trust_region,
)

__all__ = ["GPG", "TOPR"]


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

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        return Surrogate(torch.where(t.m, t.a * _trn(t), 0.0), {})


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

    low: float = 0.0
    high: float = 1.0

    def check(self) -> None:
        super().check()
        _required(self)
        _nonnegative(self, "low")
        _positive(self, "high")
        if not self.low <= self.high:
            raise ValueError(f"TOPR.low must be <= TOPR.high, got {self.low} > {self.high}")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        log_seq_ratio = segment_sum(t.log_r.detach(), t.seq_ids, t.num_seqs)  # [S]; log_r is 0 off the members
        log_high = math.log(self.high)
        weight = torch.exp(log_seq_ratio.clamp(max=log_high)).clamp(min=self.low)  # [S]
        negative = t.a < 0  # [N]
        token_weight = torch.where(negative, broadcast(weight, t.seq_ids), 1.0)  # [N]
        objective = torch.where(t.m, token_weight * t.a * _trn(t), 0.0)
        log_seq_ratio_t = broadcast(log_seq_ratio, t.seq_ids)  # [N]
        metrics = {
            "truncated_frac_high": negative & (log_seq_ratio_t > log_high),
            "truncated_frac_low": negative & (torch.exp(log_seq_ratio_t) < self.low),
            "negative_is_weight": (token_weight, t.m & negative),
        }
        return Surrogate(objective, metrics)
