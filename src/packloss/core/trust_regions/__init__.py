"""Trust regions: how a policy-gradient objective turns ratios and advantages into a surrogate.

Every region is registered by name in :data:`TRUST_REGIONS` when ``packloss`` is imported; a new one is
a frozen dataclass with ``surrogate(t: PolicyTerms) -> Surrogate`` under ``@register_trust_region``.
Families: :mod:`.masking` (drop tokens), :mod:`.clipping` (clipped and gated), :mod:`.sequence`
(sequence ratios), :mod:`.reinforce` (detached weights), :mod:`.selection` (selected over the step).
Formulas and peer mappings: ``docs/objectives.md``.
"""

from packloss.core.trust_regions import base, clipping, masking, reinforce, selection, sequence
from packloss.core.trust_regions.base import *  # noqa: F403
from packloss.core.trust_regions.clipping import *  # noqa: F403
from packloss.core.trust_regions.masking import *  # noqa: F403
from packloss.core.trust_regions.reinforce import *  # noqa: F403
from packloss.core.trust_regions.selection import *  # noqa: F403
from packloss.core.trust_regions.sequence import *  # noqa: F403

__all__ = [*base.__all__, *masking.__all__, *clipping.__all__, *sequence.__all__, *reinforce.__all__,
           *selection.__all__]  # fmt: skip
