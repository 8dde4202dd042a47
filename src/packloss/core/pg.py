"""The policy-gradient objective :class:`PolicyGradient`, composed of a trust region, a ratio, an
advantage, KL penalties and a rollout correction, over the trainer's, old and rollout log-probs::

    log_r  = where(m, trn − base, 0)            base = old | sg(trn) (ratio="old") | rollout (ratio="rollout")
    loss_t = −J_t(r, adv_coef · A) · c_t + Σ_k coef_k · K_k(x_k)

prime-rl's three loss types are :data:`DPPO`, :data:`IPO` and :data:`REF_KL`. The parts, their
formulas and every peer mapping: ``docs/objectives.md``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from packloss.core import checks
from packloss.core.bin import ComponentInputs, ComponentOutput, Objective, Plan, Selection
from packloss.core.corrections import OffPolicyMask, RolloutCorrection
from packloss.core.dtypes import finite_exp, upcast
from packloss.core.kl import KLPenalty, kl_estimate
from packloss.core.metrics import metric_means
from packloss.core.segments import Segments
from packloss.core.top_entropy import TopEntropy
from packloss.core.trust_regions import (
    DPPOMask,
    IPOMask,
    OneSided,
    PolicyTerms,
    SelectionStreams,
    StepSelector,
    TrustRegion,
    trust_region,
)

__all__ = ["PolicyGradient", "PolicyInputs", "pg_loss", "policy_terms", "DPPO", "IPO", "REF_KL"]

ADVANTAGES = ("shipped", "ref_kl")
RATIOS = ("old", "rollout")


def _detached(x: Tensor | None) -> Tensor | None:
    return None if x is None else upcast(x.detach())


@dataclass(frozen=True, eq=False)
class PolicyInputs:
    """The streams a policy-gradient objective reads for one bin (``[N]`` each): members ``m``, the
    trainer's log-probs ``trn`` (with their gradient), the rollout / old / reference log-probs and the
    advantages (None when absent), the bin's segments, the metrics mode, the step-wide selection, and
    the forward's entropy (None when absent; read by ``top_entropy``)."""

    m: Tensor
    trn: Tensor
    rollout: Tensor | None
    old: Tensor | None
    ref: Tensor | None
    advantages: Tensor | None
    segments: Segments
    per_sequence_metrics: bool = False
    selection: Selection | None = None
    entropy: Tensor | None = None

    @classmethod
    def of(cls, inputs: ComponentInputs) -> PolicyInputs:
        """The policy streams of an engine component's inputs."""
        plan = inputs.plan
        return cls(
            m=inputs.loss_mask,
            trn=inputs.trainer_logprobs,
            rollout=plan.rollout_logprobs,
            old=plan.old_logprobs,
            ref=plan.ref_logprobs,
            advantages=plan.advantages,
            segments=inputs.segments,
            per_sequence_metrics=inputs.per_sequence_metrics,
            selection=inputs.selection,
            entropy=inputs.outputs.entropy,
        )


def _need(value: Tensor | None, stream: str, why: str) -> Tensor:
    if value is None:
        raise ValueError(f"{why} needs {stream}, got None")
    return upcast(value.detach())


@dataclass(frozen=True)
class PolicyGradient(Objective):
    """A policy-gradient objective; calling it computes :func:`pg_loss`.

    Args:
        trust_region: a :class:`~packloss.core.trust_regions.TrustRegion` or a registered name
            (:data:`~packloss.TRUST_REGIONS`, its defaults); default PPO clip 0.2.
        ratio: ``"old"`` (π_old, or ``sg(π_θ)`` when the plan has no ``old_logprobs``) or
            ``"rollout"`` (π_rollout, ``rollout_logprobs``).
        advantage: ``"shipped"`` (the ``advantages`` stream) or ``"ref_kl"`` (live ``ref − trn``,
            detached: sampled-token distillation).
        adv_coef: coefficient of the policy-gradient term (prime-rl's ``adv_tau``).
        penalties: :class:`~packloss.KLPenalty` terms (none by default).
        correction: a :class:`~packloss.RolloutCorrection` (TIS / MIS) or None.
        ratio_cap: ``C`` of a straight-through cap on the token ratio the trust region reads: its
            value ``min(r, C)``, its gradient that of the uncapped ``r`` (``r − sg(r − min(r, C))``);
            only for regions that read ``r`` (``TrustRegion.reads_token_ratio``). Metric ``ratio_capped``.
        off_policy_mask: an :class:`~packloss.OffPolicyMask` (off-policy sequence masking) or None.
        top_entropy: a :class:`~packloss.core.top_entropy.TopEntropy` (the policy gradient of the
            high-entropy members only; reads ``Outputs.entropy``) or None. Metric ``high_entropy``.
    """

    trust_region: TrustRegion | str = "ppo_clip"
    ratio: Literal["old", "rollout"] = "old"
    advantage: Literal["shipped", "ref_kl"] = "shipped"
    adv_coef: float = 1.0
    penalties: tuple[KLPenalty, ...] = ()
    correction: RolloutCorrection | None = None
    ratio_cap: float | None = None
    off_policy_mask: OffPolicyMask | None = None
    top_entropy: TopEntropy | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "trust_region", trust_region(self.trust_region))
        checks.choice("ratio", self.ratio, RATIOS)
        checks.choice("advantage", self.advantage, ADVANTAGES)
        checks.number("PolicyGradient.adv_coef", self.adv_coef)
        penalties = (self.penalties,) if isinstance(self.penalties, KLPenalty) else tuple(self.penalties)
        for p in penalties:
            if not isinstance(p, KLPenalty):
                raise TypeError(f"penalties must hold KLPenalty instances, got {type(p).__name__}")
        object.__setattr__(self, "penalties", penalties)
        if self.correction is not None and not isinstance(self.correction, RolloutCorrection):
            raise TypeError(f"correction must be a RolloutCorrection or None, got {type(self.correction).__name__}")
        if self.ratio_cap is not None:
            checks.positive("PolicyGradient.ratio_cap", self.ratio_cap)
            if not self.trust_region.reads_token_ratio:
                raise ValueError(
                    f"ratio_cap caps the token ratio r, which trust region {type(self.trust_region).__name__} does "
                    "not read (it computes from log r or log π)"
                )
        if self.off_policy_mask is not None and not isinstance(self.off_policy_mask, OffPolicyMask):
            raise TypeError(
                f"off_policy_mask must be an OffPolicyMask or None, got {type(self.off_policy_mask).__name__}"
            )
        if self.top_entropy is not None and not isinstance(self.top_entropy, TopEntropy):
            raise TypeError(f"top_entropy must be a TopEntropy or None, got {type(self.top_entropy).__name__}")

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        return pg_loss(PolicyInputs.of(inputs), self)

    def check_plan(self, plan: Plan, name: str) -> None:
        if (
            self.ratio == "rollout"
            or self.correction is not None
            or any(p.against == "rollout" for p in self.penalties)
        ):
            plan.require("rollout_logprobs", name)
        if any(p.against == "old" for p in self.penalties):
            plan.require("old_logprobs", name)
        if self.off_policy_mask is not None and self.off_policy_mask.against == "rollout":
            plan.require("rollout_logprobs", name)
        if self.advantage == "shipped":
            plan.require("advantages", name)
        if self.advantage == "ref_kl" or any(p.against == "ref" for p in self.penalties):
            plan.require("ref_logprobs", name)

    def step_selector(self) -> StepSelector | None:
        return self.trust_region if isinstance(self.trust_region, StepSelector) else None

    def token_local(self, plan: Plan) -> bool:
        # a sequence-level correction reads sg(trn) over the sequence unless an old stream is its numerator;
        # the off-policy mask always reads sg(trn) over the sequence
        correction = self.correction is None or self.correction.level == "token" or (
            self.ratio == "old" and plan.old_logprobs is not None
        )
        # a bin's own entropy quantile reads every token's entropy; the step's threshold is a constant
        entropy = self.top_entropy is None or self.top_entropy.threshold is not None
        return self.trust_region.token_local and correction and self.off_policy_mask is None and entropy

    def selection_streams(self, plan: Plan, name: str) -> SelectionStreams:
        m = plan.members[name]

        def stream(value: Tensor | None) -> Tensor | None:  # float64, zero off the members (which may hold NaN)
            return None if value is None else torch.where(m, value.detach().to(torch.float64), 0.0)

        shipped = plan.advantages if self.advantage == "shipped" else None
        return SelectionStreams(
            m, stream(shipped), stream(plan.old_logprobs), stream(plan.rollout_logprobs), self.ratio, self.adv_coef
        )


DPPO = PolicyGradient(DPPOMask(), ratio="rollout", penalties=(KLPenalty(1e-3, "squared_log_ratio", "rollout"),))
"""prime-rl's default loss: DPPO-Binary TV trust region + Kimi-K2.5 squared-log-ratio drift KL."""
IPO = PolicyGradient(IPOMask(), ratio="rollout", penalties=(KLPenalty(1e-3, "squared_log_ratio", "rollout"),))
"""prime-rl's IPO loss (#2951 era): symmetric trust region ``|dp| > 0.1``."""
REF_KL = PolicyGradient(
    OneSided(), ratio="rollout", advantage="ref_kl", penalties=(KLPenalty(1e-3, "squared_log_ratio", "rollout"),)
)
"""Sampled-token (on-policy) distillation: reverse KL to the reference as advantage, one-sided region
at 0.2 (prime-rl's ref_kl loss)."""


def policy_terms(p: PolicyInputs, objective: PolicyGradient) -> PolicyTerms:
    """The :class:`~packloss.core.trust_regions.PolicyTerms` of a bin for ``objective``."""
    m = p.m  # [N] bool
    trn = upcast(p.trn)  # [N]
    old, rollout = _detached(p.old), _detached(p.rollout)
    if objective.ratio == "rollout":
        if rollout is None:
            raise ValueError("ratio='rollout' needs rollout_logprobs, got None")
        base = rollout
    else:
        base = trn.detach() if old is None else old
    log_r = torch.where(m, trn - base, 0.0)  # [N]
    if objective.advantage == "ref_kl":
        adv = torch.where(m, _need(p.ref, "ref_logprobs", "advantage='ref_kl'") - trn.detach(), 0.0)
    else:
        adv = torch.where(m, _need(p.advantages, "advantages", "advantage='shipped'"), 0.0)
    selected, scores = (None, None) if p.selection is None else p.selection
    r = finite_exp(log_r)  # [N]
    if objective.ratio_cap is not None:
        r = r - (r - r.clamp(max=objective.ratio_cap)).detach()  # straight through: min(r, C), ∂r
    return PolicyTerms(
        m=m,
        trn=trn,
        base=base,
        log_r=log_r,
        r=r,
        adv=adv,
        a=objective.adv_coef * adv,
        segments=p.segments,
        old=old,
        rollout=rollout,
        selected=selected,
        scores=scores,
    )


def _penalty_x(p: PolicyInputs, penalty: KLPenalty, t: PolicyTerms, objective: PolicyGradient) -> Tensor:
    """``x [N]`` of a penalty, zero off the members (``log_r`` itself when the penalty is against the
    ratio's own denominator)."""
    if penalty.against == "ref":
        return torch.where(t.m, _need(p.ref, "ref_logprobs", "KLPenalty(against='ref')") - t.trn, 0.0)
    if penalty.against == "rollout":
        if objective.ratio == "rollout":
            return t.log_r
        if t.rollout is None:
            raise ValueError("KLPenalty(against='rollout') needs rollout_logprobs, got None")
        return torch.where(t.m, t.trn - t.rollout, 0.0)
    if objective.ratio == "old" and t.old is not None:
        return t.log_r
    if t.old is None:
        raise ValueError("KLPenalty(against='old') needs old_logprobs, got None")
    return torch.where(t.m, t.trn - t.old, 0.0)


def pg_loss(p: PolicyInputs, objective: PolicyGradient) -> ComponentOutput:
    """The objective's per-token loss ``[N]`` over the members (at least float32, zero off them;
    weights not applied) and its metrics, unweighted means over the members (scalars, or ``[S]``
    with ``per_sequence_metrics``): ``masked_mismatch_kl`` / ``unmasked_mismatch_kl`` (``r − log_r − 1``
    over dropped / kept members), ``is_masked`` and the trust region's own; ``ref_kl`` (mean
    ``ref − trn``) for ``advantage="ref_kl"``; each penalty's mean ``K(x)``; the correction's;
    ``high_entropy`` (the fraction of members kept) with ``top_entropy``."""
    t = policy_terms(p, objective)
    m = t.m
    result = objective.trust_region.surrogate(t)
    pg = -result.objective  # [N]
    named: dict[str, tuple[Tensor, Tensor]] = {}
    if objective.ratio_cap is not None:
        named["ratio_capped"] = (finite_exp(t.log_r.detach()) > objective.ratio_cap, m)
    if objective.off_policy_mask is not None:
        opm = objective.off_policy_mask
        base = t.numerator() if opm.against == "old" else t.rollout
        if base is None:
            raise ValueError("OffPolicyMask(against='rollout') needs rollout_logprobs, got None")
        keep, mask_metrics = opm.keep(base, t.trn.detach(), t.adv, m, t.segments)
        pg = torch.where(keep, pg, 0.0)
        named.update(mask_metrics)
    if objective.correction is not None:
        numerator = t.old if objective.ratio == "old" and t.old is not None else t.trn.detach()
        if t.rollout is None:
            raise ValueError("a RolloutCorrection needs rollout_logprobs, got None")
        weight, correction_metrics = objective.correction.weights(numerator, t.rollout, m, t.segments)
        pg = pg * weight
        named.update(correction_metrics)
    if objective.top_entropy is not None:
        if p.entropy is None:
            raise ValueError("PolicyGradient(top_entropy=) needs outputs.entropy, got None")
        if objective.top_entropy.threshold is None and t.segments.sharded:
            raise ValueError(
                "PolicyGradient(top_entropy=) on a context-parallel shard needs the step's threshold: "
                "TopEntropy.over(..., all_gather=True, group=...) over the ranks holding the bin"
            )
        kept = objective.top_entropy.keep(p.entropy, m)  # [N]
        pg = torch.where(kept, pg, 0.0)  # the policy gradient only: the penalties below stay on every member
        named["high_entropy"] = (kept, m)
    per_token = pg
    for penalty in objective.penalties:
        k = kl_estimate(penalty.estimator, _penalty_x(p, penalty, t, objective))
        per_token = per_token + penalty.coef * (m * k)
        named[penalty.metric] = (k, m)

    is_masked = result.metrics.get("is_masked", torch.zeros_like(m))
    mismatch_kl = torch.exp(t.log_r.detach()) - t.log_r.detach() - 1  # [N], unbounded: a metric
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
    values, counts = metric_means(metrics, t.segments, p.per_sequence_metrics)
    out = ComponentOutput(per_token, values, counts)
    if result.sequence_ratio is not None:
        _add_seq_ratio_metrics(out, p.per_sequence_metrics, t.segments, *result.sequence_ratio)
    return out


def _add_seq_ratio_metrics(
    out: ComponentOutput, per_sequence: bool, segments: Segments, seq_ratio: Tensor, has_members: Tensor
) -> None:
    """``seq_ratio_mean``/``_min``/``_max`` over the sequences with members (counts: sequences, each
    reported by one rank of a context-parallel bin); per sequence they are ``s_i`` itself.
    ``_min``/``_max`` merge by min/max (:mod:`packloss.core.metrics`)."""
    if not per_sequence:
        has_members = segments.reported(has_members)
    n_seqs = has_members.sum(dtype=torch.float32)
    s = seq_ratio.detach()
    if per_sequence:
        stats = {"seq_ratio_mean": s, "seq_ratio_min": s, "seq_ratio_max": s}
        counts = dict.fromkeys(stats, has_members.to(torch.float32))
    else:
        stats = {
            "seq_ratio_mean": torch.where(has_members, s, 0.0).sum() / n_seqs.clamp_min(1),
            "seq_ratio_min": torch.where(has_members, s, float("inf")).amin().where(n_seqs > 0, 0.0),
            "seq_ratio_max": torch.where(has_members, s, float("-inf")).amax().where(n_seqs > 0, 0.0),
        }
        counts = dict.fromkeys(stats, n_seqs)
    out.metrics.update(stats)
    out.counts.update(counts)
