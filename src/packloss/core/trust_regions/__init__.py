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

Modules: :mod:`.base` (the interface and registry), :mod:`.masking` (regions that drop tokens),
:mod:`.clipping` (clipped and gated regions), :mod:`.reinforce` (REINFORCE-style regions).
"""

from packloss.core.trust_regions.base import (
    TRUST_REGIONS,
    PolicyTerms,
    Surrogate,
    TrustRegion,
    register_trust_region,
    trust_region,
)
from packloss.core.trust_regions.clipping import CISPO, GMPO, GSPO, SAPO, PPOClip
from packloss.core.trust_regions.masking import DPPOKL, DPPOTV, DPPOMask, IcePop, IPOMask, NoRegion, OneSided
from packloss.core.trust_regions.reinforce import GPG, TOPR

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
