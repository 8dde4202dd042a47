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

from packloss.core.segments import broadcast, segment_mean

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
