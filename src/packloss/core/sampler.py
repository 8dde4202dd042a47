"""Sampler-aware objectives over the sampler's top-k head (``Plan.rollout_topk_ids`` / ``_logprobs``)
and the trainer's log-probs at those ids (``Outputs.topk_logprobs``), the rest of the vocabulary one
tail bucket: :class:`DistributionalIPO` and :class:`ScoreCentering` (prime-rl's ``distributional_ipo``
and ``score_centering``). Streams, formulas and the prime-rl mapping: ``docs/sampler_objectives.md``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from packloss.core import checks
from packloss.core.bin import ComponentInputs, ComponentOutput, Objective, Plan
from packloss.core.dtypes import upcast
from packloss.core.metrics import metric_means

__all__ = ["DistributionalIPO", "ScoreCentering", "check_candidates"]


class _Head(NamedTuple):
    """The top-k head of the members (``[N, K]``, zero off ``valid``): ``valid`` the members' candidates
    (id ≥ 0), ``log_p`` the trainer's log-probs (with their gradient), ``log_q`` the sampler's
    (detached), ``p`` / ``q`` their probabilities; ``empty [N]`` the members without a candidate."""

    valid: Tensor
    log_p: Tensor
    log_q: Tensor
    p: Tensor
    q: Tensor
    empty: Tensor


def _require_head(plan: Plan, name: str, objective: str) -> None:
    if plan.rollout_topk_ids is None:
        raise ValueError(
            f"component {name!r} ({objective}) needs the plan's rollout_topk_ids and rollout_topk_logprobs "
            "(the sampler's top-k), got None"
        )


def _head(inputs: ComponentInputs, objective: str) -> _Head:
    plan, name, m = inputs.plan, inputs.name, inputs.loss_mask
    _require_head(plan, name, objective)
    ids = plan.rollout_topk_ids  # [N, K]
    trainer = inputs.outputs.require("topk_logprobs", name)
    if trainer.shape != ids.shape:
        raise ValueError(
            f"component {name!r} ({objective}) needs outputs.topk_logprobs of the shape of the plan's "
            f"rollout_topk_ids {list(ids.shape)} (the trainer's log-probs at those ids), got {list(trainer.shape)}"
        )
    valid = (ids >= 0) & m[:, None]  # [N, K]; pads and non-members may hold NaN: masked before any op
    log_p = torch.where(valid, upcast(trainer), 0.0)
    log_q = torch.where(valid, upcast(plan.rollout_topk_logprobs.detach()), 0.0)
    p = torch.where(valid, torch.exp(log_p), 0.0)
    q = torch.where(valid, torch.exp(log_q), 0.0)
    return _Head(valid, log_p, log_q, p, q, m & ~valid.any(-1))


def _member(value: Tensor, m: Tensor) -> Tensor:
    """``value`` (detached) in the compute dtype on the members, 0 elsewhere.  ``[N]``."""
    return torch.where(m, upcast(value.detach()), 0.0)


def _mismatch_kl(trn: Tensor, rollout: Tensor, m: Tensor) -> Tensor:
    """``r − log r − 1`` with ``log r = trn − inf`` on the members (detached; a metric).  ``[N]``."""
    x = torch.where(m, trn.detach() - rollout, 0.0)
    return torch.exp(x) - x - 1


@dataclass(frozen=True)
class DistributionalIPO(Objective):
    """prime-rl's distributional IPO: a policy gradient gated by the total variation between the trainer
    and the sampler over the sampler's top-k plus one tail bucket, with the squared log-ratio under the
    sampler on the same buckets::

        ℓ_t  = −keep_t · adv_tau · A_t · exp(trn_t − inf_t) + kl_tau · D_t,
        D_t  = Σ_k q_k (log p_k − log q_k)² + q_T (log max(p_T, tail_eps) − log max(q_T, tail_eps))²,
        TV_t = ½ (Σ_k |p_k − q_k| + |p_T − q_T|),   keep_t = TV_t ≤ eps,   p_T = max(1 − Σ_k p_k, 0)

    over the valid candidates ``k`` (``rollout_topk_ids ≥ 0``): ``p_k = exp(topk_logprobs)``, the
    trainer's (differentiable, in the penalty only), ``q_k = exp(rollout_topk_logprobs)``, the sampler's
    (likewise ``q_T``); the gate reads ``sg(p)``; the ratio's log is replaced by 0 off ``keep``
    before ``exp``. A candidate whose sampler log-prob is ``−inf`` has no mass and no penalty term. A
    member without a candidate has an empty head, so its tail is all the mass on both sides: ``TV = 0``
    (kept), no penalty (prime-rl raises there; that check reads the device: :func:`check_candidates`).

    Args (prime-rl's ``[trainer.loss] type = "distributional_ipo"``):
        eps: the total-variation gate, ``>= 0`` (a member is kept when ``TV ≤ eps``).
        adv_tau: coefficient of the advantage.
        kl_tau: coefficient of the squared log-ratio penalty, ``>= 0``.
        tail_eps: floor of the tail masses inside the tail's log (prime-rl's ``TAIL_EPS``).

    Reads ``outputs.logprobs``, ``outputs.topk_logprobs``; the plan's ``rollout_logprobs``, ``advantages``,
    ``rollout_topk_ids`` / ``_logprobs``. Metrics: ``is_masked``, ``masked_mismatch_kl`` /
    ``unmasked_mismatch_kl`` (over the dropped / kept members), ``total_variation``,
    ``squared_log_ratio``, ``head_mass`` (``Σ_k q_k``), ``empty_head`` (members without a candidate).
    """

    eps: float = 0.3
    adv_tau: float = 1.0
    kl_tau: float = 0.0
    tail_eps: float = 1e-8

    def __post_init__(self) -> None:
        checks.nonnegative("DistributionalIPO.eps", self.eps)
        checks.nonnegative("DistributionalIPO.adv_tau", self.adv_tau)
        checks.nonnegative("DistributionalIPO.kl_tau", self.kl_tau)
        checks.positive("DistributionalIPO.tail_eps", self.tail_eps)

    def check_plan(self, plan: Plan, name: str) -> None:
        _require_head(plan, name, "DistributionalIPO")
        plan.require("rollout_logprobs", name)
        plan.require("advantages", name)

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        m, plan, name = inputs.loss_mask, inputs.plan, inputs.name
        h = _head(inputs, "DistributionalIPO")
        p_tail = (1 - h.p.sum(-1)).clamp_min(0.0)  # [N]
        q_tail = (1 - h.q.sum(-1)).clamp_min(0.0)
        # the tail bucket coarsens every unrecorded token: movement inside it is not seen
        tv = 0.5 * ((h.p.detach() - h.q).abs().sum(-1) + (p_tail.detach() - q_tail).abs())  # [N]
        is_masked = tv > self.eps
        keep = m & ~is_masked

        trn = upcast(inputs.trainer_logprobs)  # [N]
        rollout = _member(plan.require("rollout_logprobs", name), m)
        adv = _member(plan.require("advantages", name), m)
        log_r = torch.where(keep, trn - rollout, 0.0)  # replaced before exp: a dropped ratio may overflow
        pg = torch.where(keep, -self.adv_tau * adv * torch.exp(log_r), 0.0)

        diff = torch.where(h.q > 0, h.log_p - h.log_q, 0.0)  # [N, K]; a −inf sampler log-prob has no term
        tail_log_ratio = p_tail.clamp_min(self.tail_eps).log() - q_tail.clamp_min(self.tail_eps).log()
        squared = (h.q * diff.square()).sum(-1) + q_tail * tail_log_ratio.square()  # [N]
        per_token = pg + self.kl_tau * squared

        mismatch = _mismatch_kl(torch.where(m, trn, 0.0), rollout, m)
        named = {
            "is_masked": (is_masked, m),
            "masked_mismatch_kl": (mismatch, m & is_masked),
            "unmasked_mismatch_kl": (mismatch, keep),
            "total_variation": (tv, m),
            "squared_log_ratio": (squared, m),
            "head_mass": (h.q.sum(-1), m),
            "empty_head": (h.empty, m),
        }
        metrics, counts = metric_means(named, inputs.segments, inputs.per_sequence_metrics)
        return ComponentOutput(per_token, metrics, counts)


@dataclass(frozen=True)
class ScoreCentering(Objective):
    """Score centering (arXiv 2609.20807, prime-rl's ``score_centering``): the policy gradient of a
    score centred to zero expectation under the sampler, its tail modelled as the trainer's own
    tail rescaled to the sampler's tail mass (``q_v = α p_v`` off the head)::

        ℓ_t = −A_t · (trn_t − Σ_k sg(q_k − α_t p_k) · log p_k − α_t · sg(−H_t)),
        α_t = sg(max(1 − Σ_k q_k, 0) / max(1 − Σ_k p_k, tail_eps))

    over the valid candidates ``k`` (``rollout_topk_ids ≥ 0``): ``log p_k`` the trainer's log-probs at
    them (``topk_logprobs``, differentiable), ``q_k = exp(rollout_topk_logprobs)``, ``H_t`` the trainer's
    entropy (``outputs.entropy``, detached). Every correction is constant over the modelled tail, so
    the gradient reaches only ``trn`` and the ``K`` head gathers. A member without a candidate has an
    empty head: ``α = 1``, the score is ``trn_t + H_t`` and the gradient REINFORCE's (prime-rl raises
    there; that check reads the device: :func:`check_candidates`).

    Args:
        tail_eps: floor of the trainer's tail mass in ``α`` (prime-rl's ``TAIL_EPS``, the paper's default).

    Reads ``outputs.logprobs``, ``outputs.topk_logprobs``, ``outputs.entropy``; the plan's ``advantages``,
    ``rollout_topk_ids`` / ``_logprobs``. Metrics: ``head_mass`` (``Σ_k q_k``), ``rho`` (``α``),
    ``empty_head`` (members without a candidate) and, when the plan has ``rollout_logprobs``,
    ``unmasked_mismatch_kl``.
    """

    tail_eps: float = 1e-6

    def __post_init__(self) -> None:
        checks.positive("ScoreCentering.tail_eps", self.tail_eps)

    def check_plan(self, plan: Plan, name: str) -> None:
        _require_head(plan, name, "ScoreCentering")
        plan.require("advantages", name)

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        m, plan, name = inputs.loss_mask, inputs.plan, inputs.name
        h = _head(inputs, "ScoreCentering")
        neg_entropy = -_member(inputs.outputs.require("entropy", name), m)  # [N], a constant (the paper's sg)
        q_tail = (1 - h.q.sum(-1)).clamp_min(0.0)  # [N]
        p_tail = (1 - h.p.detach().sum(-1)).clamp_min(self.tail_eps)
        alpha = q_tail / p_tail  # [N], detached: E_p[∇ log p] = 0 makes its gradient vanish
        residual = h.q - alpha[:, None] * h.p.detach()  # [N, K], zero off the candidates
        center = (residual * h.log_p).sum(-1) + alpha * neg_entropy
        trn = torch.where(m, upcast(inputs.trainer_logprobs), 0.0)
        adv = _member(plan.require("advantages", name), m)
        per_token = -adv * (trn - center)

        named = {"head_mass": (h.q.sum(-1), m), "rho": (alpha, m), "empty_head": (h.empty, m)}
        if plan.rollout_logprobs is not None:
            named["unmasked_mismatch_kl"] = (_mismatch_kl(trn, _member(plan.rollout_logprobs, m), m), m)
        metrics, counts = metric_means(named, inputs.segments, inputs.per_sequence_metrics)
        return ComponentOutput(per_token, metrics, counts)


def check_candidates(plan: Plan, name: str) -> Plan:
    """Opt-in (one device→host sync): raise a ``ValueError`` naming component ``name`` when one of its
    members has no valid candidate in ``rollout_topk_ids`` (prime-rl's check); return ``plan``. The
    objectives themselves never read the device: they give such a member an empty head."""
    _require_head(plan, name, "check_candidates")
    if name not in plan.members:
        raise ValueError(f"check_candidates: the plan has no component {name!r}; it has {sorted(plan.members)}")
    empty = plan.members[name] & ~(plan.rollout_topk_ids >= 0).any(-1)
    if bool(empty.any()):  # sync-ok: opt-in deep check
        raise ValueError(f"component {name!r} has a member token without a candidate in rollout_topk_ids")
    return plan
