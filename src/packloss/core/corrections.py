"""Rollout corrections: importance weights for the mismatch between the policy that sampled the
tokens (π_rollout, ``inference_logprobs``) and the one the trust region is measured against.

The weight is constant in θ and multiplies the policy-gradient term only (as TRL's
``vllm_importance_sampling_*`` and verl's rollout correction do). Per token, with members ``m``::

    log ρ_t = where(m, old − inf, 0)          (an objective with ratio="old" and an old stream)
            | where(m, sg(trn) − inf, 0)      (otherwise: no old stream, or ratio="rollout")
    level="token":    ρ_t = exp(log ρ_t)
    level="sequence": ρ_t = exp(Σ_{u∈i} log ρ_u)   (sequence_agg="sum": the product of the ratios)
                          | exp(mean_{u∈i} log ρ_u) (sequence_agg="mean": their geometric mean)
    mode="truncate":  c_t = clamp(ρ_t, low, high)      (TIS; ``low=None``: no lower clamp)
    mode="mask":      c_t = where(low ≤ ρ_t ≤ high, ρ_t, 0)   (MIS / IcePop-style band; ``low=None``: 0)

With ``weighted=False`` a masking correction keeps weight 1 inside the band (a pure token filter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from packloss.core.components import upcast
from packloss.core.segments import broadcast, segment_mean, segment_sum

__all__ = ["RolloutCorrection"]

LEVELS = ("token", "sequence")
MODES = ("truncate", "mask")
SEQUENCE_AGGS = ("sum", "mean")


@dataclass(frozen=True)
class RolloutCorrection:
    """Truncated (TIS) or masked (MIS) importance sampling for the rollout mismatch (module doc).

    Args:
        level: ``"token"`` or ``"sequence"``.
        mode: ``"truncate"`` or ``"mask"``.
        high: upper cap / band edge, ``> 0``.
        low: lower clamp / band edge in ``[0, high)``, or None.
        sequence_agg: ``"sum"`` (product of the token ratios) or ``"mean"`` (geometric mean).
        weighted: ``mode="mask"`` only: multiply by ``ρ`` inside the band (True) or by 1 (False).

    Metrics: ``rollout_is_weight`` (mean ``c``) and ``rollout_is_truncated`` (``ρ > high`` or
    ``ρ < low``, truncate) or ``rollout_is_masked`` (outside the band, mask), over the members.
    """

    level: Literal["token", "sequence"] = "token"
    mode: Literal["truncate", "mask"] = "truncate"
    high: float = 2.0
    low: float | None = None
    sequence_agg: Literal["sum", "mean"] = "sum"
    weighted: bool = True

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("level", self.level, LEVELS),
            ("mode", self.mode, MODES),
            ("sequence_agg", self.sequence_agg, SEQUENCE_AGGS),
        ):
            if value not in allowed:
                raise ValueError(f"RolloutCorrection.{name} must be one of {allowed}, got {value!r}")
        for name in ("high", "low"):
            value = getattr(self, name)
            if value is None and name == "low":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"RolloutCorrection.{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value):
                raise ValueError(f"RolloutCorrection.{name} must be finite, got {value}")
        if not self.high > 0:
            raise ValueError(f"RolloutCorrection.high must be > 0, got {self.high}")
        if self.low is not None and not 0 <= self.low < self.high:
            raise ValueError(f"RolloutCorrection.low must be in [0, high) or None, got {self.low}")
        if not isinstance(self.weighted, bool):
            raise TypeError(f"RolloutCorrection.weighted must be a bool, got {type(self.weighted).__name__}")

    def log_ratio(self, inputs, ratio: str, m: Tensor) -> Tensor:
        """``log ρ_t [N]`` before the level's aggregation, detached, zero off the members."""
        inf = getattr(inputs, "inference_logprobs", None)
        if inf is None:
            raise ValueError("a RolloutCorrection needs inference_logprobs, got None")
        old = getattr(inputs, "old_logprobs", None)
        num = old if (ratio == "old" and old is not None) else inputs.trainer_logprobs
        return torch.where(m, upcast(num.detach()) - upcast(inf.detach()), 0.0)

    def weights(
        self, inputs, ratio: str, m: Tensor, seq_ids: Tensor, num_seqs: int
    ) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
        """``(c [N], metrics)``: the correction weights (detached) and their named metrics."""
        log_rho = self.log_ratio(inputs, ratio, m)  # [N]
        if self.level == "sequence":
            if self.sequence_agg == "sum":
                seq = segment_sum(log_rho, seq_ids, num_seqs)  # [S]
            else:
                seq = segment_mean(log_rho, m, seq_ids, num_seqs)[0]  # [S]
            log_rho = broadcast(seq, seq_ids)  # [N]
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
