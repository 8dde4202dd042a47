"""Trust regions: how a policy-gradient objective turns ratios and advantages into a surrogate.

Every region is registered by name in :data:`TRUST_REGIONS` when ``packloss`` is imported; a new one is
a frozen dataclass with ``surrogate(t: PolicyTerms) -> Surrogate`` under ``@register_trust_region``.
Families: :mod:`.masking` (drop tokens), :mod:`.clipping` (clipped and gated), :mod:`.sequence`
(sequence ratios), :mod:`.reinforce` (detached weights), :mod:`.selection` (selected over the step).
Formulas and peer mappings: ``docs/objectives.md``.
"""

from packloss.core.trust_regions.base import (
    TRUST_REGIONS,
    PolicyTerms,
    SelectionStreams,
    StepSelector,
    Surrogate,
    TrustRegion,
    register_trust_region,
    trust_region,
)
from packloss.core.trust_regions.clipping import CISPO, SAPO, CISPOCap, ClampedPPOClip, PPOClip
from packloss.core.trust_regions.masking import (
    DPPOKL,
    DPPOTV,
    DPPOMask,
    IcePop,
    IcePopLogBand,
    IPOMask,
    NoRegion,
    OneSided,
)
from packloss.core.trust_regions.reinforce import GPG, TOPR, VESPO
from packloss.core.trust_regions.selection import M2PO, ClipCov, KLCov
from packloss.core.trust_regions.sequence import GMPO, GSPO, SequenceLevel, SequenceRatioClip

__all__ = [
    "PolicyTerms",
    "Surrogate",
    "TrustRegion",
    "StepSelector",
    "SelectionStreams",
    "TRUST_REGIONS",
    "register_trust_region",
    "trust_region",
    "DPPOMask",
    "IPOMask",
    "OneSided",
    "NoRegion",
    "IcePop",
    "IcePopLogBand",
    "DPPOTV",
    "DPPOKL",
    "PPOClip",
    "ClampedPPOClip",
    "CISPO",
    "CISPOCap",
    "SAPO",
    "GSPO",
    "SequenceLevel",
    "SequenceRatioClip",
    "GMPO",
    "GPG",
    "TOPR",
    "VESPO",
    "ClipCov",
    "KLCov",
    "M2PO",
]
