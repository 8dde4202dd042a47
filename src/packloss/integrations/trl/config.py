"""TRL 1.16 ``GRPOConfig`` → a packloss :class:`~packloss.Recipe`: :func:`from_trl`.

``from_trl(config)`` reads the loss options of a TRL 1.16 ``GRPOConfig`` (any object with its field
names; a missing field takes TRL 1.16's default) and returns the recipe whose loss and gradient equal
``GRPOTrainer._compute_loss``'s (``tests/integrations/test_trl.py`` runs TRL's own code on random
float64 data and compares within 1e-10 relative). The streams of the plan are TRL's::

    outputs.logprobs    = per_token_logps            (the trainer's forward)
    old_logprobs        = old_per_token_logps        (absent when TRL skips it: on-policy, sg(trn))
    inference_logprobs  = sampling_per_token_logps   (vLLM's; read by the rollout correction)
    ref_logprobs        = ref_per_token_logps        (beta != 0)
    advantages          = advantages, one value per completion broadcast to its tokens
    mask                = completion_mask · tool_mask

:func:`mapping_rows` gives the table (``docs/objectives.md``, section "TRL 1.16"). Per loss type,
with ``r = exp(trn − old)``, ``ε = epsilon``, ``ε_h = epsilon_high`` (``epsilon`` when unset), ``s_i =
exp(mean_{t∈i} log r_t)`` and ``G`` = ``gradient_accumulation_steps``, ``B`` =
``per_device_train_batch_size``, ``W`` = the number of processes:

* ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``: PPO clip ``PPOClip(ε, ε_h)``; ``delta`` (TRL's
  two-sided clip ``min(min(r, δ)·A, clip(r)·A)``) is the dual clip ``dual_clip_c=δ`` (identical for
  ``δ ≥ 1 + ε_h``; a smaller ``δ`` also caps positive advantages and is not mapped). Sequence level:
  :class:`~packloss.core.trust_regions.GSPO` (GSPO-token, same value and gradient as TRL's
  differentiable ``s_i`` when every token of a sequence carries the same weight), or
  :class:`SequenceLevel` (the differentiable ``s_i`` itself) with ``delta`` or a token-level vLLM
  correction, whose per-token weights GSPO-token would not spread over the sequence as TRL does.
* ``cispo``: :class:`CISPOCap` ``sg(min(r, ε_h))·A·trn``: TRL's ``epsilon_high`` is an absolute cap,
  and there is no lower bound (packloss's ``CISPO`` clamps ``r`` to ``[1 − low, 1 + high]``). With
  ``epsilon_high`` unset the cap is ``epsilon`` (0.2 by default: every ratio above 0.2 is capped; TRL's
  semantics, mapped as they are). ``delta`` is not read.
* ``sapo``: packloss's ``SAPO(τ_pos, τ_neg)`` (``sapo_temperature_pos``/``_neg``): ``(4/τ)·σ(τ(r−1))·A``.
  packloss clamps ``log r`` to ``[−20, 20]`` before ``exp`` (as verl); TRL does not: they differ only
  past ``|log r| > 20``. TRL builds ``τ`` with ``torch.where`` of two Python floats, i.e. in float32
  whatever the data's dtype (``τ_neg = 1.05`` is 1.0499999523). Sequence level: ``SequenceLevel(SAPO)``
  (TRL gates ``s_i``).
* ``vespo``: :class:`VESPO`: ``sg(φ(w_i))·A·trn`` with the Gamma weight ``φ`` of the sequence ratio
  ``w_i = exp(Σ_t clamp(log r_t, ±20) + Σ_t clamp(log c_t, log 1e-8, 20))`` (``c``: TRL's token-level
  vLLM correction, which VESPO folds into ``w`` instead of multiplying the loss by it).

Normalisation (TRL's step = the ``G`` micro-batches of one optimizer step on ``W`` ranks;
packloss's convention: every rank's loss is its share of the step's loss, the ranks' gradients are
summed — with DDP, which averages, multiply the loss by ``W``):

* ``dapo``, ``cispo``, ``vespo``: ``token``. TRL divides by ``num_items_in_batch · G /
  (steps_per_generation · W)``, the generation batch's member tokens scaled to one accumulation
  window: the step's member-token count when ``steps_per_generation == gradient_accumulation_steps``
  (TRL's default); otherwise TRL's denominator is the generation's average per step.
* ``dr_grpo``: ``constant``, ``C = B · max_completion_length · G · W``.
* ``luspo``: ``constant``, ``C = B · G · W`` (TRL: each row's token sum, averaged over the ``B`` rows
  of the micro-batch, rows without a loss token included).
* ``grpo``, ``sapo``: ``sequence_mean``. TRL averages over the ``B`` rows of each micro-batch,
  **counting rows without a loss token** (``mask_truncated_completions``, tool masks); packloss counts
  the sequences with members. Equal when every row has a member; otherwise TRL's loss is packloss's
  times (rows with members / rows).
* ``bnpo``: ``token``. TRL takes the token mean **per micro-batch** (divided by ``G``); with step
  denominators packloss takes it over the step: equal for one micro-batch, or for micro-batches of
  equal member counts. TRL's exactly: ``compute_loss`` without step denominators, divided by ``G``.

Other terms: ``beta`` with ``use_bias_correction_kl=False`` is ``KLPenalty(β, "k3", "ref")``; with
``use_bias_correction_kl=True`` (TRL's default) TRL multiplies the k3 term by the (differentiable)
ratio ``r`` (``s_i`` at sequence level), which ``KLPenalty`` does not express: a second part
``"kl"`` (:class:`RatioWeightedKL`, same normalisation) carries it. The vLLM correction
(``use_vllm`` and ``vllm_importance_sampling_correction``) is a
:class:`~packloss.core.corrections.RolloutCorrection` on ``ρ = exp(old − inf)`` (``token_*``: per
token; ``sequence_*``: the product over the sequence), ``*_truncate``: ``clamp(ρ, clip_min,
clip_max)``, ``*_mask``: ``ρ`` inside ``[clip_min, clip_max]``, else 0. TRL turns a NaN sampling
log-prob into ``ρ = 1``; packloss needs finite ``inference_logprobs`` on the members.
``entropy_coef`` (static) is a part ``"entropy"`` (:class:`~packloss.Entropy`, ``token``; TRL takes its
mean per micro-batch, as ``bnpo``).

Not mapped (``NotImplementedError`` naming the option): ``top_entropy_quantile < 1`` (a quantile of
the entropy over the gathered micro-batch), ``off_policy_mask_threshold``, ``use_adaptive_entropy``,
``vllm_importance_sampling_clip_max=None`` (``RolloutCorrection.high`` must be finite), ``delta <
1 + epsilon_high``, ``vespo`` with a vLLM band that excludes 1. Outside the loss (not read):
advantages (``scale_rewards``, ``reward_weights``, ``multi_objective_aggregation``: ship them as
``advantages``), ``mask_truncated_completions`` (the mask), ``num_iterations`` (the old stream),
``router_aux_loss_coef`` (the model's MoE loss) and eval mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from packloss import Entropy
from packloss.core.bin import ComponentInputs, ComponentOutput, Normalize, outputs_from_named, upcast
from packloss.core.corrections import RolloutCorrection
from packloss.core.pg import KLPenalty, PolicyGradient
from packloss.core.recipe import Part, Recipe
from packloss.core.segments import broadcast, segment_mean, segment_sum
from packloss.core.trust_regions import (
    GSPO,
    TRUST_REGIONS,
    PolicyTerms,
    PPOClip,
    Surrogate,
    TrustRegion,
    register_trust_region,
)

__all__ = [
    "from_trl",
    "mapping_rows",
    "mapping_table",
    "MappingRow",
    "LOSS_TYPES",
    "IS_MODES",
    "TRL_DEFAULTS",
    "CISPOCap",
    "SequenceLevel",
    "VESPO",
    "RatioWeightedKL",
]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
"""TRL 1.16's ``loss_type`` values."""
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""TRL 1.16's ``vllm_importance_sampling_mode`` values."""
LEVELS = ("token", "sequence")

TRL_DEFAULTS: dict[str, Any] = {
    "loss_type": "dapo",
    "importance_sampling_level": "token",
    "epsilon": 0.2,
    "epsilon_high": None,
    "delta": None,
    "beta": 0.0,
    "use_bias_correction_kl": True,
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
    "top_entropy_quantile": 1.0,
    "off_policy_mask_threshold": None,
    "use_vllm": False,
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_clip_min": None,
    "vllm_importance_sampling_cap": None,
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "max_completion_length": 512,
}
"""The TRL 1.16 defaults of the ``GRPOConfig`` fields :func:`from_trl` reads (used for a missing field)."""

_LOG_EPS = math.log(1e-8)  # VESPO's lower clamp of log-weights (TRL: log(1e-8))
_LOG_CLAMP = 20.0  # VESPO's clamp of log-ratios and log-weights


# ---------------------------------------------------------------------------------------------------
# Trust regions TRL has and packloss's core does not
# ---------------------------------------------------------------------------------------------------


def _finite(owner: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{owner}.{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be finite, got {value}")
    return float(value)


def _sequence_log_ratio(t: PolicyTerms) -> Tensor:
    """``log s_i = mean_{u∈i} log r_u`` of each token's sequence, differentiable.  ``[N]``."""
    seq_log_r, _ = segment_mean(t.log_r, t.m, t.seq_ids, t.num_seqs)  # [S]
    return torch.where(t.m, broadcast(seq_log_r, t.seq_ids), 0.0)


@register_trust_region("sequence_level")
@dataclass(frozen=True)
class SequenceLevel(TrustRegion):
    """An inner region on the sequence ratio (GSPO's sequence-level objective, TRL's
    ``importance_sampling_level="sequence"``)::

        s_i = exp(mean_{u∈i} log r_u)      (differentiable: ∂s_i/∂trn_u = s_i / n_i)
        J_t = inner.surrogate(r_t := s_{i(t)})

    Unlike GSPO-token (``sg(s_i)·exp(trn − sg(trn))``, :class:`~packloss.core.trust_regions.GSPO`),
    the gradient of every token's term flows to all tokens of its sequence, so the two differ when the
    tokens of a sequence carry different weights (a token-level rollout correction). Metrics: the
    inner region's and ``seq_ratio_*``.
    """

    inner: TrustRegion = PPOClip()

    def check(self) -> None:
        if not isinstance(self.inner, TrustRegion) or isinstance(self.inner, SequenceLevel):
            raise TypeError(f"SequenceLevel.inner must be a token-level TrustRegion, got {type(self.inner).__name__}")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        log_s = _sequence_log_ratio(t)  # [N]
        result = self.inner.surrogate(replace(t, log_r=log_s, r=torch.exp(log_s)))
        seq_log_r, count = segment_mean(t.log_r.detach(), t.m, t.seq_ids, t.num_seqs)  # [S]
        result.sequence_ratio = (torch.exp(seq_log_r), count > 0)
        return result


@register_trust_region("cispo_cap")
@dataclass(frozen=True)
class CISPOCap(TrustRegion):
    """CISPO with an absolute cap and no lower bound (MiniMax-M1's ``ε_low`` unset; ScaleRL's
    ``ε_max``; TRL's ``loss_type="cispo"`` with ``epsilon_high``)::

        J_t = sg(min(r_t, cap)) · A'_t · trn_t

    Metric ``clip_frac_high``: members with ``A' > 0`` and ``r > cap`` (TRL's ``cispo_clip_ratio``).
    No token is dropped.
    """

    cap: float = 5.0

    def check(self) -> None:
        super().check()
        if not self.cap > 0:
            raise ValueError(f"CISPOCap.cap must be > 0, got {self.cap}")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        r = t.r.detach()  # [N]
        weight = r.clamp(max=self.cap)
        objective = torch.where(t.m, weight * t.a * torch.where(t.m, t.trn, 0.0), 0.0)
        return Surrogate(objective, {"clip_frac_high": (t.a > 0) & (r > self.cap)})


@register_trust_region("vespo")
@dataclass(frozen=True)
class VESPO(TrustRegion):
    """VESPO (arXiv:2602.10693) as TRL 1.16 computes it: REINFORCE weighted by a Gamma function of
    the sequence's importance weight, detached::

        log w_i = clamp(Σ_{t∈i} clamp(log r_t, −20, 20) + Σ_{t∈i} clamp(log c_t, log 1e-8, 20), log 1e-8, 20)
        φ_t     = exp(λ + k·log w_i − λ·w_i)      (k, λ = k_pos, λ_pos if A_t ≥ 0 else k_neg, λ_neg;
                                                    λ clamped to ≥ 1e-4; φ(1) = 1; NaN/inf → 0)
        J_t     = sg(φ_t) · A'_t · trn_t

    ``c_t`` is the token weight of ``correction`` (a token-level
    :class:`~packloss.core.corrections.RolloutCorrection`, or None): VESPO folds the rollout mismatch
    into ``w`` instead of multiplying its loss by ``c``, so the objective must carry no correction of
    its own. Metric ``phi``: mean ``φ`` over the members. No token is dropped.
    """

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0
    correction: RolloutCorrection | None = None

    def check(self) -> None:
        for name in ("k_pos", "lambda_pos", "k_neg", "lambda_neg"):
            _finite("VESPO", name, getattr(self, name))
        c = self.correction
        if c is not None:
            if not isinstance(c, RolloutCorrection):
                raise TypeError(f"VESPO.correction must be a RolloutCorrection or None, got {type(c).__name__}")
            if c.level != "token":
                raise ValueError(f"VESPO.correction must be token-level, got level={c.level!r}")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        log_r = t.log_r.detach().clamp(-_LOG_CLAMP, _LOG_CLAMP)  # [N], 0 off the members
        seq = segment_sum(log_r, t.seq_ids, t.num_seqs)  # [S]
        if self.correction is not None:
            c, _ = self.correction.weights(t.inputs, "old", t.m, t.seq_ids, t.num_seqs)  # [N]
            log_c = torch.log(torch.where(t.m, c, 1.0)).clamp(_LOG_EPS, _LOG_CLAMP)  # log 0 = −inf → log 1e-8
            seq = seq + segment_sum(log_c, t.seq_ids, t.num_seqs)
        log_w = broadcast(seq.clamp(_LOG_EPS, _LOG_CLAMP), t.seq_ids)  # [N]
        nonneg = t.adv >= 0
        # filled, not torch.where(cond, float, float), which would be float32 in a float64 bin
        k = torch.full_like(log_w, self.k_neg).masked_fill(nonneg, self.k_pos)  # [N]
        lam = torch.full_like(log_w, self.lambda_neg).masked_fill(nonneg, self.lambda_pos).clamp_min(1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        objective = torch.where(t.m, phi * t.a * torch.where(t.m, t.trn, 0.0), 0.0)
        return Surrogate(objective, {"phi": (phi, t.m)})


# ---------------------------------------------------------------------------------------------------
# TRL's bias-corrected KL term
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RatioWeightedKL:
    """The k3 KL to the reference weighted by the live importance ratio (TRL's ``beta`` with
    ``use_bias_correction_kl=True``; DeepSeek-V3.2's unbiased reverse-KL estimate)::

        ℓ_t = coef · ρ_t · (e^x − x − 1),   x = ref_t − trn_t,
        ρ_t = exp(trn_t − old_t)                          (level="token")
            | exp(mean_{u∈i} (trn_u − old_u))             (level="sequence")

    ``old`` is ``old_logprobs``, or ``sg(trn)`` without it (``ρ = 1`` in value, not in gradient). ``ρ``
    is differentiable. A component loss of its own (not a :class:`~packloss.KLPenalty`), so it is not
    multiplied by the rollout correction, as in TRL. Metrics over the members: ``ref_kl_penalty``, mean
    k3; ``ratio_weighted_kl``, mean ``ρ·k3`` (what TRL logs as ``kl``).
    """

    coef: float
    level: str = "token"

    def __post_init__(self) -> None:
        if not _finite("RatioWeightedKL", "coef", self.coef) >= 0:
            raise ValueError(f"RatioWeightedKL.coef must be >= 0, got {self.coef}")
        if self.level not in LEVELS:
            raise ValueError(f"RatioWeightedKL.level must be one of {LEVELS}, got {self.level!r}")

    def check_plan(self, plan, name: str) -> None:
        plan.require("ref_logprobs", name)

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        m = inputs.loss_mask  # [N]
        trn = upcast(inputs.trainer_logprobs)  # [N]
        old = inputs.old_logprobs
        base = trn.detach() if old is None else upcast(old.detach())
        log_r = torch.where(m, trn - base, 0.0)  # [N]
        if self.level == "sequence":
            seq_log_r, _ = segment_mean(log_r, m, inputs.seq_ids, inputs.num_seqs)  # [S]
            log_r = torch.where(m, broadcast(seq_log_r, inputs.seq_ids), 0.0)
        x = torch.where(m, upcast(inputs.plan.require("ref_logprobs", inputs.name).detach()) - trn, 0.0)
        k3 = torch.exp(x) - x - 1  # [N]
        weighted = torch.exp(log_r) * k3  # [N]
        metrics = {"ref_kl_penalty": (k3, m), "ratio_weighted_kl": (weighted, m)}
        return outputs_from_named(inputs, self.coef * weighted, metrics)


# ---------------------------------------------------------------------------------------------------
# The mapping
# ---------------------------------------------------------------------------------------------------


class _Config:
    """Reads a ``GRPOConfig``-like object; a missing field takes TRL 1.16's default."""

    def __init__(self, config: object) -> None:
        if config is None:
            raise TypeError("from_trl needs a GRPOConfig (or an object with its fields), got None")
        self.config = config

    def get(self, name: str) -> Any:
        return getattr(self.config, name, TRL_DEFAULTS[name])

    def choice(self, name: str, allowed: tuple[str, ...]) -> str:
        value = self.get(name)
        if value not in allowed:
            raise ValueError(f"GRPOConfig.{name} must be one of {allowed}, got {value!r}")
        return value

    def number(self, name: str, optional: bool = False) -> float | None:
        value = self.get(name)
        if value is None and optional:
            return None
        return _finite("GRPOConfig", name, value)

    def flag(self, name: str) -> bool:
        value = self.get(name)
        if not isinstance(value, bool):
            raise TypeError(f"GRPOConfig.{name} must be a bool, got {type(value).__name__}")
        return value

    def count(self, name: str) -> int:
        value = self.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"GRPOConfig.{name} must be a positive int, got {value!r}")
        return value


def _unmapped(option: str, value: object, why: str) -> NotImplementedError:
    return NotImplementedError(f"from_trl: GRPOConfig.{option}={value!r} is not mapped: {why}")


def _check_unmapped(c: _Config) -> None:
    q = c.number("top_entropy_quantile")
    if q < 1.0:
        why = "TRL keeps the tokens above a quantile of the entropy gathered over every rank's micro-batch"
        raise _unmapped("top_entropy_quantile", q, why)
    if c.get("off_policy_mask_threshold") is not None:
        why = "off-policy sequence masking (DeepSeek-V3.2) has no packloss part"
        raise _unmapped("off_policy_mask_threshold", c.get("off_policy_mask_threshold"), why)
    if c.flag("use_adaptive_entropy"):
        raise _unmapped("use_adaptive_entropy", True, "the entropy coefficient changes with the measured entropy")


def _correction(c: _Config) -> RolloutCorrection | None:
    """The vLLM importance-sampling correction, or None when TRL applies none."""
    if not (c.flag("use_vllm") and c.flag("vllm_importance_sampling_correction")):
        return None
    mode = c.choice("vllm_importance_sampling_mode", IS_MODES)
    cap = c.number("vllm_importance_sampling_cap", optional=True)  # deprecated alias: TRL copies it to clip_max
    high = cap if cap is not None else c.number("vllm_importance_sampling_clip_max", optional=True)
    low = c.number("vllm_importance_sampling_clip_min", optional=True)
    if high is None:
        raise _unmapped("vllm_importance_sampling_clip_max", None, "RolloutCorrection needs a finite upper bound")
    if low is not None and not low < high:
        raise ValueError(
            f"GRPOConfig.vllm_importance_sampling_clip_min ({low}) must be less than "
            f"vllm_importance_sampling_clip_max ({high})"
        )
    if not high > 0:
        raise _unmapped("vllm_importance_sampling_clip_max", high, "a bound <= 0 masks or zeroes every token")
    # ρ > 0, so a lower bound ≤ 0 neither clamps nor masks anything: no lower bound
    low = low if low is not None and low > 0 else None
    level, kind = mode.split("_")
    return RolloutCorrection(level=level, mode=kind, high=high, low=low, sequence_agg="sum")


def _sapo(c: _Config) -> TrustRegion:
    pos, neg = c.number("sapo_temperature_pos"), c.number("sapo_temperature_neg")
    return TRUST_REGIONS["sapo"](tau_pos=pos, tau_neg=neg)


def _trust_region(c: _Config, loss_type: str, level: str, correction: RolloutCorrection | None) -> TrustRegion:
    eps = c.number("epsilon")
    eps_high = c.number("epsilon_high", optional=True)
    eps_high = eps if eps_high is None else eps_high
    sequence = level == "sequence"
    if loss_type == "vespo":
        if correction is not None:
            if correction.level != "token":
                raise ValueError(
                    "GRPOConfig.vllm_importance_sampling_mode must be 'token_truncate' or 'token_mask' with "
                    f"loss_type='vespo' (TRL rejects it too), got {c.get('vllm_importance_sampling_mode')!r}"
                )
            low = 0.0 if correction.low is None else correction.low
            if not low <= 1.0 <= correction.high:
                # TRL sums log c over every position, non-members (c = processed 1) included
                why = "with loss_type='vespo' TRL adds log c(1) != 0 for every non-member position"
                raise _unmapped("vllm_importance_sampling_clip_min/max", (correction.low, correction.high), why)
        names = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
        return VESPO(*(c.number(n) for n in names), correction=correction)
    if loss_type == "cispo":
        if not eps_high > 0:
            raise ValueError(f"GRPOConfig.epsilon_high (CISPO's cap) must be > 0, got {eps_high}")
        region: TrustRegion = CISPOCap(eps_high)
        return SequenceLevel(region) if sequence else region
    if loss_type == "sapo":
        region = _sapo(c)
        return SequenceLevel(region) if sequence else region
    if not 0 <= eps < 1 or not eps_high >= 0:
        raise ValueError(f"GRPOConfig.epsilon must be in [0, 1) and epsilon_high >= 0, got {eps}, {eps_high}")
    delta = c.number("delta", optional=True)
    if delta is not None and not (delta >= 1 + eps_high and delta > 1):
        why = f"below 1 + epsilon_high = {1 + eps_high} TRL's cap also binds on positive advantages (dual clip: not)"
        raise _unmapped("delta", delta, why)
    if sequence:
        token_weights = correction is not None and correction.level == "token"
        if delta is None and not token_weights:
            return GSPO(eps, eps_high)
        return SequenceLevel(PPOClip(eps, eps_high, dual_clip_c=delta))
    return PPOClip(eps, eps_high, dual_clip_c=delta)


def _normalization(c: _Config, loss_type: str, num_processes: int) -> tuple[Normalize, float | None]:
    accumulation = c.count("gradient_accumulation_steps")
    if loss_type in ("grpo", "sapo"):
        return Normalize.SEQUENCE_MEAN, None
    if loss_type in ("bnpo", "dapo", "cispo", "vespo"):
        return Normalize.TOKEN, None
    rows = c.count("per_device_train_batch_size") * accumulation * num_processes
    if loss_type == "luspo":
        return Normalize.CONSTANT, float(rows)
    return Normalize.CONSTANT, float(rows * c.count("max_completion_length"))  # dr_grpo


def _num_processes(config: object, num_processes: int | None) -> int:
    if num_processes is None:
        num_processes = getattr(config, "world_size", 1)
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
    return num_processes


def from_trl(grpo_config: object, *, num_processes: int | None = None) -> Recipe:
    """The :class:`~packloss.Recipe` of a TRL 1.16 ``GRPOConfig`` (module doc).

    Args:
        grpo_config: a ``trl.GRPOConfig`` or any object with its fields (missing ones take TRL 1.16's
            defaults, :data:`TRL_DEFAULTS`).
        num_processes: the data-parallel world size ``W`` in the ``constant`` modes (``dr_grpo``,
            ``luspo``); default ``grpo_config.world_size`` (1 without it).

    Returns a recipe with the part ``"pg"`` (the policy gradient, its vLLM correction and, without
    ``use_bias_correction_kl``, the β·k3 penalty), ``"kl"`` (β·ρ·k3, with ``use_bias_correction_kl``)
    and ``"entropy"`` (``entropy_coef != 0``). Raises ``NotImplementedError`` naming an option packloss
    cannot express, ``ValueError``/``TypeError`` naming a bad one.
    """
    c = _Config(grpo_config)
    loss_type = c.choice("loss_type", LOSS_TYPES)
    level = c.choice("importance_sampling_level", LEVELS)
    _check_unmapped(c)
    correction = _correction(c)
    region = _trust_region(c, loss_type, level, correction)
    mode, constant = _normalization(c, loss_type, _num_processes(grpo_config, num_processes))
    beta = c.number("beta")
    if beta < 0:
        raise ValueError(f"GRPOConfig.beta must be >= 0, got {beta}")
    bias_corrected = beta != 0 and c.flag("use_bias_correction_kl")
    penalties = (KLPenalty(beta, "k3", "ref"),) if beta != 0 and not bias_corrected else ()
    pg = PolicyGradient(region, penalties=penalties, correction=None if loss_type == "vespo" else correction)
    parts = {"pg": Part(pg, mode, constant)}
    if bias_corrected:
        parts["kl"] = Part(RatioWeightedKL(beta, level), mode, constant)
    entropy_coef = c.number("entropy_coef")
    if entropy_coef != 0:
        parts["entropy"] = Part(Entropy(entropy_coef), Normalize.TOKEN)
    return Recipe(parts, notes=tuple(_ROWS[loss_type].notes))


# ---------------------------------------------------------------------------------------------------
# The table (docs/objectives.md, "TRL 1.16")
# ---------------------------------------------------------------------------------------------------


class MappingRow(NamedTuple):
    """One row of the TRL mapping: ``loss_type``, the packloss objective, the normalisation, notes."""

    loss_type: str
    objective: str
    normalization: str
    notes: tuple[str, ...]


_PPO = (
    "`PPOClip(ε, ε_h, dual_clip_c=δ)`; sequence level: `GSPO(ε, ε_h)`, or `SequenceLevel(PPOClip(…))` "
    "with δ or a token-level vLLM mode"
)
_SEQ_ROWS = "rows without a loss token count in TRL's mean (TRL = packloss × rows with members / rows)"
_ROWS: dict[str, MappingRow] = {
    "grpo": MappingRow("grpo", _PPO, "`sequence_mean`", (_SEQ_ROWS,)),
    "bnpo": MappingRow(
        "bnpo",
        _PPO,
        "`token`",
        (
            "TRL: token mean per micro-batch / G; packloss's step mean equals it for one micro-batch "
            "(TRL's exactly: no step denominators, / G)",
        ),
    ),
    "dr_grpo": MappingRow("dr_grpo", _PPO, "`constant`, `C = B·max_completion_length·G·W`", ()),
    "dapo": MappingRow(
        "dapo",
        _PPO,
        "`token`",
        (
            "TRL's `num_items_in_batch·G/(steps_per_generation·W)` is the step's token count when "
            "`steps_per_generation == gradient_accumulation_steps`",
        ),
    ),
    "cispo": MappingRow(
        "cispo",
        "`CISPOCap(ε_h)`: `sg(min(r, ε_h))·A·trn`; sequence level: `SequenceLevel(CISPOCap(ε_h))`",
        "`token`",
        ("`epsilon_high` is an absolute cap, no lower bound; unset, the cap is `epsilon`", "denominator as `dapo`"),
    ),
    "sapo": MappingRow(
        "sapo",
        "`SAPO(τ_pos, τ_neg)`; sequence level: `SequenceLevel(SAPO(…))`",
        "`sequence_mean`",
        (
            "packloss (as verl) clamps `log r` to ±20, TRL does not",
            "TRL's τ are float32 (`torch.where` of floats)",
            _SEQ_ROWS,
        ),
    ),
    "luspo": MappingRow("luspo", _PPO, "`constant`, `C = B·G·W`", ()),
    "vespo": MappingRow(
        "vespo",
        "`VESPO(k±, λ±, correction)`: `sg(φ(w_i))·A·trn`, the vLLM weight folded into `w_i`",
        "`token`",
        ("vLLM mode must be `token_*` (as TRL) with a band containing 1", "denominator as `dapo`"),
    ),
}
_COMMON = (
    (
        "beta",
        "`KLPenalty(β, 'k3', 'ref')` in `pg`; `use_bias_correction_kl=True` (default): part `kl`, "
        "`RatioWeightedKL(β, level)` = β·r·k3, same normalisation",
    ),
    (
        "vllm_importance_sampling_*",
        "`RolloutCorrection(level, 'truncate'|'mask', high=clip_max, low=clip_min, "
        "sequence_agg='sum')` on `old − inf`; NaN sampling log-probs: TRL ρ = 1, packloss needs finite ones",
    ),
    ("entropy_coef", "part `entropy`, `Entropy(coef)`, `token` (TRL: per micro-batch mean / G)"),
)


def mapping_rows() -> list[MappingRow]:
    """The mapping as rows ``(loss_type, packloss objective, normalisation, notes)``, one per TRL 1.16
    ``loss_type`` in :data:`LOSS_TYPES` order, then the options every loss type shares (``beta``, the
    vLLM correction, ``entropy_coef``) with an empty normalisation."""
    rows = [_ROWS[name] for name in LOSS_TYPES]
    return rows + [MappingRow(option, text, "", ()) for option, text in _COMMON]


def mapping_table(rows: list[MappingRow] | None = None) -> str:
    """:func:`mapping_rows` as a Markdown table (``docs/objectives.md``, section "TRL 1.16")."""
    lines = ["| TRL `loss_type` / option | packloss objective | normalisation | notes |", "|---|---|---|---|"]
    for row in rows if rows is not None else mapping_rows():
        cells = (f"`{row.loss_type}`", row.objective, row.normalization or "—", "; ".join(row.notes) or "—")
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)
