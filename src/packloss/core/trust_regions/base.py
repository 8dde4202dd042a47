"""The trust-region interface: what a region reads (:class:`PolicyTerms`), what it returns
(:class:`Surrogate`), the base classes :class:`TrustRegion` and :class:`StepSelector` (a region that
selects its tokens over the whole step, from :class:`SelectionStreams`), the registry
:data:`TRUST_REGIONS`, and the helpers the built-in regions share. Regions read only these types:
nothing here imports the rest of ``packloss.core``. The story: ``docs/design.md``, section 4."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch
from torch import Tensor

from packloss.core import checks
from packloss.core.segments import Segments

__all__ = [
    "PolicyTerms",
    "Surrogate",
    "TrustRegion",
    "StepSelector",
    "SelectionStreams",
    "TRUST_REGIONS",
    "register_trust_region",
    "trust_region",
]


@dataclass(frozen=True, eq=False)
class PolicyTerms:
    """The per-token quantities of one bin that every trust region reads (``[N]``, ``S`` sequences).

    ``m`` members (bool); ``trn`` log π_θ (carries the gradient); ``base`` the ratio's denominator
    (detached); ``log_r = where(m, trn − base, 0)``; ``r = finite_exp(log_r)``; ``adv`` the raw advantage
    (detached, 0 off ``m``); ``a = adv_coef · adv``; ``segments`` the bin's per-sequence reductions
    (exact over a context-parallel bin: use them, never ``segment_sum`` on ``seq_ids``);
    ``old`` / ``rollout`` the old and rollout log-probs (detached, None when the plan has none);
    ``selected`` / ``scores`` the step-wide selection of a :class:`StepSelector` region (else None).
    """

    m: Tensor
    trn: Tensor
    base: Tensor
    log_r: Tensor
    r: Tensor
    adv: Tensor
    a: Tensor
    segments: Segments
    old: Tensor | None = None
    rollout: Tensor | None = None
    selected: Tensor | None = None
    scores: Tensor | None = None

    def prob_diff(self) -> Tensor:
        """``dp = π_θ − π_base`` of the sampled tokens (detached), on masked values.  ``[N]``."""
        return torch.exp(torch.where(self.m, self.trn.detach(), 0.0)) - torch.exp(torch.where(self.m, self.base, 0.0))

    def numerator(self) -> Tensor:
        """``old``, else ``sg(trn)``: the numerator of a rollout correction's ratio.  ``[N]``."""
        return self.trn.detach() if self.old is None else self.old


@dataclass
class Surrogate:
    """A trust region's result: ``objective [N]`` (to maximise; zero off the members) and ``metrics``:
    name → ``[N]`` values averaged over the members, or ``(values [N], mask [N])`` averaged over
    ``mask``. ``"is_masked"`` (members whose policy gradient is zeroed) is reported by every region
    that drops tokens. ``sequence_ratio`` is ``(s_i [S], has_members [S])`` for sequence ratios."""

    objective: Tensor
    metrics: dict[str, Tensor | tuple[Tensor, Tensor]]
    sequence_ratio: tuple[Tensor, Tensor] | None = None


class TrustRegion:
    """Base class of the trust regions: a frozen dataclass with ``surrogate(t) -> Surrogate``.
    ``name`` is set by :func:`register_trust_region`; ``check`` validates the fields."""

    name: ClassVar[str] = ""
    reads_token_ratio: ClassVar[bool] = True
    """Whether the surrogate reads ``t.r``, the token ratio a ``PolicyGradient(ratio_cap=)`` caps
    (False for the regions computing from ``log_r`` or ``trn``: sequence ratios, REINFORCE, SAPO)."""
    token_local: ClassVar[bool] = True
    """Whether the surrogate's gradient at token ``t`` reads ``trn`` at ``t`` only (False for those
    coupling a sequence's tokens: sequence ratios and weights); see ``Objective.token_local``."""

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        raise NotImplementedError

    def check(self) -> None:
        """Every field that is set is a finite number (subclasses add their own ranges)."""
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                checks.number(f"{type(self).__name__}.{f.name}", value)

    def __post_init__(self) -> None:
        self.check()


@dataclass(frozen=True, eq=False)
class SelectionStreams:
    """The pre-forward streams of one component in one bin that a step-wide selection reads: float64,
    zero off the members ``m``. ``advantages`` is None unless the objective ships them; ``ratio`` and
    ``adv_coef`` are the objective's."""

    m: Tensor
    advantages: Tensor | None
    old: Tensor | None
    rollout: Tensor | None
    ratio: str
    adv_coef: float

    def logprobs(self, who: str) -> Tensor:
        """``p``: the old log-probs, else the rollout's (π_θ before the forward).  ``[N]``."""
        p = self.old if self.old is not None else self.rollout
        if p is None:
            raise ValueError(
                f"{who} reads old_logprobs (else rollout_logprobs) before the forward; the plan has neither"
            )
        return p

    def shipped_advantages(self, who: str) -> Tensor:
        """The advantages stream, or a ``ValueError`` when the objective does not ship them.  ``[N]``."""
        if self.advantages is None:
            raise ValueError(f"{who} reads the advantages before the forward: its objective needs advantage='shipped'")
        return self.advantages


class StepSelector(TrustRegion):
    """A trust region whose surrogate reads a token selection made over the whole step
    (``docs/design.md``, "Step-wide token selection"): additive float64 :meth:`sums`, per-token
    :meth:`scores`, a host :meth:`bound` on the selection's size and the score :meth:`threshold`.
    The engine puts the selection in ``PolicyTerms.selected``: the members with ``score ≥ θ``."""

    num_sums: ClassVar[int] = 0

    def sums(self, s: SelectionStreams) -> Tensor:
        """This bin's additive statistics, float64 ``[num_sums]``."""
        raise NotImplementedError

    def scores(self, s: SelectionStreams, sums: Tensor) -> Tensor:
        """Per-token float64 scores ``[N]`` from the token's streams and the step's ``sums``; ``−inf``
        off the candidates."""
        raise NotImplementedError

    def bound(self, num_tokens: int) -> int:
        """A host upper bound (≥ 1, monotone) on how many of ``num_tokens`` tokens a step selects."""
        raise NotImplementedError

    def threshold(self, top: Tensor, sums: Tensor) -> Tensor:
        """The 0-d float64 threshold from the step's largest scores ``top`` (descending, ``−inf``
        padded, at least ``bound`` long) and ``sums``; ``+inf`` selects nothing."""
        raise NotImplementedError

    def selected(self, t: PolicyTerms) -> Tensor:
        """The selected members of the bin ``[N]`` (bool), as the engine computed them."""
        if t.selected is None:
            raise ValueError(
                f"{type(self).__name__} selects tokens over the step: call it through compute_loss, which "
                "computes the selection (PolicyTerms.selected is None)"
            )
        return t.selected & t.m


TRUST_REGIONS: dict[str, type[TrustRegion]] = {}
"""Every registered trust region by name (all defined in ``packloss.core.trust_regions``)."""


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
    if isinstance(spec, type) and issubclass(spec, TrustRegion):
        raise TypeError(f"trust_region must be an instance, got the class {spec.__name__}: write {spec.__name__}()")
    raise TypeError(f"trust_region must be a TrustRegion or a registered name, got {type(spec).__name__}")


# ---------------------------------------------------------------------------------------------------
# Helpers the built-in regions share
# ---------------------------------------------------------------------------------------------------

LOG_RATIO_CLAMP = 20.0
"""verl and OpenRLHF clamp ``log r`` to ``[−20, 20]`` before ``exp`` in some losses."""


def nonnegative(region: TrustRegion, *names: str) -> None:
    for name in names:
        checks.nonnegative(f"{type(region).__name__}.{name}", getattr(region, name))


def positive(region: TrustRegion, *names: str) -> None:
    for name in names:
        checks.positive(f"{type(region).__name__}.{name}", getattr(region, name))


def required(region: TrustRegion) -> None:
    """Every field set (the base check lets None through for optional fields)."""
    for f in fields(region):  # type: ignore[arg-type]
        if getattr(region, f.name) is None:
            raise TypeError(f"{type(region).__name__}.{f.name} must be a number, got NoneType")


def check_clip(region: TrustRegion) -> None:
    """``clip_low`` in ``[0, 1)`` and ``clip_high >= 0``."""
    if not 0 <= region.clip_low < 1:
        raise ValueError(f"{type(region).__name__}.clip_low must be in [0, 1), got {region.clip_low}")
    nonnegative(region, "clip_high")


def masked(t: PolicyTerms, drop: Tensor, metrics: dict[str, Tensor]) -> Surrogate:
    """The token-dropping regions: ``J = (m & ¬drop) · a · r``."""
    keep = t.m & ~drop
    return Surrogate(keep * t.a * t.r, {"is_masked": drop, **metrics})  # r is finite: 0 · r = 0


def clamped_ratio(t: PolicyTerms) -> Tensor:
    """``exp(clamp(log_r, −20, 20))`` (no gradient outside the clamp).  ``[N]``."""
    return torch.exp(t.log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def member_trn(t: PolicyTerms) -> Tensor:
    """``trn`` on the members, 0 elsewhere (a non-member may hold inf or NaN).  ``[N]``."""
    return torch.where(t.m, t.trn, 0.0)
