"""Trust regions: how a policy-gradient objective turns ratios and advantages into a surrogate.

A trust region is a small frozen dataclass with one method, ``surrogate(t: PolicyTerms) -> Surrogate``:
the per-token objective ``J [N]`` to *maximise* (zero off the members) and the named per-token
metrics it reports. :class:`~packloss.core.pg.PolicyGradient` builds the :class:`PolicyTerms` of a bin
(ratio, advantage, layout) once and adds the penalties, the rollout correction and the metrics every
objective shares. Every trust region is registered by name in :data:`TRUST_REGIONS`; a new one is one
class in a file of your own::

    @register_trust_region("my_clip")
    @dataclass(frozen=True)
    class MyClip(TrustRegion):
        eps: float = 0.1

        def surrogate(self, t: PolicyTerms) -> Surrogate:
            kept = t.m & ((t.r - 1).abs() <= self.eps)
            return Surrogate(kept * t.a * t.r, {"is_masked": t.m & ~kept})

    PolicyGradient(trust_region=MyClip(0.05))     # or trust_region="my_clip" for its defaults

Shapes are ``[N]`` per token of the packed bin, ``[S]`` per sequence. ``t.r = exp(log_r)`` with
``log_r = where(m, trn − base, 0)``: ``base`` is the ratio's denominator the objective chose (π_old,
π_rollout, or ``sg(trn)`` on-policy), so a non-member never overflows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

import torch
from torch import Tensor

from packloss.core.segments import broadcast, segment_mean, segment_sum

__all__ = [
    "PolicyTerms",
    "Surrogate",
    "TrustRegion",
    "TRUST_REGIONS",
    "register_trust_region",
    "trust_region",
    "DPPOMask",
    "IPOMask",
    "OneSided",
    "NoRegion",
    "IcePop",
    "PPOClip",
    "CISPO",
    "GSPO",
    "SAPO",
    "GMPO",
    "GPG",
    "DPPOTV",
    "DPPOKL",
    "TOPR",
]


@dataclass(frozen=True, eq=False)
class PolicyTerms:
    """The per-token quantities of one bin that every trust region reads.

    ``m`` members (bool); ``trn`` π_θ log-probs (carries the gradient); ``base`` the ratio's
    denominator (detached); ``log_r = where(m, trn − base, 0)``; ``r = exp(log_r)``; ``adv`` the raw
    advantage (detached, 0 off ``m``); ``a = adv_coef · adv``; ``seq_ids`` ``[N]`` long and
    ``num_seqs`` ``S``; ``inputs`` the component's inputs (for anything else a region needs).
    """

    m: Tensor
    trn: Tensor
    base: Tensor
    log_r: Tensor
    r: Tensor
    adv: Tensor
    a: Tensor
    seq_ids: Tensor
    num_seqs: int
    inputs: object

    def prob_diff(self) -> Tensor:
        """``dp = π_θ − π_base`` of the sampled tokens (detached), on masked values.  ``[N]``."""
        return torch.exp(torch.where(self.m, self.trn.detach(), 0.0)) - torch.exp(torch.where(self.m, self.base, 0.0))


@dataclass
class Surrogate:
    """A trust region's result: ``objective [N]`` (to maximise; zero off the members) and
    ``metrics``: name → ``[N]`` values (bool fractions or floats) averaged over the members, or
    ``(values [N], mask [N])`` averaged over ``mask``. ``"is_masked"`` (members whose policy gradient
    is zeroed) is always reported; a region that drops nothing may leave it out."""

    objective: Tensor
    metrics: dict[str, Tensor | tuple[Tensor, Tensor]]
    sequence_ratio: tuple[Tensor, Tensor] | None = None  # (s_i [S], has_members [S]) for sequence-level ratios


class TrustRegion:
    """Base class of the trust regions (see the module doc). ``name`` is set by
    :func:`register_trust_region`."""

    name: ClassVar[str] = ""

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        raise NotImplementedError

    def check(self) -> None:
        """Validate the fields: every number finite (and the subclass's own ranges)."""
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{type(self).__name__}.{f.name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value):
                raise ValueError(f"{type(self).__name__}.{f.name} must be finite, got {value}")

    def __post_init__(self) -> None:
        self.check()


TRUST_REGIONS: dict[str, type[TrustRegion]] = {}
"""Every registered trust region by name."""


def register_trust_region(name: str):
    """Class decorator: register a :class:`TrustRegion` subclass under ``name`` (unique)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")

    def register(cls: type[TrustRegion]) -> type[TrustRegion]:
        if not (isinstance(cls, type) and issubclass(cls, TrustRegion)):
            raise TypeError(f"register_trust_region({name!r}) needs a TrustRegion subclass, got {cls!r}")
        if name in TRUST_REGIONS and TRUST_REGIONS[name] is not cls:
            raise ValueError(f"trust region {name!r} is already registered ({TRUST_REGIONS[name].__name__})")
        cls.name = name
        TRUST_REGIONS[name] = cls
        return cls

    return register


def trust_region(spec: TrustRegion | str) -> TrustRegion:
    """A :class:`TrustRegion` from an instance or a registered name (its defaults)."""
    if isinstance(spec, TrustRegion):
        return spec
    if isinstance(spec, str):
        if spec not in TRUST_REGIONS:
            raise ValueError(f"trust_region must be a TrustRegion or one of {sorted(TRUST_REGIONS)}, got {spec!r}")
        return TRUST_REGIONS[spec]()
    raise TypeError(f"trust_region must be a TrustRegion or a registered name, got {type(spec).__name__}")


def _nonnegative(region: TrustRegion, *names: str) -> None:
    for name in names:
        if not getattr(region, name) >= 0:
            raise ValueError(f"{type(region).__name__}.{name} must be >= 0, got {getattr(region, name)}")


def _masked(t: PolicyTerms, drop: Tensor, metrics: dict[str, Tensor]) -> Surrogate:
    """The token-dropping regions: ``J = (m & ¬drop) · a · r``."""
    keep = t.m & ~drop
    return Surrogate(keep * t.a * t.r, {"is_masked": drop, **metrics})


# ---------------------------------------------------------------------------------------------------
# Regions that drop tokens (prime-rl's family)
# ---------------------------------------------------------------------------------------------------


@register_trust_region("dppo")
@dataclass(frozen=True)
class DPPOMask(TrustRegion):
    """prime-rl's DPPO-Binary TV: drop ``A > 0 & dp > high`` and ``A ≤ 0 & dp < −low``
    (``dp = π_θ − π_base``). Metrics ``is_masked_high``/``_low``, ``masked_advantage_positive``/
    ``_negative`` (over the dropped tokens)."""

    low: float = 0.2
    high: float = 0.2

    def check(self) -> None:
        super().check()
        _nonnegative(self, "low", "high")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        dp = t.prob_diff()
        high, low = dp > self.high, dp < -self.low
        drop = torch.where(t.adv > 0, high, low)
        dropped = t.m & drop
        return _masked(
            t,
            drop,
            {
                "is_masked_high": (t.adv > 0) & high,
                "is_masked_low": (t.adv < 0) & low,
                "masked_advantage_positive": (t.adv > 0, dropped),
                "masked_advantage_negative": (t.adv < 0, dropped),
            },
        )


@register_trust_region("ipo")
@dataclass(frozen=True)
class IPOMask(TrustRegion):
    """prime-rl's IPO (#2951 era): drop ``|dp| > threshold``."""

    threshold: float = 0.1

    def check(self) -> None:
        super().check()
        _nonnegative(self, "threshold")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        return _masked(t, t.prob_diff().abs() > self.threshold, {})


@register_trust_region("one_sided")
@dataclass(frozen=True)
class OneSided(TrustRegion):
    """Drop ``dp < −threshold`` (prime-rl's ref_kl loss)."""

    threshold: float = 0.2

    def check(self) -> None:
        super().check()
        _nonnegative(self, "threshold")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        return _masked(t, t.prob_diff() < -self.threshold, {})


@register_trust_region("none")
@dataclass(frozen=True)
class NoRegion(TrustRegion):
    """``J = a · r``: the plain importance-weighted policy gradient (REINFORCE on-policy)."""

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        return _masked(t, torch.zeros_like(t.m), {})


@register_trust_region("icepop")
@dataclass(frozen=True)
class IcePop(TrustRegion):
    """Drop tokens whose ratio leaves ``[low, high]``."""

    low: float = 0.5
    high: float = 5.0

    def check(self) -> None:
        super().check()
        if not 0 <= self.low < self.high:
            raise ValueError(f"IcePop needs 0 <= low < high, got {self.low}, {self.high}")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        r = t.r.detach()
        low, high = r < self.low, r > self.high
        return _masked(t, low | high, {"is_masked_low": low, "is_masked_high": high})


# ---------------------------------------------------------------------------------------------------
# Clipped regions (PPO's family)
# ---------------------------------------------------------------------------------------------------


def _check_clip(region: TrustRegion) -> None:
    if not 0 <= region.clip_low < 1:
        raise ValueError(f"{type(region).__name__}.clip_low must be in [0, 1), got {region.clip_low}")
    _nonnegative(region, "clip_high")


def _clip_metrics(ratio: Tensor, a: Tensor, low: float, high: float) -> dict[str, Tensor]:
    """Members whose gradient the clip zeroes: ``A<0 & r<1−ε_low``, ``A>0 & r>1+ε_high``."""
    r = ratio.detach()
    return {"clip_frac_low": (a < 0) & (r < 1 - low), "clip_frac_high": (a > 0) & (r > 1 + high)}


@register_trust_region("ppo_clip")
@dataclass(frozen=True)
class PPOClip(TrustRegion):
    """``J = min(r·A', clip(r, 1−ε_low, 1+ε_high)·A')``; with ``dual_clip_c`` and ``A' < 0``:
    ``max(J, c·A')`` (Ye et al. 2020). DAPO's clip-higher: ``clip_high=0.28``."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float | None = None

    def check(self) -> None:
        super().check()
        _check_clip(self)
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            raise ValueError(f"PPOClip.dual_clip_c must be > 1, got {self.dual_clip_c}")

    def clipped(self, ratio: Tensor, a: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``(J [N], metrics)`` of the clipped surrogate of ``ratio`` (token or sequence ratio)."""
        surrogate = torch.minimum(ratio * a, ratio.clamp(1 - self.clip_low, 1 + self.clip_high) * a)
        metrics = _clip_metrics(ratio, a, self.clip_low, self.clip_high)
        is_masked = metrics["clip_frac_low"] | metrics["clip_frac_high"]
        if self.dual_clip_c is not None:
            surrogate = torch.where(a < 0, torch.maximum(surrogate, self.dual_clip_c * a), surrogate)
            metrics["dual_clip_frac"] = (a < 0) & (ratio.detach() > self.dual_clip_c)
            is_masked = is_masked | metrics["dual_clip_frac"]
        metrics["is_masked"] = is_masked
        return surrogate, metrics

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        surrogate, metrics = self.clipped(t.r, t.a)
        return Surrogate(torch.where(t.m, surrogate, 0.0), metrics)


@register_trust_region("cispo")
@dataclass(frozen=True)
class CISPO(TrustRegion):
    """MiniMax-M1: ``J = sg(clip(r, 1−ε_low, 1+ε_high)) · A' · trn`` (REINFORCE with a detached,
    clipped importance weight; no token is dropped)."""

    clip_low: float = 0.2
    clip_high: float = 0.2

    def check(self) -> None:
        super().check()
        _check_clip(self)

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        weight = t.r.clamp(1 - self.clip_low, 1 + self.clip_high).detach()
        objective = torch.where(t.m, weight * t.a * torch.where(t.m, t.trn, 0.0), 0.0)
        return Surrogate(objective, _clip_metrics(t.r, t.a, self.clip_low, self.clip_high))


@register_trust_region("gspo")
@dataclass(frozen=True)
class GSPO(TrustRegion):
    """GSPO-token (Zheng et al. 2025): PPO clip on ``s_t = sg(s_i) · exp(trn − sg(trn))`` with the
    sequence ratio ``s_i = exp(mean_{t∈i} log_r)``. Metrics ``seq_ratio_mean``/``_min``/``_max``."""

    clip_low: float = 3e-4
    clip_high: float = 4e-4

    def check(self) -> None:
        super().check()
        _check_clip(self)

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        seq_log_r, count = segment_mean(t.log_r.detach(), t.m, t.seq_ids, t.num_seqs)  # [S]
        seq_ratio = torch.exp(seq_log_r)  # [S]
        trn_m = torch.where(t.m, t.trn, 0.0)
        token_ratio = broadcast(seq_ratio, t.seq_ids) * torch.exp(trn_m - trn_m.detach())  # [N]
        surrogate, metrics = PPOClip(self.clip_low, self.clip_high).clipped(token_ratio, t.a)
        return Surrogate(torch.where(t.m, surrogate, 0.0), metrics, sequence_ratio=(seq_ratio, count > 0))


# ---------------------------------------------------------------------------------------------------
# verl 0.9.1's other loss modes: soft gates, geometric means, REINFORCE with truncated weights
# ---------------------------------------------------------------------------------------------------

_LOG_RATIO_CLAMP = 20.0  # verl clamps log r to [−20, 20] before exp in its sapo and dppo_* losses


def _required(region: TrustRegion) -> None:
    """Every field set (the base check lets None through for optional fields; these have none)."""
    for f in fields(region):  # type: ignore[arg-type]
        if getattr(region, f.name) is None:
            raise TypeError(f"{type(region).__name__}.{f.name} must be a number, got NoneType")


def _positive(region: TrustRegion, *names: str) -> None:
    for name in names:
        if not getattr(region, name) > 0:
            raise ValueError(f"{type(region).__name__}.{name} must be > 0, got {getattr(region, name)}")


def _clamped_ratio(t: PolicyTerms) -> Tensor:
    """``exp(clamp(log_r, −20, 20))`` as verl computes its ratio (no gradient outside the clamp).  ``[N]``."""
    return torch.exp(t.log_r.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))


def _trn(t: PolicyTerms) -> Tensor:
    """``trn`` on the members, 0 elsewhere (a non-member may hold inf or NaN).  ``[N]``."""
    return torch.where(t.m, t.trn, 0.0)


@register_trust_region("sapo")
@dataclass(frozen=True)
class SAPO(TrustRegion):
    """SAPO, Soft Adaptive Policy Optimization (Gao et al. 2025, arXiv:2511.20347); verl's ``sapo``.

    A smooth sigmoid gate replaces the hard clip::

        J_t = f_τ(r_t) · A'_t,   f_τ(x) = (4/τ) · σ(τ (x − 1)),   τ = τ_pos if A'_t > 0 else τ_neg

    so ``∇J_t = 4 σ(1 − σ) · r_t A'_t ∇log π_θ``: the plain IS gradient at ``r = 1``, decaying smoothly
    as ``r`` leaves 1 (faster for the larger ``τ``; the paper takes ``τ_neg > τ_pos`` to damp
    negative-advantage tokens). Defaults are verl's ``actor.tau_pos = 1.0``, ``actor.tau_neg = 1.05``.

    As verl: ``r = exp(clamp(log_r, −20, 20))`` (the paper does not clamp; no gradient past ±20), and
    ``A' = 0`` takes ``τ_neg``. verl always aggregates ``sapo`` by ``seq-mean-token-mean`` (its
    ``loss_agg_mode`` is ignored), which is ``normalize="sequence_mean"`` here; verl's ``old_log_prob``
    is ``t.base`` (the objective's ``ratio``). Metric ``soft_gate``: the gradient's factor
    ``4 σ(1 − σ) ∈ (0, 1]`` relative to the IS gradient. No token is dropped.
    """

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def check(self) -> None:
        super().check()
        _required(self)
        _positive(self, "tau_pos", "tau_neg")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        # filled, not torch.where(cond, float, float): that makes float32 and loses τ's digits in float64
        tau = torch.full_like(t.trn.detach(), self.tau_neg).masked_fill(t.a > 0, self.tau_pos)  # [N]
        gate = torch.sigmoid(tau * (_clamped_ratio(t) - 1))  # [N]
        objective = torch.where(t.m, (4 / tau) * gate * t.a, 0.0)
        g = gate.detach()
        return Surrogate(objective, {"soft_gate": 4 * g * (1 - g)})


@register_trust_region("geo_mean")
@dataclass(frozen=True)
class GMPO(TrustRegion):
    """GMPO, Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv:2507.20673); verl's ``geo_mean``.

    The clip acts on the token log-ratios, pessimistically for the sign of the advantage, and the
    objective is the geometric mean of the clipped ratios over the sequence's members::

        ℓ_t  = sgn(A'_t) · min(sgn(A'_t) · log r_t, sgn(A'_t) · clip(log r_t, −ε_low, ε_high))
        ρ_i  = exp(Σ_{t∈i} ℓ_t / (n_i + eps)),   Â_i = Σ_{t∈i} A'_t / (n_i + eps)
        J_t  = Â_i · ρ_i                 for every member t of sequence i

    so the token mean of ``J`` over sequence ``i`` is the paper's ``Â_i · ρ_i``: with
    ``normalize="sequence_mean"`` the loss is the paper's (and verl's ``mean`` over the rows, which
    also counts rows without members). A token with ``A' = 0`` contributes ``ℓ_t = 0`` (as verl).

    Deviations from the paper, as verl: ``eps = 1e-8`` in both denominators (``eps=0`` gives the
    paper's exact mean; a sequence without members is never divided by 0), and no clamp of ``log r``.
    The defaults ``ε_low = ε_high = 0.2`` are verl's ``clip_ratio_low``/``_high``; the paper uses 0.4
    (ratio range ``(e^−0.4, e^0.4)``). verl's ``old_log_prob`` is ``t.base``. Metrics
    ``clip_frac_high`` / ``clip_frac_low``: members with ``log r`` outside ``[−ε_low, ε_high]`` and
    ``A' > 0`` / ``A' < 0`` (verl's ``pg_clipfrac`` / ``pg_clipfrac_lower``); ``is_masked``: members
    whose clip binds (their ``ℓ_t`` carries no gradient); ``seq_ratio_*`` of ``ρ_i``.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    eps: float = 1e-8

    def check(self) -> None:
        super().check()
        _required(self)
        _nonnegative(self, "clip_low", "clip_high", "eps")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        log_r, a = t.log_r, t.a  # [N], both 0 off the members
        high = (a > 0) & (log_r > self.clip_high)  # the clip binds from above
        low = (a < 0) & (log_r < -self.clip_low)  # ... from below
        clipped_log_r = torch.where(high, self.clip_high, torch.where(low, -self.clip_low, log_r))
        clipped_log_r = torch.where(t.m & (a != 0), clipped_log_r, 0.0)  # [N]
        count = segment_sum(t.m.to(log_r.dtype), t.seq_ids, t.num_seqs)  # [S]
        denominator = torch.where(count > 0, count + self.eps, 1.0)  # [S]
        seq_ratio = torch.exp(segment_sum(clipped_log_r, t.seq_ids, t.num_seqs) / denominator)  # [S]
        seq_adv = segment_sum(a, t.seq_ids, t.num_seqs) / denominator  # [S]
        objective = torch.where(t.m, broadcast(seq_adv * seq_ratio, t.seq_ids), 0.0)  # [N]
        outside = (log_r > self.clip_high) | (log_r < -self.clip_low)
        metrics = {"is_masked": high | low, "clip_frac_high": outside & (a > 0), "clip_frac_low": outside & (a < 0)}
        return Surrogate(objective, metrics, sequence_ratio=(seq_ratio, count > 0))


@register_trust_region("gpg")
@dataclass(frozen=True)
class GPG(TrustRegion):
    """GPG, Group Policy Gradient (Chu et al. 2025, arXiv:2504.02546); verl's ``gpg``.

    Plain REINFORCE on the sampled tokens, no ratio and no trust region::

        J_t = A'_t · log π_θ(y_t)

    Its loss *value* is ``−A' · trn`` (verl's); its gradient equals ``"none"``'s on-policy. The
    objective's ``ratio`` is not read. GPG's group advantage (with its valid-sample correction) is
    verl's ``gpg`` advantage estimator, outside the loss: ship it as ``advantages``.
    """

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        return Surrogate(torch.where(t.m, t.a * _trn(t), 0.0), {})


@dataclass(frozen=True)
class _DPPOBinary(TrustRegion):
    """verl's DPPO-Binary losses (arXiv:2602.04879): REINFORCE with a truncated, detached IS weight
    (in place of a dual clip, after the paper's Section 5.4, as verl notes) on the tokens the
    divergence keeps::

        J_t = keep_t · sg(min(r_t, ratio_cap)) · A'_t · log π_θ(y_t)

    ``r = exp(clamp(log_r, −20, 20))`` as verl. ``keep_t`` (subclasses) is decided by the sign of
    ``A'`` (``A' = 0`` takes the negative side, as verl). ``low``/``high`` are verl's
    ``clip_ratio_low``/``_high`` (divergence thresholds here, default 0.2); ``ratio_cap`` is verl's
    ``clip_ratio_c``: its ``ActorConfig`` default 3.0 is what verl runs with (the loss's own fallback,
    20.0, applies only to a config without the key; verl's comment recommends a large cap). verl's
    ``old_log_prob`` (``π_old``, ``p_old``) is ``t.base``. Metrics: ``is_masked`` (verl's
    ``pg_clipfrac``), ``is_masked_high`` / ``_low`` (``A' > 0`` / ``A' < 0`` among them) and
    ``is_truncated``: kept members with ``r > ratio_cap`` (verl's ``pg_clipfrac_lower``).
    """

    low: float = 0.2
    high: float = 0.2
    ratio_cap: float = 3.0

    def check(self) -> None:
        super().check()
        _required(self)
        _nonnegative(self, "low", "high")
        _positive(self, "ratio_cap")

    def keep(self, t: PolicyTerms) -> Tensor:
        """Members kept by the divergence (bool ``[N]``)."""
        raise NotImplementedError

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        keep = self.keep(t)  # [N]
        ratio = _clamped_ratio(t).detach()  # [N]
        weight = ratio.clamp(max=self.ratio_cap)
        objective = torch.where(t.m & keep, weight * t.a * _trn(t), 0.0)
        drop = t.m & ~keep
        metrics = {
            "is_masked": drop,
            "is_masked_high": drop & (t.a > 0),
            "is_masked_low": drop & (t.a < 0),
            "is_truncated": keep & (ratio > self.ratio_cap),
        }
        return Surrogate(objective, metrics)


def _probs(t: PolicyTerms) -> tuple[Tensor, Tensor]:
    """``(p, p_old) = (exp(trn), exp(base))`` of the sampled tokens on masked values, detached.  ``[N]``."""
    return torch.exp(_trn(t).detach()), torch.exp(torch.where(t.m, t.base, 0.0))


@register_trust_region("dppo_tv")
@dataclass(frozen=True)
class DPPOTV(_DPPOBinary):
    """DPPO-Binary-TV as verl 0.9.1's ``dppo_tv`` (arXiv:2602.04879, the paper verl cites)::

        keep_t = p − p_old ≤ high    if A'_t > 0
                 p − p_old ≥ −low    otherwise
        J_t    = keep_t · sg(min(r_t, ratio_cap)) · A'_t · log π_θ(y_t)

    with ``p = π_θ(y_t)``, ``p_old = exp(base)``. The same tokens as prime-rl's ``"dppo"``
    (:class:`DPPOMask`), which differs in the surrogate (``r · A'``, no cap); that one is untouched.
    See :class:`_DPPOBinary` for ``r``, the cap, the defaults and the metrics.
    """

    def keep(self, t: PolicyTerms) -> Tensor:
        p, p_old = _probs(t)
        dp = p - p_old  # [N]
        return torch.where(t.a > 0, dp <= self.high, dp >= -self.low)


@register_trust_region("dppo_kl")
@dataclass(frozen=True)
class DPPOKL(_DPPOBinary):
    """DPPO-Binary-KL as verl 0.9.1's ``dppo_kl`` (arXiv:2602.04879, the paper verl cites)::

        D_t    = p_old · log(p_old / p) + (1 − p_old) · log((1 − p_old + 1e-8) / (1 − p + 1e-8))
        keep_t = D_t ≤ high  or  p ≤ p_old     if A'_t > 0
                 D_t ≤ low   or  p ≥ p_old     otherwise
        J_t    = keep_t · sg(min(r_t, ratio_cap)) · A'_t · log π_θ(y_t)

    ``D`` is the KL of the binary distributions (sampled token vs the rest) from π_old to π_θ; the
    ``1e-8`` is verl's guard (not in the paper), kept so the masks agree. A token only drops when it
    moved past the threshold in the direction its advantage pushes. See :class:`_DPPOBinary` for
    ``r``, the cap, the defaults and the metrics.
    """

    def keep(self, t: PolicyTerms) -> Tensor:
        p, p_old = _probs(t)
        base = torch.where(t.m, t.base, 0.0)
        binary_kl = p_old * (base - _trn(t).detach()) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        keep_pos = (binary_kl <= self.high) | (p <= p_old)
        keep_neg = (binary_kl <= self.low) | (p >= p_old)
        return torch.where(t.a > 0, keep_pos, keep_neg)


@register_trust_region("topr")
@dataclass(frozen=True)
class TOPR(TrustRegion):
    """TOPR, Tapered Off-Policy REINFORCE (Le Roux et al. 2025, arXiv:2503.14286). No verl loss mode.

    REINFORCE without IS on positive examples and with a truncated, detached sequence-level IS
    weight on negative ones::

        w_i = [π_θ(y_i) / μ(y_i)]_low^high = clamp(exp(Σ_{t∈i} log r_t), low, high)
        J_t = sg(1 if A'_t ≥ 0 else w_{s(t)}) · A'_t · log π_θ(y_t)

    ``μ`` is the behaviour policy, ``t.base`` (``ratio="rollout"``: π_rollout; ``"old"``: π_old;
    on-policy ``w = 1``: plain REINFORCE). The paper's truncation is ``[·]_0^1`` (the defaults); the
    ratio is the whole sequence's, as in the paper (computed in log space, so it never overflows).
    The sum over a sequence's tokens is ``w_i A'_i log π_θ(y_i)`` (with a sequence-level advantage):
    ``normalize="sequence_sum"`` gives the paper's mean over examples. Metrics: ``truncated_frac_high``
    / ``_low``: negative-advantage members whose ratio is cut to ``high`` / raised to ``low``;
    ``negative_is_weight``: mean ``w`` over the negative-advantage members. No token is dropped.
    """

    low: float = 0.0
    high: float = 1.0

    def check(self) -> None:
        super().check()
        _required(self)
        _nonnegative(self, "low")
        _positive(self, "high")
        if not self.low <= self.high:
            raise ValueError(f"TOPR.low must be <= TOPR.high, got {self.low} > {self.high}")

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        log_seq_ratio = segment_sum(t.log_r.detach(), t.seq_ids, t.num_seqs)  # [S]; log_r is 0 off the members
        log_high = math.log(self.high)
        weight = torch.exp(log_seq_ratio.clamp(max=log_high)).clamp(min=self.low)  # [S]
        negative = t.a < 0  # [N]
        token_weight = torch.where(negative, broadcast(weight, t.seq_ids), 1.0)  # [N]
        objective = torch.where(t.m, token_weight * t.a * _trn(t), 0.0)
        log_seq_ratio_t = broadcast(log_seq_ratio, t.seq_ids)  # [N]
        metrics = {
            "truncated_frac_high": negative & (log_seq_ratio_t > log_high),
            "truncated_frac_low": negative & (torch.exp(log_seq_ratio_t) < self.low),
            "negative_is_weight": (token_weight, t.m & negative),
        }
        return Surrogate(objective, metrics)
