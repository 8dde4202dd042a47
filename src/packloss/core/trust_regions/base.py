"""The trust-region interface: :class:`PolicyTerms` (what a region reads), :class:`Surrogate` (what it
returns), the :class:`TrustRegion` base class and the registry :data:`TRUST_REGIONS`; the helpers the
built-in regions share."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

import torch
from torch import Tensor

__all__ = ["PolicyTerms", "Surrogate", "TrustRegion", "TRUST_REGIONS", "register_trust_region", "trust_region"]


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
