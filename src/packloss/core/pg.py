"""The policy-gradient objective, composed of small typed parts: :class:`PolicyGradient`.

Three log-prob streams, as verl, TRL, OpenRLHF and AReaL carry them: the trainer's ``trn = log π_θ``
(``outputs.logprobs``), the proximal / old policy's ``old = log π_old`` (``plan.old_logprobs``,
optional) and the rollout / behaviour policy's ``inf = log π_rollout`` (``plan.inference_logprobs``,
the engine that sampled). Per token ``t`` with members ``m``::

    base   = old                      (ratio="old", the stream given)
           | sg(trn)                  (ratio="old", no old stream: on-policy, as verl and TRL do)
           | inf                      (ratio="rollout": prime-rl's objectives, which have no old stream)
    log_r  = where(m, trn − base, 0)  # masked BEFORE exp: a non-member never overflows
    r      = exp(log_r)
    A      = adv                                  (advantage="shipped")
           | where(m, ref − trn, 0).detach()      (advantage="ref_kl": on-policy distillation)
    J_t    = trust_region.surrogate(r, adv_coef · A, ...)           # see packloss.core.trust_regions
    loss_t = −J_t · c_t  +  Σ_k coef_k · m · K_k(x_k)

``c_t`` is the rollout correction (:class:`~packloss.core.corrections.RolloutCorrection`, constant in
θ, on the policy-gradient term only, as TRL and verl apply it) and each penalty ``k`` is a
:class:`KLPenalty`. ``loss_t`` is the component's per-token loss; the engine applies weights and
normalisation. KL estimators ``K(x)`` take ``x = log(π_other / π_sampler)`` and estimate
``KL(π_sampler ‖ π_other)``: ``squared_log_ratio`` ``x²`` (prime-rl's drift term), ``k1`` ``−x``,
``k2`` ``½x²``, ``k3`` ``eˣ − x − 1``; ``against="ref"`` uses ``x = ref − trn`` (GRPO's β term),
``"rollout"`` ``x = trn − inf`` and ``"old"`` ``x = trn − old`` (drift terms).

REINFORCE gives ∇KL(π_θ‖π_ref) = −E[(log π_ref − log π_θ) ∇log π_θ], so reverse-KL distillation is this
policy gradient with a live advantage. prime-rl's three loss types are :data:`DPPO`, :data:`IPO`,
:data:`REF_KL`; they measure their trust region against π_rollout and keep the drift term of their
source (``kl_tau = 1e-3``). Nothing else has a drift term unless it is asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from packloss.core.components import ComponentInputs, ComponentOutput, outputs_from_named, upcast
from packloss.core.corrections import RolloutCorrection
from packloss.core.trust_regions import DPPOMask, IPOMask, OneSided, PolicyTerms, TrustRegion, trust_region

__all__ = ["PolicyGradient", "KLPenalty", "pg_loss", "DPPO", "IPO", "REF_KL", "KL_ESTIMATORS", "kl_estimate"]

ADVANTAGES = ("shipped", "ref_kl")
RATIOS = ("old", "rollout")
KL_ESTIMATORS = ("squared_log_ratio", "k1", "k2", "k3")
KL_AGAINST = ("ref", "rollout", "old")


def _check_finite(owner: str, name: str, value: object) -> float:
    """A finite real number (bools, strings, NaN and ±inf are rejected with the field's name)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{owner}.{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be finite, got {value}")
    return float(value)


@dataclass(frozen=True)
class KLPenalty:
    """A per-token KL penalty ``coef · K(x)`` added to the loss (see the module doc for ``x``).

    Args:
        coef: its coefficient, ``>= 0`` (GRPO's β; prime-rl's ``kl_tau``).
        estimator: ``K``, one of :data:`KL_ESTIMATORS`.
        against: ``"ref"`` (``x = ref − trn``, needs ``ref_logprobs``), ``"rollout"``
            (``x = trn − inf``) or ``"old"`` (``x = trn − old``, needs ``old_logprobs``).
    """

    coef: float
    estimator: str = "k3"
    against: str = "ref"

    def __post_init__(self) -> None:
        if not _check_finite("KLPenalty", "coef", self.coef) >= 0:
            raise ValueError(f"KLPenalty.coef must be >= 0, got {self.coef}")
        if self.estimator not in KL_ESTIMATORS:
            raise ValueError(f"KLPenalty.estimator must be one of {KL_ESTIMATORS}, got {self.estimator!r}")
        if self.against not in KL_AGAINST:
            raise ValueError(f"KLPenalty.against must be one of {KL_AGAINST}, got {self.against!r}")

    @property
    def metric(self) -> str:
        """The metric name of its mean ``K(x)``."""
        return {"ref": "ref_kl_penalty", "rollout": "rollout_kl_penalty", "old": "old_kl_penalty"}[self.against]


@dataclass(frozen=True)
class PolicyGradient:
    """A policy-gradient objective; calling it computes :func:`pg_loss`.

    Args:
        trust_region: a :class:`~packloss.core.trust_regions.TrustRegion` or a registered name
            (:data:`~packloss.core.trust_regions.TRUST_REGIONS`, its defaults); default PPO clip 0.2.
        ratio: the ratio's denominator: ``"old"`` (π_old, or ``sg(π_θ)`` when the plan has no
            ``old_logprobs``) or ``"rollout"`` (π_rollout, ``inference_logprobs``).
        advantage: ``"shipped"`` (the ``advantages`` stream) or ``"ref_kl"`` (live ``ref − trn``,
            detached: sampled-token distillation).
        adv_coef: coefficient of the policy-gradient term (prime-rl's ``adv_tau``).
        penalties: :class:`KLPenalty` terms (none by default).
        correction: a :class:`~packloss.core.corrections.RolloutCorrection` (TIS / MIS) or None.
    """

    trust_region: TrustRegion | str = "ppo_clip"
    ratio: Literal["old", "rollout"] = "old"
    advantage: Literal["shipped", "ref_kl"] = "shipped"
    adv_coef: float = 1.0
    penalties: tuple[KLPenalty, ...] = ()
    correction: RolloutCorrection | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "trust_region", trust_region(self.trust_region))
        if self.ratio not in RATIOS:
            raise ValueError(f"ratio must be one of {RATIOS}, got {self.ratio!r}")
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"advantage must be one of {ADVANTAGES}, got {self.advantage!r}")
        _check_finite("PolicyGradient", "adv_coef", self.adv_coef)
        if isinstance(self.penalties, KLPenalty):
            object.__setattr__(self, "penalties", (self.penalties,))
        object.__setattr__(self, "penalties", tuple(self.penalties))
        for p in self.penalties:
            if not isinstance(p, KLPenalty):
                raise TypeError(f"penalties must hold KLPenalty instances, got {type(p).__name__}")
        if self.correction is not None and not isinstance(self.correction, RolloutCorrection):
            raise TypeError(f"correction must be a RolloutCorrection or None, got {type(self.correction).__name__}")

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        return pg_loss(inputs, self)

    def check_plan(self, plan, name: str) -> None:
        """Raise a ``ValueError`` naming ``name`` when the plan lacks a stream this objective reads."""
        uses_rollout = self.ratio == "rollout" or self.correction is not None
        if uses_rollout or any(p.against == "rollout" for p in self.penalties):
            plan.require("inference_logprobs", name)
        if any(p.against == "old" for p in self.penalties):
            plan.require("old_logprobs", name)
        if self.advantage == "shipped":
            plan.require("advantages", name)
        if self.advantage == "ref_kl" or any(p.against == "ref" for p in self.penalties):
            plan.require("ref_logprobs", name)


DPPO = PolicyGradient(DPPOMask(), ratio="rollout", penalties=(KLPenalty(1e-3, "squared_log_ratio", "rollout"),))
"""prime-rl's default loss: DPPO-Binary TV trust region + Kimi-K2.5 squared-log-ratio drift KL."""
IPO = PolicyGradient(IPOMask(), ratio="rollout", penalties=(KLPenalty(1e-3, "squared_log_ratio", "rollout"),))
"""prime-rl's IPO loss (#2951 era): symmetric trust region ``|dp| > 0.1``."""
REF_KL = PolicyGradient(
    OneSided(), ratio="rollout", advantage="ref_kl", penalties=(KLPenalty(1e-3, "squared_log_ratio", "rollout"),)
)
"""Sampled-token (on-policy) distillation: reverse KL to the reference as advantage, one-sided region
at 0.2 (prime-rl's ref_kl loss)."""


def _stream(inputs, name: str, why: str) -> Tensor:
    value = getattr(inputs, name, None)
    if value is None:
        raise ValueError(f"{why} needs {name}, got None")
    return upcast(value.detach())


def _advantage(inputs, objective: PolicyGradient, trn: Tensor, m: Tensor) -> Tensor:
    """The raw advantage ``A [N]``, zero off the mask, never carrying a gradient."""
    if objective.advantage == "ref_kl":
        return torch.where(m, _stream(inputs, "ref_logprobs", "advantage='ref_kl'") - trn.detach(), 0.0)
    return torch.where(m, _stream(inputs, "advantages", "advantage='shipped'"), 0.0)


def kl_estimate(kind: str, x: Tensor) -> Tensor:
    """``K(x)`` for ``x = log(π_other / π_sampler)``; differentiable.  ``[N] → [N]``."""
    if kind == "squared_log_ratio":
        return x**2
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x**2
    return torch.exp(x) - x - 1


def _base(inputs, objective: PolicyGradient, trn: Tensor) -> Tensor:
    """The ratio's denominator ``[N]``, detached."""
    if objective.ratio == "rollout":
        return _stream(inputs, "inference_logprobs", "ratio='rollout'")
    old = getattr(inputs, "old_logprobs", None)
    return trn.detach() if old is None else upcast(old.detach())


def _penalty_x(inputs, penalty: KLPenalty, t: PolicyTerms, objective: PolicyGradient) -> Tensor:
    """``x [N]`` of a penalty, zero off the members (``log_r`` itself when the penalty is against the
    ratio's own denominator)."""
    if penalty.against == "ref":
        return torch.where(t.m, _stream(inputs, "ref_logprobs", "KLPenalty(against='ref')") - t.trn, 0.0)
    if penalty.against == "rollout":
        if objective.ratio == "rollout":
            return t.log_r
        return torch.where(t.m, t.trn - _stream(inputs, "inference_logprobs", "KLPenalty(against='rollout')"), 0.0)
    if objective.ratio == "old" and getattr(inputs, "old_logprobs", None) is not None:
        return t.log_r
    return torch.where(t.m, t.trn - _stream(inputs, "old_logprobs", "KLPenalty(against='old')"), 0.0)


def policy_terms(inputs, objective: PolicyGradient) -> PolicyTerms:
    """The :class:`~packloss.core.trust_regions.PolicyTerms` of a bin for ``objective``."""
    m = inputs.loss_mask  # [N] bool
    trn = upcast(inputs.trainer_logprobs)  # [N]
    base = _base(inputs, objective, trn)  # [N]
    log_r = torch.where(m, trn - base, 0.0)  # [N]
    adv = _advantage(inputs, objective, trn, m)  # [N]
    return PolicyTerms(
        m=m,
        trn=trn,
        base=base,
        log_r=log_r,
        r=torch.exp(log_r),
        adv=adv,
        a=objective.adv_coef * adv,
        seq_ids=inputs.seq_ids,
        num_seqs=inputs.num_seqs,
        inputs=inputs,
    )


def pg_loss(inputs: ComponentInputs, objective: PolicyGradient) -> ComponentOutput:
    """The objective's per-token loss ``[N]`` over the members of ``inputs.loss_mask`` and its metrics.

    ``inputs`` is a :class:`~packloss.core.components.ComponentInputs` or anything with its fields
    (prime-rl's ``LossInputs``). Shapes: every stream ``[N]``; returns the per-token loss (at least
    float32, zero off the members; weights are not applied) and metrics (scalars, or ``[S]`` with
    ``per_sequence_metrics``), unweighted means over the members:

    * ``masked_mismatch_kl`` / ``unmasked_mismatch_kl``: ``r − log_r − 1`` over dropped / kept members;
    * ``is_masked``: members whose policy gradient is zeroed, and the trust region's own metrics
      (:mod:`packloss.core.trust_regions`);
    * advantage ``ref_kl``: ``ref_kl`` (mean ``ref − trn``); each penalty its mean ``K(x)``
      (``ref_kl_penalty``, ``rollout_kl_penalty``, ``old_kl_penalty``);
    * the rollout correction's metrics (:mod:`packloss.core.corrections`).
    """
    t = policy_terms(inputs, objective)
    m = t.m
    result = objective.trust_region.surrogate(t)
    pg = -result.objective  # [N]
    named: dict[str, tuple[Tensor, Tensor]] = {}
    if objective.correction is not None:
        weight, correction_metrics = objective.correction.weights(inputs, objective.ratio, m, t.seq_ids, t.num_seqs)
        pg = pg * weight
        named.update(correction_metrics)
    per_token = pg
    for penalty in objective.penalties:
        k = kl_estimate(penalty.estimator, _penalty_x(inputs, penalty, t, objective))
        per_token = per_token + penalty.coef * (m * k)
        named[penalty.metric] = (k, m)

    is_masked = result.metrics.get("is_masked", torch.zeros_like(m))
    log_r_d = t.log_r.detach()
    mismatch_kl = t.r.detach() - log_r_d - 1  # [N]
    keep, drop = m & ~is_masked, m & is_masked
    metrics = {
        "masked_mismatch_kl": (mismatch_kl, drop),
        "unmasked_mismatch_kl": (mismatch_kl, keep),
        "is_masked": (is_masked, m),
    }
    for key, value in result.metrics.items():
        if key != "is_masked":
            metrics[key] = value if isinstance(value, tuple) else (value, m)
    if objective.advantage == "ref_kl":
        metrics["ref_kl"] = (t.adv, m)
    metrics.update(named)
    out = outputs_from_named(inputs, per_token, metrics)
    if result.sequence_ratio is not None:
        _add_seq_ratio_metrics(out, inputs, *result.sequence_ratio)
    return out


def _add_seq_ratio_metrics(out: ComponentOutput, inputs, seq_ratio: Tensor, has_members: Tensor) -> None:
    """``seq_ratio_mean``/``_min``/``_max`` over the sequences with members (counts: sequences).

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
