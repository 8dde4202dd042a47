"""packloss.integrations.verl: a verl 0.9.1 actor config as a packloss :class:`~packloss.Recipe`.

:func:`from_verl` reads the actor config verl trains with (``actor_rollout_ref.actor``: verl's
``ActorConfig`` dataclass, an OmegaConf ``DictConfig`` or a plain dict; duck-typed, verl is not
imported) and, optionally, the trainer's ``algorithm.rollout_correction``, and returns the recipe whose
loss on packed bins is the loss verl computes on its padded ``[B, T]`` batch::

    recipe = from_verl(cfg.actor_rollout_ref.actor, rollout_correction=cfg.algorithm.rollout_correction)
    mask = rejection_mask(cfg.algorithm.rollout_correction, old, inf, mask, seq_lens)  # only with rollout_rs
    plan = Plan(seq_lens, recipe.components(mask), inference_logprobs=inf, old_logprobs=old,
                ref_logprobs=ref, advantages=adv)

How verl runs a step (``verl/workers/utils/losses.py::ppo_loss``, called by the engine once per
micro-batch, each followed by ``backward``): the engine first counts ``batch_num_tokens`` (response-mask
tokens of the whole mini-batch, all-reduced over the data-parallel ranks), sets ``global_batch_size``
to ``ppo_mini_batch_size × rollout.n`` (every sequence of the mini-batch) and ``dp_size``, and
``ppo_loss`` puts them in ``config.global_batch_info``. Per micro-batch the loss is ::

    pg  = policy_loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                         rollout_is_weights)             # agg_loss(..., **global_batch_info)
    loss = pg − entropy_coeff · agg_loss(entropy) + kl_loss_coef · agg_loss(kl_penalty(log_prob, ref))

``agg_loss`` multiplies by ``dp_size`` and FSDP averages the gradients over the ranks, so the step's
gradient is that of ``Σ_{ranks, micro-batches} loss / dp_size``: a sum over the whole mini-batch divided
by its global counts. That is packloss's step denominators (:func:`~packloss.count_denominators`, with
``all_reduce=True`` across ranks) with the normalisation below; it does not depend on the micro-batch
split (except ``geo_mean``, see below).

Normalisation (``actor.loss_agg_mode``; ``G = ppo_mini_batch_size × rollout_n``, ``L`` the scale)::

    token-mean               Σ ℓ / batch_num_tokens          → Normalize.TOKEN
    token-sum                Σ ℓ                             → Normalize.CONSTANT, C = 1
    seq-mean-token-sum       Σ_s Σ_{t∈s} ℓ / G               → Normalize.SEQUENCE_SUM
    seq-mean-token-mean      Σ_s (Σ_{t∈s} ℓ / n_s) / G        → Normalize.SEQUENCE_MEAN
    seq-mean-token-sum-norm  Σ_s Σ_{t∈s} ℓ / G / L           → Normalize.CONSTANT, C = G · L

Where verl and packloss differ (each is tested as a difference in ``tests/integrations/test_verl.py``):

* **Sequences without members.** verl's ``G`` counts every sequence of the mini-batch, also those whose
  response mask is all zero (e.g. rejected by ``rollout_rs``); packloss's ``sequence_sum`` /
  ``sequence_mean`` count sequences with at least one member. With such sequences verl's seq-mean loss
  is packloss's times ``S_members / G``. ``seq-mean-token-sum-norm`` maps to ``C = G · L`` and agrees.
* **verl's ``+ 1e-8``** in ``seq-mean-token-mean``, ``geo_mean`` and ``seq_mean_k*`` (``Σ / (n_s + 1e-8)``)
  does nothing in verl's runs: the response mask is bool or integer there, so ``n_s`` is an int64 sum and
  ``n_s + 1e-8`` is a float32 ``n_s`` (exact up to 2^24). packloss divides by ``n_s`` (``geo_mean``:
  ``GMPO(eps=0)``). With a floating-point mask verl's eps would be a relative ``1e-8 / n_s``.
* **``loss_scale_factor = None``.** verl then divides ``seq-mean-token-sum-norm`` by the padded width
  ``T`` of its ``[B, T]`` tensors (the batch's longest response, ``max_response_len``): a property of the
  padding, which a packed bin does not have. Give ``response_length=T`` (or set
  ``actor.loss_scale_factor``); without either :func:`from_verl` raises.
* **Clamps.** ``vanilla`` clamps ``log r`` to ``[−20, 20]`` before ``exp`` (no gradient and ``r = e^−20``
  for a token with ``log r < −20``, which matters only for ``A > 0``); ``gspo`` clamps the token's
  ``log s_{i,t}`` at 10 (for ``A < 0`` and ``log s_i > 10`` the value is ``e^10·|A|`` with no gradient);
  ``low_var_kl``/``k3`` clamps ``x = ref − log π`` to ``[−20, 20]`` and the estimate to ``≤ 10`` (zero
  gradient for ``x > 2.53`` or ``x < −11``). packloss's ``PPOClip``, ``GSPO`` and ``k3`` do not clamp.
  The rollout-correction weights clamp their log-ratio (token, or the sequence's sum) to ``[−20, 20]``:
  a weight below ``e^−20`` is ``e^−20`` in verl. (``sapo``, ``dppo_tv``/``dppo_kl`` clamp as verl does.)
* **``geo_mean``** is ``mean`` over the rows of each micro-batch call (verl ignores
  ``global_batch_info`` there, and there is no ``dp_size`` factor): verl's step is the *sum* over
  micro-batches of per-micro-batch means, divided by ``dp_size`` by FSDP, which depends on the split
  and counts rows without members. packloss uses ``sequence_mean`` over the step; a single micro-batch
  on one rank without member-less rows agrees.
* **Rejection sampling** (``rollout_rs``) changes verl's response mask. Decoupled mode (the trainer
  computes it once per batch from ``old_log_prob`` and ``rollout_log_prob``, before the mini-batches):
  every part and every count sees the new mask; compute it with :func:`rejection_mask` and pass it to
  ``recipe.components`` (:func:`from_verl` cannot change the mask). Bypass mode (inside the loss, from
  the current ``log_prob``): only the policy term's numerator loses the rejected tokens (the counts,
  the KL and entropy terms keep them), which is a masking :class:`~packloss.RolloutCorrection` band with
  ``weighted=False``; only the criteria that are a band on the token or sequence ratio map
  (``token_k1``, ``token_k2``, ``token_k3``, ``seq_sum_k1``, ``seq_mean_k1``).
* **``clip_cov`` / ``kl_cov``** choose tokens by the covariance of the advantage and ``log π``: verl over
  each micro-batch with the live ``log π`` (``clip_cov`` draws its ``k`` band tokens at random),
  packloss's ``"clip_cov"`` / ``"kl_cov"`` over the whole step with the old log-probs (``clip_cov``: the
  ``k`` of largest covariance; :mod:`packloss.core.selection`). They agree on a step of one micro-batch
  on the first epoch (``π_θ = π_old``), ``clip_cov`` when at most ``k`` tokens are in its band.

Anything else that packloss cannot express raises ``NotImplementedError`` naming the option.
:func:`mapping_rows` returns the mapping as rows (generated by calling :func:`from_verl`) for the docs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from packloss import (
    TRUST_REGIONS,
    Entropy,
    KLPenalty,
    Layout,
    Normalize,
    Part,
    PolicyGradient,
    Recipe,
    RolloutCorrection,
    TrustRegion,
)
from packloss.core.segments import broadcast, segment_max, segment_sum
from packloss.core.trust_regions import CISPO, GSPO, PPOClip

__all__ = ["VERL_VERSION", "from_verl", "rejection_mask", "MappingRow", "mapping_rows", "mapping_markdown"]

VERL_VERSION = "0.9.1"
"""The verl release whose semantics this module maps (and its tests run against)."""

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOSS_MODES = (
    "vanilla",
    "gspo",
    "cispo",
    "gpg",
    "sapo",
    "geo_mean",
    "dppo_tv",
    "dppo_kl",
    "dro",
    "clip_cov",
    "kl_cov",
    "bypass_mode",
)
"""verl 0.9.1's ``POLICY_LOSS_REGISTRY`` names."""

# kl_loss_type → packloss estimator. verl's x is log π − ref (k1 = x, k2 = x²/2, k3 = e^−x + x − 1),
# packloss's x is ref − log π (k1 = −x, k2 = x²/2, k3 = eˣ − x − 1): the same functions. "k2+"/"mse+"
# is verl's straight-through with the k2 gradient under the k2 value, i.e. k2.
KL_TYPES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "mse+": "k2", "k2+": "k2", "low_var_kl": "k3", "k3": "k3"}
_KL_UNMAPPED = {
    "abs": "|log π − ref| has no packloss estimator",
    "full": "verl itself raises NotImplementedError for 'full'",
    "kl+": "straight-through (k1 value, k2 gradient) has no packloss estimator",
    "k1+": "straight-through (k1 value, k2 gradient) has no packloss estimator",
    "low_var_kl+": "straight-through (k3 value, k2 gradient) has no packloss estimator",
    "k3+": "straight-through (k3 value, k2 gradient) has no packloss estimator",
}

RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""verl's rejection-sampling criteria (``rollout_rs``, comma-separated; all must pass)."""
_RS_SAFETY = 20.0  # verl clamps the log-ratio of its rollout correction to [−20, 20]
_MISSING = object()
_LOSS_TYPES = ("ppo_clip", "reinforce")  # rollout_correction.loss_type of bypass mode


# ---------------------------------------------------------------------------------------------------
# Duck-typed config access
# ---------------------------------------------------------------------------------------------------


def _get(cfg: Any, key: str, default: Any = _MISSING, where: str = "actor_config") -> Any:
    """``cfg.key`` of a dataclass / namespace, or ``cfg[key]`` of a dict / ``DictConfig`` (a
    ``DictConfig``'s ``???`` counts as absent)."""
    if cfg is not None:
        if dataclasses.is_dataclass(cfg) or not isinstance(cfg, Mapping):
            value = getattr(cfg, key, _MISSING)
        else:
            value = cfg[key] if key in cfg else _MISSING
        if value is not _MISSING:
            return value
    if default is _MISSING:
        raise ValueError(f"{where}.{key} is missing from the verl config")
    return default


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


# ---------------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------------


def _normalization(
    actor: Any, agg: str, global_batch_size: int | None, response_length: int | None
) -> tuple[Normalize, float | None]:
    """``(Normalize, constant)`` of a verl ``loss_agg_mode`` (module doc)."""
    if agg == "token-mean":
        return Normalize.TOKEN, None
    if agg == "token-sum":
        return Normalize.CONSTANT, 1.0
    if agg == "seq-mean-token-sum":
        return Normalize.SEQUENCE_SUM, None
    if agg == "seq-mean-token-mean":
        return Normalize.SEQUENCE_MEAN, None
    if agg == "seq-mean-token-sum-norm":
        scale = _get(actor, "loss_scale_factor", None)
        if scale is None:
            scale = response_length
        if scale is None:
            raise ValueError(
                "loss_agg_mode='seq-mean-token-sum-norm' with actor_config.loss_scale_factor=None divides by "
                "verl's padded response width T, which packed bins do not have: pass response_length=T "
                "(the rollout's max response length) or set loss_scale_factor"
            )
        scale = _number(scale, "loss_scale_factor")
        if global_batch_size is None:
            mini = _get(actor, "ppo_mini_batch_size", None)
            n = _get(actor, "rollout_n", None)
            if mini is None or n is None:
                raise ValueError(
                    "loss_agg_mode='seq-mean-token-sum-norm' needs G = ppo_mini_batch_size × rollout_n: pass "
                    "global_batch_size= or set both in actor_config"
                )
            global_batch_size = int(mini) * int(n)
        constant = _number(global_batch_size, "global_batch_size") * scale
        if not constant > 0:
            raise ValueError(f"global_batch_size × loss_scale_factor must be > 0, got {constant}")
        return Normalize.CONSTANT, constant
    raise NotImplementedError(f"loss_agg_mode={agg!r} is not a verl {VERL_VERSION} mode (one of {LOSS_AGG_MODES})")


# ---------------------------------------------------------------------------------------------------
# Objectives
# ---------------------------------------------------------------------------------------------------


def _setting(policy_loss: Any, key: str, fallback: float) -> float:
    """``policy_loss.key``, or verl's fallback when it is None or absent."""
    value = _get(policy_loss, key, None, "actor_config.policy_loss")
    return _number(fallback if value is None else value, f"policy_loss.{key}")


def _clip_range(actor: Any) -> tuple[float, float]:
    """verl's ``(clip_ratio_low, clip_ratio_high)``, each falling back to ``clip_ratio``."""
    clip = _get(actor, "clip_ratio", 0.2)
    low, high = _get(actor, "clip_ratio_low", None), _get(actor, "clip_ratio_high", None)
    low = clip if low is None else low
    high = clip if high is None else high
    return _number(low, "clip_ratio_low"), _number(high, "clip_ratio_high")


def _registered(mode: str, name: str, **fields: float) -> TrustRegion:
    """The packloss trust region registered as ``name``, for verl's ``mode``."""
    return TRUST_REGIONS[name](**fields)


@dataclass(frozen=True)
class _Objective:
    """The policy-gradient part of a verl loss mode: its trust region, ratio denominator, extra
    penalties, and a normalisation of its own when verl ignores ``loss_agg_mode`` for it."""

    region: TrustRegion
    ratio: str = "old"
    penalties: tuple[KLPenalty, ...] = ()
    own_normalization: Normalize | None = None
    notes: tuple[str, ...] = ()


def _policy_objective(mode: str, actor: Any, policy_loss: Any) -> _Objective:
    """The :class:`_Objective` of verl's ``policy_loss.loss_mode`` (not ``bypass_mode``)."""
    low, high = _clip_range(actor)
    if mode == "vanilla":
        c = _number(_get(actor, "clip_ratio_c", 3.0), "clip_ratio_c")
        note = "verl clamps log r to [−20, 20]: for A > 0 and log r < −20 verl has r = e^−20 and no gradient"
        return _Objective(PPOClip(low, high, dual_clip_c=c), notes=(note,))
    if mode == "gspo":
        note = "verl clamps log s_{i,t} at 10: for A < 0 and log s_i > 10 verl's value is e^10·|A|, no gradient"
        return _Objective(GSPO(low, high), notes=(note,))
    if mode == "cispo":
        return _Objective(CISPO(low, high), notes=("verl clamps log r to [−20, 20] (binds only for clip_low ≈ 1)",))
    if mode == "gpg":
        return _Objective(_registered(mode, "gpg"))
    if mode == "sapo":
        tau_pos = _number(_get(actor, "tau_pos", 1.0), "tau_pos")
        tau_neg = _number(_get(actor, "tau_neg", 1.05), "tau_neg")
        note = "verl aggregates sapo's policy term by seq-mean-token-mean whatever loss_agg_mode says (not KL, entropy)"
        return _Objective(
            _registered(mode, "sapo", tau_pos=tau_pos, tau_neg=tau_neg),
            own_normalization=Normalize.SEQUENCE_MEAN,
            notes=(note,),
        )
    if mode == "geo_mean":
        note = (
            "verl's geo_mean is the mean over each micro-batch call's rows (no global_batch_info, no dp_size): "
            "the step sums per-micro-batch means; packloss takes sequence_mean over the step"
        )
        # eps=0: verl's n_s + 1e-8 is a float32 n_s (module doc)
        return _Objective(
            _registered(mode, "geo_mean", clip_low=low, clip_high=high, eps=0.0),
            own_normalization=Normalize.SEQUENCE_MEAN,
            notes=(note,),
        )
    if mode in ("dppo_tv", "dppo_kl"):
        # verl reads config.get("clip_ratio_c", 20.0): an ActorConfig always has it (default 3.0)
        cap = _number(_get(actor, "clip_ratio_c", 20.0), "clip_ratio_c")
        return _Objective(_registered(mode, mode, low=low, high=high, ratio_cap=cap))
    if mode == "dro":
        beta = _get(policy_loss, "dro_beta", None, "actor_config.policy_loss")
        if beta is None or _number(beta, "policy_loss.dro_beta") <= 0:
            raise ValueError(f"policy_loss.dro_beta must be a positive number for loss_mode='dro', got {beta}")
        # −(A·log π − ½β(log π − old)²) = GPG's −A·trn + β·k2(trn − old)
        return _Objective(_registered(mode, "gpg"), penalties=(KLPenalty(float(beta), "k2", "old"),))
    if mode in ("clip_cov", "kl_cov"):
        note = (
            f"{mode}: verl picks its tokens by the covariance of A and the live log π over each micro-batch "
            "(clip_cov: k band tokens at random); packloss over the step, from the old log-probs (clip_cov: the k "
            "of largest covariance). They agree on a step of one micro-batch on the first epoch (π_θ = π_old)"
            + (" with at most k tokens in the band" if mode == "clip_cov" else "")
        )
        if mode == "clip_cov":
            fields = {
                "clip_cov_ratio": _setting(policy_loss, "clip_cov_ratio", 0.0002),
                "clip_cov_lb": _setting(policy_loss, "clip_cov_lb", 1.0),
                "clip_cov_ub": _setting(policy_loss, "clip_cov_ub", 5.0),
                "clip_low": low,
                "clip_high": high,
            }
        else:
            fields = {
                "kl_cov_ratio": _setting(policy_loss, "kl_cov_ratio", 0.0002),
                "ppo_kl_coef": _setting(policy_loss, "ppo_kl_coef", 1.0),
            }
        return _Objective(_registered(mode, mode, **fields), notes=(note,))
    raise NotImplementedError(f"policy_loss.loss_mode={mode!r} is not a verl {VERL_VERSION} loss mode")


# ---------------------------------------------------------------------------------------------------
# Rollout correction
# ---------------------------------------------------------------------------------------------------


def _is_threshold(spec: Any) -> tuple[float, float | None]:
    """verl's ``rollout_is_threshold``: ``(upper, lower or None)`` from a number, ``"u"`` or ``"l_u"``."""
    if isinstance(spec, str):
        text = spec.strip()
        if "_" in text:
            lower, upper = (float(v) for v in text.split("_", 1))
            return _number(upper, "rollout_is_threshold"), _number(lower, "rollout_is_threshold")
        return _number(float(text), "rollout_is_threshold"), None
    return _number(spec, "rollout_is_threshold"), None


def _rs_thresholds(rollout_rs: Any, spec: Any) -> list[tuple[str, float | None, float]]:
    """verl's ``rollout_rs`` options with their ``(lower, upper)`` thresholds, in verl's parsing:
    ``*_k1`` takes ``"l_u"`` ratio bounds (a single ``u`` means ``l = 1/u``), the others an upper bound."""
    if not isinstance(rollout_rs, str) or not rollout_rs.strip():
        raise ValueError(f"rollout_rs must be a non-empty string of {RS_OPTIONS}, got {rollout_rs!r}")
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    for option in options:
        if option not in RS_OPTIONS:
            raise NotImplementedError(f"rollout_rs={option!r} is not a verl {VERL_VERSION} option ({RS_OPTIONS})")
    if spec is None:
        raise ValueError("rollout_rs needs rollout_rs_threshold, got None")
    specs = [str(spec)] if isinstance(spec, int | float) else [s.strip() for s in str(spec).split(",") if s.strip()]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(f"rollout_rs_threshold needs 1 or {len(options)} thresholds, got {spec!r}")
    out = []
    for option, text in zip(options, specs, strict=True):
        if option.endswith("k1"):
            lower, upper = (float(v) for v in text.split("_", 1)) if "_" in text else (1 / float(text), float(text))
            if not 0 < lower <= upper:
                raise ValueError(f"rollout_rs_threshold for {option!r} must be 0 < lower <= upper, got {text!r}")
            out.append((option, lower, upper))
        else:
            upper = float(text)
            if not upper > 0:
                raise ValueError(f"rollout_rs_threshold for {option!r} must be > 0, got {text!r}")
            out.append((option, None, upper))
    return out


def _is_correction(rc: Any) -> RolloutCorrection | None:
    """verl's importance weights (``rollout_is``, ``rollout_is_threshold``) as a RolloutCorrection."""
    level = _get(rc, "rollout_is", None, "rollout_correction")
    spec = _get(rc, "rollout_is_threshold", 2.0, "rollout_correction")
    if level is None or spec is None:
        return None
    if level not in ("token", "sequence"):
        raise NotImplementedError(f"rollout_correction.rollout_is={level!r} is not 'token', 'sequence' or None")
    if _get(rc, "rollout_is_batch_normalize", False, "rollout_correction"):
        raise NotImplementedError(
            "rollout_correction.rollout_is_batch_normalize=True: verl divides the weights by their mean over "
            "the batch (all-reduced), which packloss's RolloutCorrection does not do"
        )
    upper, lower = _is_threshold(spec)
    if lower is None:  # TIS: clamp(ρ, max=upper)
        return RolloutCorrection(level, "truncate", high=upper)
    return RolloutCorrection(level, "mask", high=upper, low=lower)  # IcePop: ρ inside [lower, upper], else 0


def _k3_band(u: float) -> tuple[float, float]:
    """``(x₋, x₊)``, the roots of ``eˣ − 1 − x = u`` (``x₋ < 0 < x₊``), by bisection to float precision."""

    def root(lo: float, hi: float) -> float:  # f(lo) and f(hi) of opposite signs
        f_lo = math.expm1(lo) - lo - u
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if mid in (lo, hi):
                break
            if (math.expm1(mid) - mid - u > 0) == (f_lo > 0):
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)

    hi = 1.0
    while math.expm1(hi) - hi < u:
        hi *= 2
    return root(-(u + 1.0), 0.0), root(0.0, hi)


def _rs_band(option: str, lower: float | None, upper: float) -> RolloutCorrection:
    """A bypass-mode rejection criterion as a masking band on the ratio ``ρ = π_θ / π_rollout``:
    ``token_k1``/``seq_*_k1`` keep ``log l ≤ −log ρ ≤ log u``, i.e. ``ρ ∈ [1/u, 1/l]``; ``token_k2`` keeps
    ``½ log²ρ ≤ u``; ``token_k3`` keeps ``ρ − 1 − log ρ ≤ u`` (a band, since the function is convex)."""
    if option == "token_k1":
        return RolloutCorrection("token", "mask", high=1 / lower, low=1 / upper, weighted=False)
    if option in ("seq_sum_k1", "seq_mean_k1"):
        agg = "sum" if option == "seq_sum_k1" else "mean"
        return RolloutCorrection("sequence", "mask", high=1 / lower, low=1 / upper, sequence_agg=agg, weighted=False)
    if option == "token_k2":
        d = math.sqrt(2 * upper)
        return RolloutCorrection("token", "mask", high=math.exp(d), low=math.exp(-d), weighted=False)
    if option == "token_k3":
        x_lo, x_hi = _k3_band(upper)
        return RolloutCorrection("token", "mask", high=math.exp(x_hi), low=math.exp(x_lo), weighted=False)
    raise NotImplementedError(
        f"rollout_rs={option!r} in bypass mode: a sum / mean / max of per-token divergences is not a band on "
        "the token or sequence ratio, so no packloss RolloutCorrection expresses it"
    )


# ---------------------------------------------------------------------------------------------------
# from_verl
# ---------------------------------------------------------------------------------------------------


def _kl_penalty(actor: Any) -> KLPenalty | None:
    if not _get(actor, "use_kl_loss", False):
        return None
    kind = _get(actor, "kl_loss_type", "low_var_kl")
    if kind in _KL_UNMAPPED:
        raise NotImplementedError(f"kl_loss_type={kind!r}: {_KL_UNMAPPED[kind]}")
    if kind not in KL_TYPES:
        raise NotImplementedError(f"kl_loss_type={kind!r} is not a verl {VERL_VERSION} KL type")
    return KLPenalty(_number(_get(actor, "kl_loss_coef", 0.001), "kl_loss_coef"), KL_TYPES[kind], "ref")


def _bypass(actor: Any, rc: Any, agg: str) -> tuple[_Objective, RolloutCorrection | None, tuple[str, ...]]:
    """verl's ``bypass_mode``: ``old_log_prob = rollout_log_prob`` (``ratio="rollout"``), IS weights and
    rejection from the *current* ``log_prob``, then PPO clip (``loss_type="ppo_clip"``, IS weights unused)
    or REINFORCE (``"reinforce"``: ``−A · log π · w``)."""
    loss_type = _get(rc, "loss_type", "ppo_clip", "rollout_correction")
    rs = _get(rc, "rollout_rs", None, "rollout_correction")
    rejection = None
    if rs is not None:
        options = _rs_thresholds(rs, _get(rc, "rollout_rs_threshold", None, "rollout_correction"))
        if len(options) > 1:
            raise NotImplementedError(f"rollout_rs={rs!r} in bypass mode: one criterion maps, not several")
        option, lower, upper = options[0]
        rejection = _rs_band(option, lower, upper)
        if rejection.level == "token" and agg == "seq-mean-token-mean":
            raise NotImplementedError(
                f"rollout_rs={option!r} in bypass mode with loss_agg_mode='seq-mean-token-mean': verl divides each "
                "sequence by its count after rejection, packloss by its member count"
            )
    notes = ["bypass mode: old_log_prob = rollout_log_prob, so the plan needs no old_logprobs"]
    if rejection is not None:
        notes.append("bypass rollout_rs: rejected tokens leave the policy term only (counts, KL, entropy keep them)")
    if loss_type == "ppo_clip":
        low, high = _clip_range(actor)
        region = PPOClip(low, high, dual_clip_c=_number(_get(actor, "clip_ratio_c", 3.0), "clip_ratio_c"))
        notes.append(
            "verl's vanilla loss clamps log r to [−20, 20] (for A > 0 and log r < −20: r = e^−20, no gradient)"
        )
        if _get(rc, "rollout_is", None, "rollout_correction") is not None:
            notes.append("bypass ppo_clip: verl computes rollout_is weights for its metrics only")
        return _Objective(region, ratio="rollout"), rejection, tuple(notes)
    if loss_type == "reinforce":
        weights = _is_correction(rc)
        if weights is not None and rejection is not None:
            raise NotImplementedError(
                "bypass reinforce with both rollout_is and rollout_rs: packloss takes one RolloutCorrection"
            )
        region = _registered("bypass_mode", "gpg")
        return _Objective(region, ratio="rollout"), weights or rejection, tuple(notes)
    raise NotImplementedError(f"rollout_correction.loss_type={loss_type!r} is not 'ppo_clip' or 'reinforce'")


def _decoupled(rc: Any, mode: str) -> tuple[RolloutCorrection | None, tuple[str, ...]]:
    """The trainer's decoupled rollout correction: IS weights from ``old_log_prob − rollout_log_prob``
    (constant over the mini-batches; packloss ``ratio="old"`` with the old stream) on the policy term."""
    weights = _is_correction(rc)
    rs = _get(rc, "rollout_rs", None, "rollout_correction")
    notes: list[str] = []
    if weights is not None and mode in ("geo_mean", "dro"):
        why = {
            "geo_mean": "verl averages log(w + 1e-10) over each sequence into a geometric-mean weight",
            "dro": "verl weights dro's quadratic penalty too",
        }[mode]
        raise NotImplementedError(f"rollout_correction.rollout_is with loss_mode={mode!r}: {why}")
    if rs is not None:
        options = _rs_thresholds(rs, _get(rc, "rollout_rs_threshold", None, "rollout_correction"))
        token_level = any(o.startswith("token") for o, _, _ in options)
        if token_level and weights is not None and weights.level == "sequence":
            raise NotImplementedError(
                f"rollout_rs={rs!r} (token level) with rollout_is='sequence': verl sums the sequence's log-ratio "
                "over the response mask before rejection, packloss over the members after it"
            )
        notes.append(
            "decoupled rollout_rs: pass rejection_mask(rollout_correction, old, inf, mask, seq_lens) as the "
            "member mask (verl replaces response_mask before the step)"
        )
    return weights, tuple(notes)


def from_verl(
    actor_config: Any,
    *,
    rollout_correction: Any = None,
    global_batch_size: int | None = None,
    response_length: int | None = None,
) -> Recipe:
    """The packloss :class:`~packloss.Recipe` of a verl 0.9.1 actor config (see the module doc).

    Parts: ``"pg"`` (the policy loss of ``policy_loss.loss_mode`` with the rollout correction and the
    ``use_kl_loss`` term as a :class:`~packloss.KLPenalty`), ``"kl"`` (the KL term as its own part when
    verl aggregates the policy loss by a rule of its own: ``sapo``, ``geo_mean``) and ``"entropy"``
    (``entropy_coeff ≠ 0``: :class:`~packloss.Entropy`), each with the normalisation of
    ``loss_agg_mode`` (but ``sapo``'s and ``geo_mean``'s policy term).

    Loss modes (``r = π_θ / π_old``; verl's ``old_log_prob`` is the plan's ``old_logprobs``)::

        vanilla   PPOClip(clip_ratio_low, clip_ratio_high, dual_clip_c=clip_ratio_c)   (always dual-clipped)
        gspo      GSPO(clip_ratio_low, clip_ratio_high)
        cispo     CISPO(clip_ratio_low, clip_ratio_high)
        gpg       "gpg"                      −A · log π
        sapo      "sapo"(tau_pos, tau_neg)   aggregated seq-mean-token-mean whatever loss_agg_mode says
        geo_mean  "geo_mean"(clip_ratio_low, clip_ratio_high), sequence_mean
        dppo_tv   "dppo_tv"(low, high, ratio_cap=clip_ratio_c),  dppo_kl likewise
        dro       "gpg" + KLPenalty(dro_beta, "k2", against="old")
        clip_cov  "clip_cov"(clip_cov_ratio, clip_cov_lb, clip_cov_ub, clip_ratio_low, clip_ratio_high)
        kl_cov    "kl_cov"(kl_cov_ratio, ppo_kl_coef)        (both select over the step: see the module doc)
        bypass    ratio="rollout": PPOClip as vanilla (loss_type="ppo_clip") or "gpg" (loss_type="reinforce")
                  with the IS weights or the rejection band as the RolloutCorrection

    Args:
        actor_config: ``actor_rollout_ref.actor`` (``ActorConfig``, ``DictConfig`` or dict).
        rollout_correction: ``algorithm.rollout_correction`` (decoupled mode: IS weights on the policy
            term; with ``bypass_mode=True`` it is the bypass config, as verl's trainer makes it), or None.
            In ``bypass_mode`` without it, ``actor_config.policy_loss.rollout_correction`` is read.
        global_batch_size: ``G`` of ``seq-mean-token-sum-norm`` (default ``ppo_mini_batch_size ×
            rollout_n`` from the actor config, as verl's trainer sets it).
        response_length: verl's padded response width ``T``, the scale of ``seq-mean-token-sum-norm``
            when ``loss_scale_factor`` is None.

    Raises:
        NotImplementedError: naming the option that packloss cannot express (module doc).
        ValueError: a setting verl would reject, or a missing ``G`` / ``T``.
    """
    if actor_config is None or isinstance(actor_config, str | bytes | int | float):
        raise TypeError(f"actor_config must be verl's ActorConfig, a DictConfig or a dict, got {actor_config!r}")
    policy_loss = _get(actor_config, "policy_loss", {})
    mode = _get(policy_loss, "loss_mode", "vanilla", "actor_config.policy_loss")
    agg = _get(actor_config, "loss_agg_mode", "token-mean")
    normalize, constant = _normalization(actor_config, agg, global_batch_size, response_length)

    notes: list[str] = []
    rc = rollout_correction
    if rc is not None and _get(rc, "bypass_mode", False, "rollout_correction"):
        mode = "bypass_mode"  # verl's apply_bypass_mode sets policy_loss.loss_mode = "bypass_mode"
    if mode == "bypass_mode":
        if rc is None:
            rc = _get(policy_loss, "rollout_correction", None, "actor_config.policy_loss")
        if rc is None:
            raise ValueError("loss_mode='bypass_mode' needs a rollout_correction config")
        objective, correction, extra = _bypass(actor_config, rc, agg)
    else:
        objective = _policy_objective(mode, actor_config, policy_loss)
        correction, extra = _decoupled(rc, mode) if rc is not None else (None, ())
    notes += [*objective.notes, *extra]

    kl = _kl_penalty(actor_config)
    if kl is not None and kl.estimator == "k3":
        notes.append("verl clamps low_var_kl/k3 to ≤ 10 (no gradient for ref − log π > 2.53 or < −11)")
    if normalize in (Normalize.SEQUENCE_SUM, Normalize.SEQUENCE_MEAN) or objective.own_normalization:
        notes.append("verl's seq-mean divides by ppo_mini_batch_size × rollout_n, also sequences without members")
    pg_normalize = objective.own_normalization or normalize
    pg_constant = constant if objective.own_normalization is None else None
    kl_in_pg = kl is not None and objective.own_normalization is None  # else verl aggregates them apart
    penalties = objective.penalties + ((kl,) if kl_in_pg else ())
    pg = PolicyGradient(objective.region, ratio=objective.ratio, penalties=penalties, correction=correction)
    parts = {"pg": Part(pg, pg_normalize, pg_constant)}
    if kl is not None and not kl_in_pg:
        # the KL term alone: a policy gradient with a zero coefficient and verl's KL as its penalty
        parts["kl"] = Part(PolicyGradient("none", adv_coef=0.0, penalties=(kl,)), normalize, constant)
    entropy_coeff = _number(_get(actor_config, "entropy_coeff", 0.0), "entropy_coeff")
    if entropy_coeff != 0:
        parts["entropy"] = Part(Entropy(entropy_coeff), normalize, constant)
    return Recipe(parts, notes=tuple(notes))


# ---------------------------------------------------------------------------------------------------
# Rejection sampling (decoupled mode): verl's new response mask on a packed bin
# ---------------------------------------------------------------------------------------------------


def rejection_mask(
    rollout_correction: Any,
    old_logprobs: Tensor,
    inference_logprobs: Tensor,
    mask: Tensor,
    seq_lens: Sequence[int] | Layout,
) -> Tensor:
    """The member mask verl trains on after its decoupled rejection sampling (``rollout_rs``).

    verl's trainer replaces ``response_mask`` by ``response_mask · keep`` once per batch, with
    ``x_t = clamp(old_t − inf_t, −20, 20)`` and per token ``k1 = −x``, ``k2 = ½x²``, ``k3 = eˣ − 1 − x``.
    ``token_kj`` keeps a token by its own value, ``seq_sum_kj`` / ``seq_mean_kj`` / ``seq_max_kj`` keep
    a whole sequence by the sum / mean / max over its members (verl's ``+ 1e-8`` in the mean is lost to
    float32 with its integer mask, module doc); ``*_k1``
    keeps ``log l ≤ value ≤ log u``, the others ``value ≤ u``. Every listed criterion must pass.

    Args:
        rollout_correction: ``algorithm.rollout_correction`` (``rollout_rs``, ``rollout_rs_threshold``).
        old_logprobs, inference_logprobs: ``[N]`` the old and rollout log-probs of the packed bin.
        mask: ``[N]`` bool, the members before rejection.
        seq_lens: the bin's sequence lengths (host ints), or its :class:`~packloss.Layout`.

    Returns ``mask & keep`` (``[N]`` bool); ``mask`` itself when ``rollout_rs`` is None. No host sync;
    the number of tensor operations does not depend on the number of sequences.
    """
    rs = _get(rollout_correction, "rollout_rs", None, "rollout_correction")
    if rs is None:
        return mask
    options = _rs_thresholds(rs, _get(rollout_correction, "rollout_rs_threshold", None, "rollout_correction"))
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
    layout = seq_lens if isinstance(seq_lens, Layout) else Layout.build(seq_lens, mask.device)
    if mask.shape != (layout.num_tokens,):
        raise ValueError(f"mask must have shape [{layout.num_tokens}] (sum of seq_lens), got {list(mask.shape)}")
    seq_ids, num_seqs = layout.seq_ids, layout.num_seqs
    old = torch.where(mask, old_logprobs.detach(), 0.0)
    inf = torch.where(mask, inference_logprobs.detach(), 0.0)
    x = (old - inf).clamp(-_RS_SAFETY, _RS_SAFETY)  # [N], 0 off the members
    per_token = {"k1": -x, "k2": 0.5 * x**2, "k3": torch.exp(x) - 1 - x}
    keep = torch.ones_like(mask)
    count = None
    for option, lower, upper in options:
        kind = option[-2:]
        value = torch.where(mask, per_token[kind], 0.0)  # [N]
        if option.startswith("seq_sum") or option.startswith("seq_mean"):
            seq = segment_sum(value, seq_ids, num_seqs)  # [S]
            if option.startswith("seq_mean"):
                if count is None:
                    count = segment_sum(mask.to(value.dtype), seq_ids, num_seqs).clamp_min(1)  # [S]
                seq = seq / count
            value = broadcast(seq, seq_ids)  # [N]
        elif option.startswith("seq_max"):
            value = broadcast(segment_max(value, mask, seq_ids, num_seqs), seq_ids)  # [N]
        if kind == "k1":
            passed = (value >= math.log(lower)) & (value <= math.log(upper))
        else:
            passed = value <= upper
        keep = keep & passed
    return mask & keep


# ---------------------------------------------------------------------------------------------------
# The mapping as rows (for the docs)
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MappingRow:
    """One row of the verl mapping: the verl option and value, the packloss objective and
    normalisation it becomes (or ``not mapped``), and the notes on where they differ."""

    option: str
    value: str
    objective: str
    normalize: str
    notes: str


def _spell(obj: Any, full: bool = False) -> str:
    """A value as its constructor call; dataclasses with their non-default fields (all with ``full``,
    and always all the fields of a trust region, which come from the config)."""
    if isinstance(obj, tuple):
        return "(" + ", ".join(_spell(o) for o in obj) + ("," if len(obj) == 1 else "") + ")"
    if isinstance(obj, float):
        return f"{obj:.6g}"
    if not dataclasses.is_dataclass(obj):
        return repr(obj)
    full = full or isinstance(obj, TrustRegion)
    args = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name == "trust_region":
            args.append(_spell(value))
            continue
        if not full and f.default is not dataclasses.MISSING and value == f.default:
            continue
        args.append(f"{f.name}={_spell(value)}")
    return f"{type(obj).__name__}({', '.join(args)})"


def _spell_normalize(part: Part) -> str:
    if part.normalize is Normalize.CONSTANT:
        return f"constant (C = {part.constant:g})"
    return part.normalize.value


# verl 0.9.1's ActorConfig defaults (the rows set one option at a time on top of these)
_DEFAULTS: dict[str, Any] = {
    "clip_ratio": 0.2,
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
    "clip_ratio_c": 3.0,
    "loss_agg_mode": "token-mean",
    "loss_scale_factor": None,
    "entropy_coeff": 0.0,
    "tau_pos": 1.0,
    "tau_neg": 1.05,
    "use_kl_loss": False,
    "kl_loss_coef": 0.001,
    "kl_loss_type": "low_var_kl",
    "ppo_mini_batch_size": 256,
    "rollout_n": 1,
    "policy_loss": {
        "loss_mode": "vanilla",
        "clip_cov_ratio": 0.0002,
        "clip_cov_lb": 1.0,
        "clip_cov_ub": 5.0,
        "kl_cov_ratio": 0.0002,
        "ppo_kl_coef": 0.1,
        "dro_beta": None,
    },
}
_BYPASS = {"bypass_mode": True, "loss_type": "ppo_clip", "rollout_is": None}


def _recipe(changes: dict[str, Any], rc: Any = None, **kwargs: Any) -> Recipe | str:
    """:func:`from_verl` of the defaults with ``changes``, or the ``NotImplementedError`` message."""
    try:
        return from_verl({**_DEFAULTS, **changes}, rollout_correction=rc, **kwargs)
    except NotImplementedError as e:
        return str(e)


def _not_mapped(option: str, value: str, message: str) -> MappingRow:
    return MappingRow(option, value, "not mapped (NotImplementedError)", "—", message)


def mapping_rows() -> list[MappingRow]:
    """The mapping, one row per verl option value, each generated by calling :func:`from_verl` on verl's
    default actor config with that option set: loss modes, aggregation modes, KL types, the entropy
    bonus and the rollout corrections. ``notes`` are the recipe's notes (for the options other than the
    loss mode, those beyond the default config's)."""
    base = _recipe({})
    assert isinstance(base, Recipe)

    def extra_notes(recipe: Recipe) -> str:
        return "; ".join(n for n in recipe.notes if n not in base.notes)

    rows = []
    for mode in LOSS_MODES:
        policy = {**_DEFAULTS["policy_loss"], "loss_mode": mode, "dro_beta": 0.1 if mode == "dro" else None}
        variants = [(mode, policy, None)]
        if mode == "bypass_mode":
            variants = [(f"bypass_mode ({t})", policy, {**_BYPASS, "loss_type": t}) for t in _LOSS_TYPES]
        for value, policy, rc in variants:
            recipe = _recipe({"policy_loss": policy}, rc)
            if isinstance(recipe, str):
                rows.append(_not_mapped("policy_loss.loss_mode", value, recipe))
                continue
            pg = recipe.parts["pg"]
            notes = "; ".join(recipe.notes)
            rows.append(MappingRow("policy_loss.loss_mode", value, _spell(pg.loss), _spell_normalize(pg), notes))
    for agg in LOSS_AGG_MODES:
        recipe = _recipe({"loss_agg_mode": agg}, response_length=4096)
        note = "C = ppo_mini_batch_size × rollout_n × (loss_scale_factor or response_length)" if "norm" in agg else ""
        notes = "; ".join(n for n in (extra_notes(recipe), note) if n)
        rows.append(MappingRow("loss_agg_mode", agg, "every part", _spell_normalize(recipe.parts["pg"]), notes))
    for kind in (*KL_TYPES, *_KL_UNMAPPED):
        recipe = _recipe({"use_kl_loss": True, "kl_loss_type": kind})
        if isinstance(recipe, str):
            rows.append(_not_mapped("kl_loss_type", kind, recipe))
            continue
        pg = recipe.parts["pg"]
        spelled = _spell(pg.loss.penalties[-1], full=True) + " in part 'pg'"
        rows.append(MappingRow("kl_loss_type", kind, spelled, _spell_normalize(pg), extra_notes(recipe)))
    recipe = _recipe({"entropy_coeff": 0.001})
    part = recipe.parts["entropy"]
    spelled = _spell(part.loss, full=True) + " as part 'entropy'"
    rows.append(MappingRow("entropy_coeff", "0.001", spelled, _spell_normalize(part), extra_notes(recipe)))
    for level in ("token", "sequence"):
        for spec in (2.0, "0.5_5.0"):
            recipe = _recipe({}, {"rollout_is": level, "rollout_is_threshold": spec})
            spelled = _spell(recipe.parts["pg"].loss.correction, full=True)
            rows.append(MappingRow("rollout_is", f"{level}, {spec}", spelled, "—", extra_notes(recipe)))
    recipe = _recipe({}, {"rollout_is": None, "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"})
    spelled = "member mask = rejection_mask(rollout_correction, old, inf, mask, seq_lens)"
    rows.append(MappingRow("rollout_rs (decoupled)", "any", spelled, "—", extra_notes(recipe)))
    for option in RS_OPTIONS:
        spec = "0.5_2.0" if option.endswith("k1") else 0.01
        rc = {**_BYPASS, "rollout_rs": option, "rollout_rs_threshold": spec}
        recipe = _recipe({"policy_loss": {**_DEFAULTS["policy_loss"], "loss_mode": "bypass_mode"}}, rc)
        if isinstance(recipe, str):
            rows.append(_not_mapped("rollout_rs (bypass)", f"{option}, {spec}", recipe))
            continue
        spelled = _spell(recipe.parts["pg"].loss.correction, full=True)
        rows.append(MappingRow("rollout_rs (bypass)", f"{option}, {spec}", spelled, "—", ""))
    return rows


def mapping_markdown() -> str:
    """:func:`mapping_rows` as a Markdown table (the ``## verl 0.9.1`` table of ``docs/objectives.md``)."""
    lines = ["| verl option | value | packloss | normalisation | notes |", "|---|---|---|---|---|"]
    for r in mapping_rows():
        objective = f"`{r.objective}`" if "(" in r.objective and not r.objective.startswith("not") else r.objective
        cells = (r.option, f"`{r.value}`", objective, r.normalize, r.notes)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m packloss.integrations.verl: the docs table
    print(mapping_markdown(), end="")
