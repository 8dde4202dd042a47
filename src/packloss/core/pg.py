"""The policy-gradient objective: one per-token loss, parameterised by :class:`PGParams`.

Per token ``t`` with member mask ``m``, optional weights ``w``, ``A' = adv_tau · A``::

    log_r  = where(m, trn − inf, 0)              # masked BEFORE exp: a non-member never overflows
    r      = exp(log_r)                          # importance ratio, trainer vs. inference policy
    A      = adv                                 # advantage "shipped"
           | where(m, ref − trn, 0).detach()     # advantage "ref_kl" (reverse KL / on-policy distillation)
    dp     = exp(trn) − exp(inf)                 # probability difference, on masked values
    J_t    = surrogate(trust_region; r, A', ...) # the objective to maximise, see the table below
    loss_t = (−J_t + kl_tau · m · K(log_r) + ref_kl_coef · m · K_ref(ref − trn)) · tis_t

``loss_t`` is the per-token loss of the component; the engine applies weights and normalisation.

=============  ==========================================================================
trust_region   surrogate ``J_t``
=============  ==========================================================================
``dppo``       ``keep · A' · r``, drop ``A>0 & dp > dppo_mask_high`` / ``A≤0 & dp < −dppo_mask_low``
``ipo``        ``keep · A' · r``, drop ``|dp| > ipo_threshold``
``one_sided``  ``keep · A' · r``, drop ``dp < −one_sided_threshold``
``none``       ``A' · r`` (plain importance-weighted policy gradient)
``icepop``     ``keep · A' · r``, drop ``r ∉ [icepop_low, icepop_high]``
``ppo_clip``   ``min(r·A', clip(r, 1−clip_low, 1+clip_high)·A')``; with ``dual_clip_c`` and A<0:
               ``max(that, c·A')``
``cispo``      ``sg(clip(r, 1−clip_low, 1+clip_high)) · A' · trn`` (no token dropped)
``gspo``       PPO clip on ``s_t = sg(s_i) · exp(trn − sg(trn))``, ``s_i = exp(mean_{t∈i, m} log_r)``
=============  ==========================================================================

KL estimators ``K(x)`` take ``x = log(π_other / π_sampler)`` and estimate ``KL(π_sampler ‖ π_other)``:
``squared_log_ratio`` ``x²`` (prime-rl's term), ``k1`` ``−x``, ``k2`` ``½x²``, ``k3`` ``eˣ − x − 1``.
The drift term uses ``x = log_r`` (so ``k3 = r − log r − 1``), the reference penalty ``x = ref − trn``
(GRPO's ``k3``). ``tis_t = min(r, tis_cap)`` detached (truncated importance sampling), if ``tis_cap``.

REINFORCE gives ∇KL(π_θ‖π_ref) = −E[(log π_ref − log π_θ) ∇log π_θ], so reverse-KL distillation is this
policy gradient with a live advantage. prime-rl's three loss types are :data:`DPPO`, :data:`IPO`,
:data:`REF_KL`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from packloss.core.components import ComponentInputs, ComponentOutput, outputs_from_named, upcast
from packloss.core.segments import broadcast, segment_mean

__all__ = ["PGParams", "pg_loss", "DPPO", "IPO", "REF_KL", "TRUST_REGIONS", "KL_ESTIMATORS", "kl_estimate"]

ADVANTAGES = ("shipped", "ref_kl")
TRUST_REGIONS = ("dppo", "ipo", "one_sided", "none", "icepop", "ppo_clip", "cispo", "gspo")
KL_ESTIMATORS = ("squared_log_ratio", "k1", "k2", "k3")
_CLIPPED = ("ppo_clip", "cispo", "gspo")


@dataclass(frozen=True)
class PGParams:
    """One instance of the policy-gradient skeleton; calling it computes :func:`pg_loss`.

    Args:
        advantage: ``"shipped"`` (the advantages stream) or ``"ref_kl"`` (live ``ref − trn``, detached).
        trust_region: one of :data:`TRUST_REGIONS` (see the module table).
        adv_tau: coefficient of the policy-gradient term.
        kl_tau: coefficient of the trainer/inference drift penalty ``K(log_r)``.
        kl_estimator: ``K``, one of :data:`KL_ESTIMATORS` (default ``log_r²``).
        dppo_mask_low, dppo_mask_high: DPPO thresholds on ``dp`` for ``A ≤ 0`` / ``A > 0``.
        ipo_threshold: IPO threshold on ``|dp|``.
        one_sided_threshold: threshold of the one-sided region.
        clip_low, clip_high: ``ε_low``, ``ε_high`` of ``ppo_clip`` / ``cispo`` / ``gspo`` (DAPO's
            clip-higher: ``clip_high=0.28``).
        dual_clip_c: dual-clip constant ``c > 1`` for ``ppo_clip`` (A < 0 loss capped at ``c·|A|``).
        icepop_low, icepop_high: the ratio band of ``icepop``.
        tis_cap: truncated importance sampling: multiply each token's loss by ``min(r, tis_cap)``
            (detached); ``None`` disables it.
        ref_kl_coef: coefficient of a KL-to-reference penalty (needs ``ref_logprobs``), GRPO's β.
        ref_kl_estimator: its estimator (default ``k3``).
    """

    advantage: str = "shipped"
    trust_region: str = "dppo"
    adv_tau: float = 1.0
    kl_tau: float = 1e-3
    kl_estimator: str = "squared_log_ratio"
    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2
    ipo_threshold: float = 0.1
    one_sided_threshold: float = 0.2
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float | None = None
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    tis_cap: float | None = None
    ref_kl_coef: float = 0.0
    ref_kl_estimator: str = "k3"

    def __post_init__(self) -> None:
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"advantage must be one of {ADVANTAGES}, got {self.advantage!r}")
        if self.trust_region not in TRUST_REGIONS:
            raise ValueError(f"trust_region must be one of {TRUST_REGIONS}, got {self.trust_region!r}")
        for name in ("kl_estimator", "ref_kl_estimator"):
            if getattr(self, name) not in KL_ESTIMATORS:
                raise ValueError(f"{name} must be one of {KL_ESTIMATORS}, got {getattr(self, name)!r}")
        for name in ("adv_tau", "kl_tau", "dppo_mask_low", "dppo_mask_high", "ipo_threshold", "one_sided_threshold"):
            _check_number(self, name)
        for name in ("clip_low", "clip_high", "icepop_low", "icepop_high", "ref_kl_coef"):
            _check_number(self, name)
        for name in ("kl_tau", "dppo_mask_low", "dppo_mask_high", "ipo_threshold", "one_sided_threshold", "clip_high"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if self.dual_clip_c is not None:
            _check_number(self, "dual_clip_c")
            if self.trust_region != "ppo_clip":
                raise ValueError(f"dual_clip_c needs trust_region='ppo_clip', got {self.trust_region!r}")
            if not self.dual_clip_c > 1:
                raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")
        if not 0 <= self.icepop_low < self.icepop_high:
            raise ValueError(f"need 0 <= icepop_low < icepop_high, got {self.icepop_low}, {self.icepop_high}")
        if self.tis_cap is not None:
            _check_number(self, "tis_cap")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0 or None, got {self.tis_cap}")
        if not self.ref_kl_coef >= 0:
            raise ValueError(f"ref_kl_coef must be >= 0, got {self.ref_kl_coef}")

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        return pg_loss(inputs, self)

    def check_plan(self, plan, name: str) -> None:
        """Raise a ``ValueError`` naming ``name`` when the plan lacks a stream this objective reads."""
        plan.require("inference_logprobs", name)
        if self.advantage == "shipped":
            plan.require("advantages", name)
        if self.advantage == "ref_kl" or self.ref_kl_coef:
            plan.require("ref_logprobs", name)


def _check_number(params: PGParams, name: str) -> None:
    """A finite real number (bools, strings, NaN and ±inf are rejected with the field's name)."""
    value = getattr(params, name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


DPPO = PGParams()
"""prime-rl's default loss: DPPO-Binary TV trust region + Kimi-K2.5 squared-log-ratio KL."""
IPO = PGParams(trust_region="ipo")
"""prime-rl's IPO loss: symmetric trust region ``|dp| > 0.1``."""
REF_KL = PGParams(advantage="ref_kl", trust_region="one_sided", kl_tau=1e-3)
"""Sampled-token (on-policy) distillation: reverse KL to the reference as advantage, one-sided region
at 0.2 (prime-rl's ref_kl loss)."""


def _ref(inputs, why: str) -> Tensor:
    if inputs.ref_logprobs is None:
        raise ValueError(f"{why} needs ref_logprobs, got None")
    return upcast(inputs.ref_logprobs.detach())


def _advantage(inputs, params: PGParams, trn: Tensor, m: Tensor) -> Tensor:
    """The raw advantage ``A [N]``, zero off the mask, never carrying a gradient."""
    if params.advantage == "ref_kl":
        return torch.where(m, _ref(inputs, "advantage='ref_kl'") - trn.detach(), 0.0)
    if inputs.advantages is None:
        raise ValueError("advantage='shipped' needs the advantages stream, got None")
    return torch.where(m, upcast(inputs.advantages.detach()), 0.0)


def kl_estimate(kind: str, x: Tensor) -> Tensor:
    """``K(x)`` for ``x = log(π_other / π_sampler)``; differentiable.  ``[N] → [N]``."""
    if kind == "squared_log_ratio":
        return x**2
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x**2
    return torch.exp(x) - x - 1


def _masked_regions(params: PGParams, adv: Tensor, dp: Tensor, r: Tensor) -> dict[str, Tensor]:
    """``{"is_masked": [N] bool, ...}`` for the regions that drop tokens."""
    tr = params.trust_region
    if tr == "dppo":
        high = dp > params.dppo_mask_high
        low = dp < -params.dppo_mask_low
        return {
            "is_masked": torch.where(adv > 0, high, low),
            "is_masked_high": (adv > 0) & high,
            "is_masked_low": (adv < 0) & low,
        }
    if tr == "ipo":
        return {"is_masked": dp.abs() > params.ipo_threshold}
    if tr == "one_sided":
        return {"is_masked": dp < -params.one_sided_threshold}
    if tr == "icepop":
        low, high = r < params.icepop_low, r > params.icepop_high
        return {"is_masked": low | high, "is_masked_low": low, "is_masked_high": high}
    return {"is_masked": torch.zeros_like(dp, dtype=torch.bool)}


def _clip(params: PGParams, ratio: Tensor) -> Tensor:
    return ratio.clamp(1 - params.clip_low, 1 + params.clip_high)


def _clip_regions(params: PGParams, ratio: Tensor, a: Tensor) -> dict[str, Tensor]:
    """Members whose gradient the clip zeroes: ``A<0 & r<1−ε_low``, ``A>0 & r>1+ε_high`` (+ dual clip)."""
    r = ratio.detach()
    regions = {
        "clip_frac_low": (a < 0) & (r < 1 - params.clip_low),
        "clip_frac_high": (a > 0) & (r > 1 + params.clip_high),
    }
    is_masked = regions["clip_frac_low"] | regions["clip_frac_high"]
    if params.dual_clip_c is not None:
        regions["dual_clip_frac"] = (a < 0) & (r > params.dual_clip_c)
        is_masked = is_masked | regions["dual_clip_frac"]
    regions["is_masked"] = is_masked
    return regions


def _ppo_surrogate(params: PGParams, ratio: Tensor, a: Tensor) -> Tensor:
    """``min(ratio·A', clip(ratio)·A')``, and with dual clip ``max(that, c·A')`` where ``A' < 0``."""
    surrogate = torch.minimum(ratio * a, _clip(params, ratio) * a)
    if params.dual_clip_c is not None:
        surrogate = torch.where(a < 0, torch.maximum(surrogate, params.dual_clip_c * a), surrogate)
    return surrogate


def _gspo_ratio(inputs, trn: Tensor, log_r: Tensor, m: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(s_t [N], s_i [S], has_members [S])``: the sequence ratio in token form."""
    seq_log_r, count = segment_mean(log_r.detach(), m, inputs.seq_ids, inputs.num_seqs)  # [S]
    seq_ratio = torch.exp(seq_log_r)  # [S]
    trn_m = torch.where(m, trn, 0.0)
    token_ratio = broadcast(seq_ratio, inputs.seq_ids) * torch.exp(trn_m - trn_m.detach())  # [N]
    return token_ratio, seq_ratio, count > 0


def pg_loss(inputs: ComponentInputs, params: PGParams) -> ComponentOutput:
    """The objective's per-token loss ``[N]`` over the members of ``inputs.loss_mask`` and its metrics.

    ``inputs`` is a :class:`~packloss.core.components.ComponentInputs` or anything with its fields
    (prime-rl's ``LossInputs``). Shapes: every stream ``[N]``; returns the per-token loss (at least
    float32, zero off the members; weights are not applied) and metrics
    (scalars, or ``[S]`` with ``per_sequence_metrics``), unweighted means over the members:

    * ``masked_mismatch_kl`` / ``unmasked_mismatch_kl``: ``r − log_r − 1`` over dropped / kept members;
    * ``is_masked``: members whose policy gradient is zeroed;
    * DPPO: ``is_masked_high``/``_low``, ``masked_advantage_positive``/``_negative`` (over dropped);
    * IcePop: ``is_masked_low``/``_high``;
    * PPO clip, CISPO, GSPO: ``clip_frac_low``/``_high`` (and ``dual_clip_frac``);
    * GSPO: ``seq_ratio_mean``/``_min``/``_max`` over sequences with members;
    * advantage ``ref_kl``: ``ref_kl`` (mean ``ref − trn``); ``ref_kl_coef``: ``ref_kl_penalty``.
    """
    m = inputs.loss_mask  # [N] bool
    trn = upcast(inputs.trainer_logprobs)  # [N]
    inf = upcast(inputs.inference_logprobs.detach())  # [N]
    log_r = torch.where(m, trn - inf, 0.0)  # [N]
    r = torch.exp(log_r)  # [N]
    adv = _advantage(inputs, params, trn, m)  # [N]
    a = params.adv_tau * adv  # [N]
    tr = params.trust_region
    named_extra: dict[str, tuple[Tensor, Tensor]] = {}
    seq_stats: tuple[Tensor, Tensor] | None = None

    if tr in _CLIPPED:
        if tr == "cispo":
            surrogate = _clip(params, r).detach() * a * torch.where(m, trn, 0.0)
            regions = _clip_regions(params, r, a)
            regions["is_masked"] = torch.zeros_like(m)  # CISPO clips the weight, it never drops a token
        elif tr == "gspo":
            token_ratio, seq_ratio, has_members = _gspo_ratio(inputs, trn, log_r, m)
            surrogate, regions = _ppo_surrogate(params, token_ratio, a), _clip_regions(params, token_ratio, a)
            seq_stats = (seq_ratio, has_members)
        else:
            surrogate, regions = _ppo_surrogate(params, r, a), _clip_regions(params, r, a)
        surrogate = torch.where(m, surrogate, 0.0)
    else:
        dp = torch.exp(torch.where(m, trn.detach(), 0.0)) - torch.exp(torch.where(m, inf, 0.0))  # [N]
        regions = _masked_regions(params, adv, dp, r.detach())
        keep = m & ~regions["is_masked"]
        surrogate = keep * a * r
    per_token = -surrogate + params.kl_tau * (m * kl_estimate(params.kl_estimator, log_r))  # [N]
    if params.ref_kl_coef:
        ref_x = torch.where(m, _ref(inputs, "ref_kl_coef > 0") - trn, 0.0)
        penalty = kl_estimate(params.ref_kl_estimator, ref_x)
        per_token = per_token + params.ref_kl_coef * (m * penalty)
        named_extra["ref_kl_penalty"] = (penalty, m)
    if params.tis_cap is not None:
        per_token = per_token * r.detach().clamp_max(params.tis_cap)

    is_masked = regions["is_masked"]
    log_r_d = log_r.detach()
    mismatch_kl = r.detach() - log_r_d - 1  # [N]
    keep, drop = m & ~is_masked, m & is_masked
    named = {
        "masked_mismatch_kl": (mismatch_kl, drop),
        "unmasked_mismatch_kl": (mismatch_kl, keep),
        "is_masked": (is_masked, m),
    }
    named.update({k: (v, m) for k, v in regions.items() if k != "is_masked"})
    if tr == "dppo":
        named["masked_advantage_positive"] = (adv > 0, drop)
        named["masked_advantage_negative"] = (adv < 0, drop)
    if params.advantage == "ref_kl":
        named["ref_kl"] = (adv, m)
    named.update(named_extra)
    out = outputs_from_named(inputs, per_token, named)
    if seq_stats is not None:
        _add_seq_ratio_metrics(out, inputs, *seq_stats)
    return out


def _add_seq_ratio_metrics(out: ComponentOutput, inputs, seq_ratio: Tensor, has_members: Tensor) -> None:
    """GSPO's ``seq_ratio_mean``/``_min``/``_max`` over the sequences with members (counts: sequences).

    Per sequence they are ``s_i`` itself. ``_min``/``_max`` merge by min/max (see :mod:`packloss.metrics`).
    """
    n_seqs = has_members.sum(dtype=torch.float32)
    if inputs.per_sequence_metrics:
        value, count = seq_ratio.detach(), has_members.to(torch.float32)
        stats = {"seq_ratio_mean": value, "seq_ratio_min": value, "seq_ratio_max": value}
        counts = dict.fromkeys(stats, count)
    else:
        s = seq_ratio.detach()
        stats = {
            "seq_ratio_mean": torch.where(has_members, s, 0.0).sum() / n_seqs.clamp_min(1),
            "seq_ratio_min": torch.where(has_members, s, float("inf")).amin().where(n_seqs > 0, 0.0),
            "seq_ratio_max": torch.where(has_members, s, float("-inf")).amax().where(n_seqs > 0, 0.0),
        }
        counts = dict.fromkeys(stats, n_seqs)
    out.metrics.update(stats)
    out.counts.update(counts)
