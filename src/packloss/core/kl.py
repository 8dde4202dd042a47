"""KL terms: the per-token estimators ``K(x)``, the :class:`KLPenalty` part of a policy gradient, and
:class:`RatioWeightedKL`, the k3 KL to the reference weighted by the live ratio (a component of its
own). ``x = log(π_other / π_sampler)``; formulas and peers: ``docs/objectives.md``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from packloss.core import checks
from packloss.core.bin import ComponentInputs, ComponentOutput, Objective, Plan
from packloss.core.dtypes import upcast
from packloss.core.metrics import metric_means

__all__ = ["KL_ESTIMATORS", "KL_AGAINST", "kl_estimate", "KLPenalty", "RatioWeightedKL"]

KL_ESTIMATORS = ("squared_log_ratio", "k1", "k2", "k3", "k1+", "k3+")
KL_AGAINST = ("ref", "rollout", "old")
LEVELS = ("token", "sequence")


def kl_estimate(kind: str, x: Tensor) -> Tensor:
    """``K(x)``: ``squared_log_ratio`` ``x²``, ``k1`` ``−x``, ``k2`` ``x²/2``, ``k3`` ``eˣ − x − 1``;
    ``k1+`` / ``k3+`` straight-through: the value of ``k1`` / ``k3`` with the gradient of ``k2``
    (``x − sg(x)`` of ``x²/2`` plus the detached value; k1 and k3 are unbiased for the KL's value, k2's
    gradient for its gradient; verl's ``kl_loss_type`` ``k1+``, ``k3+``). Differentiable. ``[N] → [N]``."""
    if kind.endswith("+"):
        through = 0.5 * x**2
        return through - through.detach() + kl_estimate(kind[:-1], x.detach())
    if kind == "squared_log_ratio":
        return x**2
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x**2
    return torch.exp(x) - x - 1


@dataclass(frozen=True)
class KLPenalty:
    """A per-token KL penalty ``coef · K(x)`` added to a policy gradient's loss.

    Args:
        coef: ``>= 0`` (GRPO's β; prime-rl's ``kl_tau``).
        estimator: ``K``, one of :data:`KL_ESTIMATORS`.
        against: ``"ref"`` (``x = ref − trn``), ``"rollout"`` (``x = trn − rollout``) or ``"old"``
            (``x = trn − old``).
    """

    coef: float
    estimator: str = "k3"
    against: str = "ref"

    def __post_init__(self) -> None:
        checks.nonnegative("KLPenalty.coef", self.coef)
        checks.choice("KLPenalty.estimator", self.estimator, KL_ESTIMATORS)
        checks.choice("KLPenalty.against", self.against, KL_AGAINST)

    @property
    def metric(self) -> str:
        """The metric name of its mean ``K(x)``."""
        return f"{self.against}_kl_penalty"


@dataclass(frozen=True)
class RatioWeightedKL(Objective):
    """The k3 KL to the reference weighted by the live importance ratio (TRL's ``beta`` with
    ``use_bias_correction_kl=True``; DeepSeek-V3.2's unbiased reverse-KL estimate)::

        ℓ_t = coef · ρ_t · (e^x − x − 1),   x = ref_t − trn_t,
        ρ_t = exp(trn_t − old_t)  (level="token")  |  exp(mean_{u∈i} (trn_u − old_u))  (level="sequence")

    ``old`` is ``old_logprobs``, or ``sg(trn)`` without it (``ρ = 1`` in value, not in gradient); ``ρ``
    is differentiable. Not multiplied by a rollout correction (as TRL). Metrics ``ref_kl_penalty``
    (mean k3) and ``ratio_weighted_kl`` (mean ``ρ·k3``).
    """

    coef: float
    level: str = "token"

    def __post_init__(self) -> None:
        checks.nonnegative("RatioWeightedKL.coef", self.coef)
        checks.choice("RatioWeightedKL.level", self.level, LEVELS)

    def token_local(self, plan: Plan) -> bool:
        return self.level == "token"

    def check_plan(self, plan: Plan, name: str) -> None:
        plan.require("ref_logprobs", name)

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        m = inputs.loss_mask  # [N]
        trn = upcast(inputs.trainer_logprobs)  # [N]
        old = inputs.old_logprobs
        base = trn.detach() if old is None else upcast(old.detach())
        log_r = torch.where(m, trn - base, 0.0)  # [N]
        if self.level == "sequence":
            seq_log_r, _ = inputs.segments.mean(log_r, m)  # [S]
            log_r = torch.where(m, inputs.segments.broadcast(seq_log_r), 0.0)
        x = torch.where(m, upcast(inputs.plan.require("ref_logprobs", inputs.name).detach()) - trn, 0.0)
        k3 = torch.exp(x) - x - 1  # [N]
        weighted = torch.exp(log_r) * k3  # [N]
        named = {"ref_kl_penalty": (k3, m), "ratio_weighted_kl": (weighted, m)}
        metrics, counts = metric_means(named, inputs.segments, inputs.per_sequence_metrics)
        return ComponentOutput(self.coef * weighted, metrics, counts)
