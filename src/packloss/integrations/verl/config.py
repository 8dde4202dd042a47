"""A verl 0.9.1 actor config as a packloss :class:`~packloss.Recipe`: :func:`from_verl`. It reads the
actor config verl trains with (``ActorConfig``, an OmegaConf ``DictConfig`` or a dict; verl is not
imported) and the trainer's ``algorithm.rollout_correction``; the recipe's loss on packed bins is the
loss verl computes on its padded batch. How verl runs a step, the normalisation mapping and every
difference: ``docs/integrations/verl.md``; the mapping table: ``docs/objectives.md``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from packloss.core import checks
from packloss.core.bin import Component, Normalize
from packloss.core.corrections import RolloutCorrection
from packloss.core.entropy import Entropy
from packloss.core.kl import KLPenalty
from packloss.core.pg import PolicyGradient
from packloss.core.recipe import POLICY, Recipe
from packloss.core.trust_regions import (
    CISPO,
    DPPOKL,
    DPPOTV,
    GMPO,
    GPG,
    GSPO,
    SAPO,
    ClipCov,
    KLCov,
    PPOClip,
    TrustRegion,
)
from packloss.integrations.common.config import ConfigReader, option_names
from packloss.integrations.verl.rejection import rs_thresholds

__all__ = ["VERL_VERSION", "LOSS_AGG_MODES", "LOSS_MODES", "KL_TYPES", "KL_UNMAPPED", "from_verl"]

VERL_VERSION = "0.9.1"
"""The verl release whose semantics this package maps (and its tests run against)."""

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOSS_MODES = ("vanilla", "gspo", "cispo", "gpg", "sapo", "geo_mean", "dppo_tv", "dppo_kl", "dro", "clip_cov",
              "kl_cov", "bypass_mode")  # fmt: skip
"""verl 0.9.1's ``POLICY_LOSS_REGISTRY`` names."""

# verl's x is log π − ref (k1 = x, k2 = x²/2, k3 = e^−x + x − 1), packloss's ref − log π: the same
# functions. "k2+"/"mse+" is verl's straight-through with the k2 gradient under the k2 value: k2.
KL_TYPES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "mse+": "k2", "k2+": "k2", "low_var_kl": "k3", "k3": "k3",
            "kl+": "k1+", "k1+": "k1+", "low_var_kl+": "k3+", "k3+": "k3+"}  # fmt: skip
KL_UNMAPPED = {
    "abs": "|log π − ref| has no packloss estimator",
    "full": "verl itself raises NotImplementedError for 'full'",
}
LOSS_TYPES = ("ppo_clip", "reinforce")
"""``rollout_correction.loss_type`` of bypass mode."""
K3_CAP = 10.0
"""verl clamps ``low_var_kl`` / ``k3`` to ``≤ 10``."""

_LOW, _HIGH = "clip_ratio_low (or clip_ratio)", "clip_ratio_high (or clip_ratio)"
_CLIPS = {"clip_low": _LOW, "clip_high": _HIGH, "low": _LOW, "high": _HIGH, "dual_clip_c": "clip_ratio_c",
          "ratio_cap": "clip_ratio_c"}  # fmt: skip
OPTION_NAMES = {
    **{
        f"{region}.{field}": f"actor_config.{option}"
        for region in ("PPOClip", "GSPO", "CISPO", "GMPO", "ClipCov", "DPPOTV", "DPPOKL")
        for field, option in _CLIPS.items()
    },
    **{f"SAPO.{tau}": f"actor_config.{tau}" for tau in ("tau_pos", "tau_neg")},
    **{
        f"{region}.{field}": f"actor_config.policy_loss.{field}"
        for region, fields in (
            ("ClipCov", ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")),
            ("KLCov", ("kl_cov_ratio", "ppo_kl_coef")),
        )
        for field in fields
    },
    **{f"RolloutCorrection.{bound}": "rollout_correction.rollout_is_threshold" for bound in ("low", "high")},
}
"""packloss's fields as the verl options they come from, for errors (:func:`option_names`)."""


def k3_band(u: float) -> tuple[float, float]:
    """``(x₋, x₊)``, the roots of ``eˣ − 1 − x = u`` (``x₋ < 0 < x₊``): Newton's method from a point
    outside each root, where the convex function is positive, converges monotonically."""

    def newton(x: float) -> float:
        for _ in range(200):
            step = (math.expm1(x) - x - u) / math.expm1(x)
            x -= step
            if abs(step) <= 1e-15 * max(1.0, abs(x)):
                break
        return x

    return newton(-(u + 1.0)), newton(math.log1p(u) + 1.0)


def _normalization(
    c: ConfigReader, agg: str, global_batch_size: int | None, response_length: int | None
) -> tuple[Normalize, float | None]:
    """``(Normalize, constant)`` of a verl ``loss_agg_mode``."""
    simple = {
        "token-mean": (Normalize.TOKEN, None),
        "token-sum": (Normalize.CONSTANT, 1.0),
        "seq-mean-token-sum": (Normalize.SEQUENCE_SUM, None),
        "seq-mean-token-mean": (Normalize.SEQUENCE_MEAN, None),
    }
    if agg in simple:
        return simple[agg]
    if agg != "seq-mean-token-sum-norm":
        raise NotImplementedError(f"loss_agg_mode={agg!r} is not a verl {VERL_VERSION} mode (one of {LOSS_AGG_MODES})")
    scale_name = c.name("loss_scale_factor")
    scale = c.get("loss_scale_factor", None)
    if scale is None:
        scale, scale_name = response_length, "response_length"
    if scale is None:
        raise ValueError(
            "loss_agg_mode='seq-mean-token-sum-norm' with actor_config.loss_scale_factor=None divides by "
            "verl's padded response width T, which packed bins do not have: pass response_length=T "
            "(the rollout's max response length) or set loss_scale_factor"
        )
    scale = checks.positive(scale_name, scale)
    if global_batch_size is None:
        mini, n = c.get("ppo_mini_batch_size", None), c.get("rollout_n", None)
        if mini is None or n is None:
            raise ValueError(
                "loss_agg_mode='seq-mean-token-sum-norm' needs G = ppo_mini_batch_size × rollout_n: pass "
                "global_batch_size= or set both in actor_config"
            )
        global_batch_size = c.integer("ppo_mini_batch_size", minimum=1) * c.integer("rollout_n", minimum=1)
    return Normalize.CONSTANT, checks.positive("global_batch_size", global_batch_size) * scale


def clip_range(c: ConfigReader) -> tuple[float, float]:
    """verl's ``(clip_ratio_low, clip_ratio_high)``, each falling back to ``clip_ratio``."""
    clip = c.get("clip_ratio", 0.2)
    low, high = c.get("clip_ratio_low", None), c.get("clip_ratio_high", None)
    low = checks.number(c.name("clip_ratio" if low is None else "clip_ratio_low"), clip if low is None else low)
    high = checks.number(c.name("clip_ratio" if high is None else "clip_ratio_high"), clip if high is None else high)
    return low, high


@dataclass(frozen=True)
class _Objective:
    """The policy-gradient part of a verl loss mode: its trust region, ratio denominator, extra
    penalties, and a normalisation of its own when verl ignores ``loss_agg_mode`` for it."""

    region: TrustRegion
    ratio: str = "old"
    penalties: tuple[KLPenalty, ...] = ()
    own_normalization: Normalize | None = None
    notes: tuple[str, ...] = ()


_VANILLA_NOTE = "verl clamps log r to [−20, 20]: for A > 0 and log r < −20 verl has r = e^−20 and no gradient"


def _setting(p: ConfigReader, key: str, fallback: float) -> float:
    """``policy_loss.key``, or verl's fallback when it is None or absent."""
    value = p.get(key, None)
    return checks.number(p.name(key), fallback if value is None else value)


def _policy_objective(mode: str, c: ConfigReader, p: ConfigReader) -> _Objective:
    """The :class:`_Objective` of verl's ``policy_loss.loss_mode`` (not ``bypass_mode``)."""
    low, high = clip_range(c)
    if mode == "vanilla":
        return _Objective(PPOClip(low, high, dual_clip_c=c.number("clip_ratio_c", 3.0)), notes=(_VANILLA_NOTE,))
    if mode == "gspo":
        note = "verl clamps log s_{i,t} at 10: for A < 0 and log s_i > 10 verl's value is e^10·|A|, no gradient"
        return _Objective(GSPO(low, high), notes=(note,))
    if mode == "cispo":
        return _Objective(CISPO(low, high), notes=("verl clamps log r to [−20, 20] (binds only for clip_low ≈ 1)",))
    if mode == "gpg":
        return _Objective(GPG())
    if mode == "sapo":
        note = "verl aggregates sapo's policy term by seq-mean-token-mean whatever loss_agg_mode says (not KL, entropy)"
        region = SAPO(tau_pos=c.number("tau_pos", 1.0), tau_neg=c.number("tau_neg", 1.05))
        return _Objective(region, own_normalization=Normalize.SEQUENCE_MEAN, notes=(note,))
    if mode == "geo_mean":
        note = (
            "verl's geo_mean is the mean over each micro-batch call's rows (no global_batch_info, no dp_size): "
            "the step sums per-micro-batch means; packloss takes sequence_mean over the step"
        )
        # eps=0: verl's n_s + 1e-8 is a float32 n_s (docs/integrations/verl.md)
        region = GMPO(clip_low=low, clip_high=high, eps=0.0)
        return _Objective(region, own_normalization=Normalize.SEQUENCE_MEAN, notes=(note,))
    if mode in ("dppo_tv", "dppo_kl"):
        # verl reads config.get("clip_ratio_c", 20.0): an ActorConfig always has it (default 3.0)
        cap = c.number("clip_ratio_c", 20.0)
        return _Objective((DPPOTV if mode == "dppo_tv" else DPPOKL)(low=low, high=high, ratio_cap=cap))
    if mode == "dro":
        beta = p.get("dro_beta", None)
        if beta is None or p.number("dro_beta") <= 0:
            raise ValueError(
                f"actor_config.policy_loss.dro_beta must be a positive number for loss_mode='dro', got {beta}"
            )
        # −(A·log π − ½β(log π − old)²) = GPG's −A·trn + β·k2(trn − old)
        return _Objective(GPG(), penalties=(KLPenalty(float(beta), "k2", "old"),))
    if mode in ("clip_cov", "kl_cov"):
        note = (
            f"{mode}: verl picks its tokens by the covariance of A and the live log π over each micro-batch "
            "(clip_cov: k band tokens at random); packloss over the step, from the old log-probs (clip_cov: the k "
            "of largest covariance). They agree on a step of one micro-batch on the first epoch (π_θ = π_old)"
            + (" with at most k tokens in the band" if mode == "clip_cov" else "")
        )
        if mode == "clip_cov":
            settings = (("clip_cov_ratio", 0.0002), ("clip_cov_lb", 1.0), ("clip_cov_ub", 5.0))
            region = ClipCov(*(_setting(p, k, f) for k, f in settings), clip_low=low, clip_high=high)
        else:
            region = KLCov(_setting(p, "kl_cov_ratio", 0.0002), _setting(p, "ppo_kl_coef", 1.0))
        return _Objective(region, notes=(note,))
    raise NotImplementedError(f"policy_loss.loss_mode={mode!r} is not a verl {VERL_VERSION} loss mode")


def _float(text: str, name: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number or 'lower_upper', got {text!r}") from None


def _is_threshold(r: ConfigReader, spec: Any) -> tuple[float, float | None]:
    """verl's ``rollout_is_threshold``: ``(upper, lower or None)`` from a number, ``"u"`` or ``"l_u"``."""
    name = r.name("rollout_is_threshold")
    if isinstance(spec, str):
        text = spec.strip()
        if "_" in text:
            lower, upper = (checks.number(name, _float(v, name)) for v in text.split("_", 1))
            return upper, lower
        return checks.number(name, _float(text, name)), None
    return checks.number(name, spec), None


def _is_correction(r: ConfigReader) -> RolloutCorrection | None:
    """verl's importance weights (``rollout_is``, ``rollout_is_threshold``) as a RolloutCorrection."""
    level, spec = r.get("rollout_is", None), r.get("rollout_is_threshold", 2.0)
    if level is None or spec is None:
        return None
    if level not in ("token", "sequence"):
        raise NotImplementedError(f"rollout_correction.rollout_is={level!r} is not 'token', 'sequence' or None")
    if r.get("rollout_is_batch_normalize", False):
        raise NotImplementedError(
            "rollout_correction.rollout_is_batch_normalize=True: verl divides the weights by their mean over "
            "the batch (all-reduced), which packloss's RolloutCorrection does not do"
        )
    upper, lower = _is_threshold(r, spec)
    if lower is None:  # TIS: clamp(ρ, max=upper)
        return RolloutCorrection(level, "truncate", high=upper)
    return RolloutCorrection(level, "mask", high=upper, low=lower)  # IcePop: ρ inside [lower, upper], else 0


def _rs_band(option: str, lower: float | None, upper: float) -> RolloutCorrection:
    """A bypass-mode rejection criterion as a masking band on ``ρ = π_θ / π_rollout``: ``token_k1`` /
    ``seq_*_k1`` keep ``ρ ∈ [1/u, 1/l]``; ``token_k2`` keeps ``½ log²ρ ≤ u``; ``token_k3`` keeps
    ``ρ − 1 − log ρ ≤ u`` (a band, since the function is convex)."""
    if option == "token_k1":
        return RolloutCorrection("token", "mask", high=1 / lower, low=1 / upper, weighted=False)
    if option in ("seq_sum_k1", "seq_mean_k1"):
        agg = "sum" if option == "seq_sum_k1" else "mean"
        return RolloutCorrection("sequence", "mask", high=1 / lower, low=1 / upper, sequence_agg=agg, weighted=False)
    if option == "token_k2":
        d = math.sqrt(2 * upper)
        return RolloutCorrection("token", "mask", high=math.exp(d), low=math.exp(-d), weighted=False)
    if option == "token_k3":
        x_lo, x_hi = k3_band(upper)
        return RolloutCorrection("token", "mask", high=math.exp(x_hi), low=math.exp(x_lo), weighted=False)
    raise NotImplementedError(
        f"rollout_rs={option!r} in bypass mode: a sum / mean / max of per-token divergences is not a band on "
        "the token or sequence ratio, so no packloss RolloutCorrection expresses it"
    )


def _kl_penalty(c: ConfigReader) -> KLPenalty | None:
    if not c.get("use_kl_loss", False):
        return None
    kind = c.get("kl_loss_type", "low_var_kl")
    if kind in KL_UNMAPPED:
        raise NotImplementedError(f"kl_loss_type={kind!r}: {KL_UNMAPPED[kind]}")
    if kind not in KL_TYPES:
        raise NotImplementedError(f"kl_loss_type={kind!r} is not a verl {VERL_VERSION} KL type")
    return KLPenalty(c.nonnegative("kl_loss_coef", 0.001), KL_TYPES[kind], "ref")


def _bypass(c: ConfigReader, r: ConfigReader, agg: str) -> tuple[_Objective, RolloutCorrection | None, tuple[str, ...]]:
    """verl's ``bypass_mode``: ``old_log_prob = rollout_log_prob`` (``ratio="rollout"``), IS weights and
    rejection from the *current* ``log_prob``, then PPO clip (``loss_type="ppo_clip"``, IS weights unused)
    or REINFORCE (``"reinforce"``: ``−A · log π · w``)."""
    loss_type = r.get("loss_type", "ppo_clip")
    rs = r.get("rollout_rs", None)
    rejection = None
    if rs is not None:
        options = rs_thresholds(rs, r.get("rollout_rs_threshold", None))
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
        low, high = clip_range(c)
        region = PPOClip(low, high, dual_clip_c=c.number("clip_ratio_c", 3.0))
        notes.append(_VANILLA_NOTE.replace("verl clamps", "verl's vanilla loss clamps"))
        if r.get("rollout_is", None) is not None:
            notes.append("bypass ppo_clip: verl computes rollout_is weights for its metrics only")
        return _Objective(region, ratio="rollout"), rejection, tuple(notes)
    if loss_type == "reinforce":
        weights = _is_correction(r)
        if weights is not None and rejection is not None:
            raise NotImplementedError(
                "bypass reinforce with both rollout_is and rollout_rs: packloss takes one RolloutCorrection"
            )
        return _Objective(GPG(), ratio="rollout"), weights or rejection, tuple(notes)
    raise NotImplementedError(f"rollout_correction.loss_type={loss_type!r} is not one of {LOSS_TYPES}")


def _decoupled(r: ConfigReader, mode: str) -> tuple[RolloutCorrection | None, tuple[str, ...]]:
    """The trainer's decoupled rollout correction: IS weights from ``old_log_prob − rollout_log_prob``
    (packloss ``ratio="old"`` with the old stream) on the policy term."""
    weights = _is_correction(r)
    rs = r.get("rollout_rs", None)
    notes: list[str] = []
    if weights is not None and mode in ("geo_mean", "dro"):
        why = {
            "geo_mean": "verl averages log(w + 1e-10) over each sequence into a geometric-mean weight",
            "dro": "verl weights dro's quadratic penalty too",
        }[mode]
        raise NotImplementedError(f"rollout_correction.rollout_is with loss_mode={mode!r}: {why}")
    if rs is not None:
        options = rs_thresholds(rs, r.get("rollout_rs_threshold", None))
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
    """The packloss :class:`~packloss.Recipe` of a verl 0.9.1 actor config.

    Components: ``"pg"`` (the policy loss of ``policy_loss.loss_mode`` with the rollout correction and
    the ``use_kl_loss`` term as a :class:`~packloss.KLPenalty`), ``"kl"`` (that term on its own when verl
    aggregates the policy loss by a rule of its own: ``sapo``, ``geo_mean``) and ``"entropy"``
    (``entropy_coeff ≠ 0``), each normalised by ``loss_agg_mode`` (but ``sapo``'s and ``geo_mean``'s
    policy term). The table of every mode: ``docs/objectives.md``.

    Args:
        actor_config: ``actor_rollout_ref.actor`` (``ActorConfig``, ``DictConfig`` or dict).
        rollout_correction: ``algorithm.rollout_correction`` (decoupled mode; with ``bypass_mode=True``
            the bypass config, as verl's trainer makes it), or None. In ``bypass_mode`` without it,
            ``actor_config.policy_loss.rollout_correction`` is read.
        global_batch_size: ``G`` of ``seq-mean-token-sum-norm`` (default ``ppo_mini_batch_size × rollout_n``).
        response_length: verl's padded response width ``T``, the scale of ``seq-mean-token-sum-norm``
            when ``loss_scale_factor`` is None.

    Raises ``NotImplementedError`` naming an option packloss cannot express, ``ValueError`` /
    ``TypeError`` naming a setting verl would reject (or a missing ``G`` / ``T``).
    """
    with option_names(OPTION_NAMES):
        return _from_verl(actor_config, rollout_correction, global_batch_size, response_length)


def _from_verl(
    actor_config: Any, rollout_correction: Any, global_batch_size: int | None, response_length: int | None
) -> Recipe:
    c = actor_config if isinstance(actor_config, ConfigReader) else ConfigReader(actor_config, "actor_config")
    p = c.section("policy_loss")
    mode = p.get("loss_mode", "vanilla")
    agg = c.get("loss_agg_mode", "token-mean")
    normalize, constant = _normalization(c, agg, global_batch_size, response_length)

    r = None if rollout_correction is None else ConfigReader(rollout_correction, "rollout_correction")
    if r is not None and r.get("bypass_mode", False):
        mode = "bypass_mode"  # verl's apply_bypass_mode sets policy_loss.loss_mode = "bypass_mode"
    if mode == "bypass_mode":
        if r is None:
            if p.get("rollout_correction", None) is None:
                raise ValueError("loss_mode='bypass_mode' needs a rollout_correction config")
            r = p.section("rollout_correction")
        objective, correction, extra = _bypass(c, r, agg)
    else:
        objective = _policy_objective(mode, c, p)
        correction, extra = _decoupled(r, mode) if r is not None else (None, ())
    notes = [*objective.notes, *extra]

    kl = _kl_penalty(c)
    if kl is not None and kl.estimator == "k3":
        x_lo, x_hi = k3_band(K3_CAP)
        notes.append(f"verl clamps low_var_kl/k3 to ≤ {K3_CAP:g} (no gradient for ref − log π > {x_hi:.4f} "
                     f"or < {max(x_lo, -20.0):.4g})")  # fmt: skip
    if kl is not None and kl.estimator == "k3+":
        notes.append(f"verl clamps the k3+ value to ≤ {K3_CAP:g} (the value only: its gradient, k2's, is packloss's)")
    if normalize in (Normalize.SEQUENCE_SUM, Normalize.SEQUENCE_MEAN) or objective.own_normalization:
        notes.append("verl's seq-mean divides by ppo_mini_batch_size × rollout_n, also sequences without members")
    pg_normalize = objective.own_normalization or normalize
    pg_constant = constant if objective.own_normalization is None else None
    kl_in_pg = kl is not None and objective.own_normalization is None  # else verl aggregates them apart
    penalties = objective.penalties + ((kl,) if kl_in_pg else ())
    pg = PolicyGradient(objective.region, ratio=objective.ratio, penalties=penalties, correction=correction)
    components = {POLICY: Component(pg, normalize=pg_normalize, constant=pg_constant)}
    if kl is not None and not kl_in_pg:
        # the KL term alone: a policy gradient with a zero coefficient and verl's KL as its penalty
        kl_only = PolicyGradient("none", adv_coef=0.0, penalties=(kl,))
        components["kl"] = Component(kl_only, normalize=normalize, constant=constant)
    entropy_coeff = c.number("entropy_coeff", 0.0)
    if entropy_coeff != 0:
        components["entropy"] = Component(Entropy(entropy_coeff), normalize=normalize, constant=constant)
    return Recipe(components, notes=tuple(notes))
