"""The policy-gradient skeleton: one per-token loss, parameterised (DESIGN.md §2).

Per token ``t`` with member mask ``m`` and optional weights ``w``::

    log_r  = where(m, trn − inf, 0)              # masked BEFORE exp: a non-member never overflows
    r      = exp(log_r)                          # importance ratio, trainer vs. inference policy
    A      = adv                                 # advantage "shipped"
           | where(m, ref − trn, 0).detach()     # advantage "ref_kl" (reverse KL / on-policy distillation)
    dp     = exp(trn) − exp(inf)                 # probability difference, on masked values
    keep   = m & ~trust_region_masked(A, dp)
    loss_t = (−(keep · adv_tau · A · r) + kl_tau · m · log_r²) · w
    loss   = Σ_t loss_t

REINFORCE gives ∇KL(π_θ‖π_ref) = −E[(log π_ref − log π_θ) ∇log π_θ], so reverse-KL distillation is
this same policy gradient with a live advantage. The historical prime-rl loss types are three
instances: :data:`DPPO`, :data:`IPO` and :data:`REF_KL`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from packloss.component import LossInputs, LossOutputs, make_outputs

__all__ = ["PGParams", "pg_loss", "DPPO", "IPO", "REF_KL"]

_ADVANTAGES = ("shipped", "ref_kl")
_TRUST_REGIONS = ("dppo", "ipo", "one_sided")


@dataclass(frozen=True)
class PGParams:
    """One instance of the policy-gradient skeleton; calling it computes :func:`pg_loss`.

    Args:
        advantage: ``"shipped"`` (the advantages stream) or ``"ref_kl"`` (live ``ref − trn``, detached).
        trust_region: ``"dppo"`` (sign-conditioned probability-difference mask), ``"ipo"``
            (``|dp| > ipo_threshold``) or ``"one_sided"`` (``dp < −one_sided_threshold``).
        adv_tau: coefficient of the policy-gradient term.
        kl_tau: coefficient of the ``log_r²`` trainer/inference drift penalty.
        dppo_mask_low, dppo_mask_high: DPPO thresholds on ``dp`` for ``A ≤ 0`` / ``A > 0``.
        ipo_threshold: IPO threshold on ``|dp|``.
        one_sided_threshold: threshold of the one-sided region.
        metric_prefix: prepended to every metric name (``"ref_kl/"`` for the ref_kl component).
    """

    advantage: str = "shipped"
    trust_region: str = "dppo"
    adv_tau: float = 1.0
    kl_tau: float = 1e-3
    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2
    ipo_threshold: float = 0.1
    one_sided_threshold: float = 0.2
    metric_prefix: str = ""

    def __post_init__(self) -> None:
        if self.advantage not in _ADVANTAGES:
            raise ValueError(f"advantage must be one of {_ADVANTAGES}, got {self.advantage!r}")
        if self.trust_region not in _TRUST_REGIONS:
            raise ValueError(f"trust_region must be one of {_TRUST_REGIONS}, got {self.trust_region!r}")
        for name in ("dppo_mask_low", "dppo_mask_high", "ipo_threshold", "one_sided_threshold"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not isinstance(self.metric_prefix, str):
            raise TypeError(f"metric_prefix must be a str, got {type(self.metric_prefix).__name__}")

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        return pg_loss(inputs, self)


DPPO = PGParams()
"""prime-rl's default loss: DPPO-Binary TV trust region + Kimi-K2.5 squared-log-ratio KL."""
IPO = PGParams(trust_region="ipo")
"""prime-rl's IPO loss: symmetric trust region ``|dp| > 0.1``."""
REF_KL = PGParams(advantage="ref_kl", trust_region="one_sided", kl_tau=1e-3, metric_prefix="ref_kl/")
"""On-policy distillation: reverse KL to the reference as advantage, one-sided region at 0.2."""


def _advantage(inputs: LossInputs, params: PGParams, trn: Tensor, m: Tensor) -> Tensor:
    """The raw advantage ``A [N]``, zero off the mask, never carrying a gradient."""
    if params.advantage == "ref_kl":
        if inputs.ref_logprobs is None:
            raise ValueError("advantage='ref_kl' needs ref_logprobs, got None")
        ref = inputs.ref_logprobs.detach().to(torch.float32)
        return torch.where(m, ref - trn.detach(), 0.0)
    if inputs.advantages is None:
        raise ValueError("advantage='shipped' needs the advantages stream, got None")
    return torch.where(m, inputs.advantages.detach().to(torch.float32), 0.0)


def _trust_region(params: PGParams, adv: Tensor, dp: Tensor) -> dict[str, Tensor]:
    """``{"is_masked": [N] bool, ...}``: tokens outside the trust region (plus DPPO's two sides)."""
    if params.trust_region == "dppo":
        high = dp > params.dppo_mask_high
        low = dp < -params.dppo_mask_low
        return {
            "is_masked": torch.where(adv > 0, high, low),
            "is_masked_high": (adv > 0) & high,
            "is_masked_low": (adv < 0) & low,
        }
    if params.trust_region == "ipo":
        return {"is_masked": dp.abs() > params.ipo_threshold}
    return {"is_masked": dp < -params.one_sided_threshold}


def pg_loss(inputs: LossInputs, params: PGParams) -> LossOutputs:
    """The skeleton's summed loss over the members of ``inputs.loss_mask`` and its metrics.

    Shapes: every stream ``[N]``; returns a scalar loss (float32) and metrics (scalars, or ``[S]``
    with ``per_sequence_metrics``). Metrics are unweighted means over the component's members:
    ``masked_mismatch_kl`` (dropped members), ``unmasked_mismatch_kl`` (kept), ``is_masked``; DPPO
    adds ``is_masked_high``, ``is_masked_low``, ``masked_advantage_positive``/``_negative`` (over
    dropped members); advantage ``ref_kl`` adds ``ref_kl`` (mean of ``ref − trn``). All names carry
    ``params.metric_prefix``. ``mismatch_kl = r − log_r − 1``.
    """
    m = inputs.loss_mask  # [N] bool
    trn = inputs.trainer_logprobs.to(torch.float32)  # [N]
    inf = inputs.inference_logprobs.detach().to(torch.float32)  # [N]
    log_r = torch.where(m, trn - inf, 0.0)  # [N]
    r = torch.exp(log_r)  # [N]
    adv = _advantage(inputs, params, trn, m)  # [N]
    dp = torch.exp(torch.where(m, trn.detach(), 0.0)) - torch.exp(torch.where(m, inf, 0.0))  # [N]
    regions = _trust_region(params, adv, dp)
    is_masked = regions["is_masked"]
    keep = m & ~is_masked

    pg = keep * (params.adv_tau * adv) * r
    kl = m * log_r**2
    per_token = -pg + params.kl_tau * kl  # [N]
    if inputs.loss_weights is not None:
        per_token = per_token * torch.where(m, inputs.loss_weights.to(torch.float32), 0.0)
    loss = per_token.sum()

    log_r_d, r_d = log_r.detach(), r.detach()
    mismatch_kl = r_d - log_r_d - 1  # [N]
    drop = m & is_masked
    named = {
        "masked_mismatch_kl": (mismatch_kl, drop),
        "unmasked_mismatch_kl": (mismatch_kl, keep),
        "is_masked": (is_masked, m),
    }
    if params.trust_region == "dppo":
        named["is_masked_low"] = (regions["is_masked_low"], m)
        named["is_masked_high"] = (regions["is_masked_high"], m)
        named["masked_advantage_positive"] = (adv > 0, drop)
        named["masked_advantage_negative"] = (adv < 0, drop)
    if params.advantage == "ref_kl":
        named["ref_kl"] = (adv, m)
    return make_outputs(inputs, loss, named, params.metric_prefix)
