"""A TRL 1.16 ``GRPOConfig`` as a packloss :class:`~packloss.Recipe` whose loss and gradient equal
``GRPOTrainer._compute_loss``'s: :func:`from_trl`. Any object with the config's field names works (a
missing field takes TRL 1.16's default). The streams, the normalisation rules and every difference:
``docs/integrations/trl.md``; the table: ``docs/objectives.md``."""

from __future__ import annotations

from typing import Any

import torch

from packloss.core import checks
from packloss.core.bin import Component, Normalize
from packloss.core.corrections import OffPolicyMask, RolloutCorrection
from packloss.core.entropy import Entropy
from packloss.core.kl import KLPenalty, RatioWeightedKL
from packloss.core.pg import PolicyGradient
from packloss.core.recipe import POLICY, Recipe
from packloss.core.top_entropy import TopEntropy
from packloss.core.trust_regions import GSPO, SAPO, VESPO, CISPOCap, PPOClip, SequenceLevel, TrustRegion
from packloss.integrations.common.config import ConfigReader

__all__ = ["LOSS_TYPES", "IS_MODES", "TRL_DEFAULTS", "from_trl"]

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

_SEQUENCE_ROWS = "rows without a loss token count in TRL's mean (TRL = packloss × rows with members / rows)"
_GENERATION_TOKENS = (
    "TRL's `num_items_in_batch·G/(steps_per_generation·W)` is the step's token count when "
    "`steps_per_generation == gradient_accumulation_steps`"
)
NOTES: dict[str, tuple[str, ...]] = {
    "grpo": (_SEQUENCE_ROWS,),
    "bnpo": (
        "TRL: token mean per micro-batch / G; packloss's step mean equals it for one micro-batch "
        "(TRL's exactly: no step denominators, / G)",
    ),
    "dr_grpo": ("C = per_device_train_batch_size · max_completion_length · G · W",),
    "dapo": (_GENERATION_TOKENS,),
    "cispo": ("`epsilon_high` is an absolute cap, no lower bound; unset, the cap is `epsilon`", _GENERATION_TOKENS),
    "sapo": (
        "packloss (as verl) clamps `log r` to ±20, TRL does not",
        "TRL's τ are float32 (`torch.where` of floats)",
        _SEQUENCE_ROWS,
    ),  # fmt: skip
    "luspo": ("C = per_device_train_batch_size · G · W",),
    "vespo": ("vLLM mode must be `token_*` (as TRL) with a band containing 1", _GENERATION_TOKENS),
}
"""Where each ``loss_type``'s recipe differs from TRL, as the recipe's notes."""


def _unmapped(option: str, value: object, why: str) -> NotImplementedError:
    return NotImplementedError(f"from_trl: GRPOConfig.{option}={value!r} is not mapped: {why}")


TOP_ENTROPY_NOTES = (
    "TRL's quantile is over one micro-batch's loss tokens gathered over the ranks, in float32; packloss's over "
    "the bins given to `TopEntropy.over` (PacklossGRPOTrainer: TRL's), else the bin's own, in the entropy's dtype",
)
_TOP_ENTROPY_BONUS = (
    "TRL's entropy bonus is over the kept tokens: PacklossGRPOTrainer narrows the entropy component's mask, "
    "the recipe alone keeps every member"
)


def _top_entropy(c: ConfigReader) -> TopEntropy | None:
    """TRL's high-entropy token mask, or None when TRL keeps every token (``top_entropy_quantile = 1``)."""
    q = c.number("top_entropy_quantile")
    if not 0 <= q <= 1:
        raise ValueError(f"GRPOConfig.top_entropy_quantile must be in [0, 1], got {q}")
    return None if q == 1 else TopEntropy(q)


def _correction(c: ConfigReader) -> RolloutCorrection | None:
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
    low = low if low is not None and low > 0 else None  # ρ > 0: a lower bound ≤ 0 neither clamps nor masks
    level, kind = mode.split("_")
    return RolloutCorrection(level=level, mode=kind, high=high, low=low, sequence_agg="sum")


def _trust_region(c: ConfigReader, loss_type: str, level: str, correction: RolloutCorrection | None) -> TrustRegion:
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
        return SequenceLevel(CISPOCap(eps_high)) if sequence else CISPOCap(eps_high)
    if loss_type == "sapo":
        region = SAPO(tau_pos=c.positive("sapo_temperature_pos"), tau_neg=c.positive("sapo_temperature_neg"))
        return SequenceLevel(region) if sequence else region
    if not 0 <= eps < 1 or not eps_high >= 0:
        raise ValueError(f"GRPOConfig.epsilon must be in [0, 1) and epsilon_high >= 0, got {eps}, {eps_high}")
    delta = c.number("delta", optional=True)
    if delta is not None and not (delta >= 1 + eps_high and delta > 1):
        why = f"below 1 + epsilon_high = {1 + eps_high} TRL's cap also binds on positive advantages (dual clip: not)"
        raise _unmapped("delta", delta, why)
    if sequence:
        # per-token weights (a token-level vLLM correction, the entropy mask): TRL's s_i spreads their gradient
        token_weights = (correction is not None and correction.level == "token") or c.number("top_entropy_quantile") < 1
        if delta is None and not token_weights:
            return GSPO(eps, eps_high)
        return SequenceLevel(PPOClip(eps, eps_high, dual_clip_c=delta))
    return PPOClip(eps, eps_high, dual_clip_c=delta)


def _normalization(c: ConfigReader, loss_type: str, num_processes: int) -> tuple[Normalize, float | None]:
    accumulation = c.integer("gradient_accumulation_steps", minimum=1)
    if loss_type in ("grpo", "sapo"):
        return Normalize.SEQUENCE_MEAN, None
    if loss_type in ("bnpo", "dapo", "cispo", "vespo"):
        return Normalize.TOKEN, None
    rows = c.integer("per_device_train_batch_size", minimum=1) * accumulation * num_processes
    if loss_type == "luspo":
        return Normalize.CONSTANT, float(rows)
    return Normalize.CONSTANT, float(rows * c.integer("max_completion_length", minimum=1))  # dr_grpo


def from_trl(grpo_config: object, *, num_processes: int | None = None) -> Recipe:
    """The :class:`~packloss.Recipe` of a TRL 1.16 ``GRPOConfig``.

    Args:
        grpo_config: a ``trl.GRPOConfig`` or any object with its fields (missing ones take
            :data:`TRL_DEFAULTS`).
        num_processes: the data-parallel world size ``W`` in the ``constant`` modes (``dr_grpo``,
            ``luspo``); default ``grpo_config.world_size`` (1 without it).

    Returns a recipe with the component ``"pg"`` (the policy gradient, its vLLM correction, with
    ``top_entropy_quantile < 1`` its :class:`~packloss.core.top_entropy.TopEntropy` and, without
    ``use_bias_correction_kl``, the β·k3 penalty), ``"kl"`` (β·ρ·k3, with ``use_bias_correction_kl``)
    and ``"entropy"`` (``entropy_coef != 0``, or ``use_adaptive_entropy``: its ``coef`` is a 0-d tensor that
    :class:`~packloss.integrations.trl.PacklossGRPOTrainer` sets as TRL's controller does). Raises
    ``NotImplementedError`` naming an option packloss
    cannot express, ``ValueError``/``TypeError`` naming a bad one.
    """
    if grpo_config is None:
        raise TypeError("from_trl needs a GRPOConfig (or an object with its fields), got None")
    c = ConfigReader(grpo_config, "GRPOConfig", TRL_DEFAULTS)
    loss_type = c.choice("loss_type", LOSS_TYPES)
    level = c.choice("importance_sampling_level", LEVELS)
    correction = _correction(c)
    region = _trust_region(c, loss_type, level, correction)
    world = c.get("world_size", 1) if num_processes is None else num_processes
    mode, constant = _normalization(c, loss_type, checks.integer("num_processes", world, minimum=1))
    beta = c.nonnegative("beta")
    bias_corrected = beta != 0 and c.flag("use_bias_correction_kl")
    penalties = (KLPenalty(beta, "k3", "ref"),) if beta != 0 and not bias_corrected else ()
    threshold = c.number("off_policy_mask_threshold", optional=True)
    # TRL measures the drift against vLLM's sampling log-probs when it has them, else the old policy's
    opm = None if threshold is None else OffPolicyMask(threshold, "rollout" if c.flag("use_vllm") else "old")
    pg = PolicyGradient(
        region,
        penalties=penalties,
        correction=None if loss_type == "vespo" else correction,
        off_policy_mask=opm,
        top_entropy=_top_entropy(c),
    )
    components = {POLICY: Component(pg, normalize=mode, constant=constant)}
    if bias_corrected:
        components["kl"] = Component(RatioWeightedKL(beta, level), normalize=mode, constant=constant)
    entropy_coef = c.number("entropy_coef")
    if c.flag("use_adaptive_entropy"):
        # a 0-d tensor the trainer sets before every call: TRL's controller moves the coefficient between
        # optimizer steps and applies it only while the entropy is at or below entropy_target
        coef = torch.tensor(entropy_coef, dtype=torch.float64)
        components["entropy"] = Component(Entropy(coef), normalize=Normalize.TOKEN)
    elif entropy_coef != 0:
        components["entropy"] = Component(Entropy(entropy_coef), normalize=Normalize.TOKEN)
    notes = NOTES[loss_type]
    if pg.top_entropy is not None:
        notes += TOP_ENTROPY_NOTES + ((_TOP_ENTROPY_BONUS,) if "entropy" in components else ())
    return Recipe(components, notes=notes)
