"""packloss: sync-free, vectorised losses for LLM post-training on packed micro-batches."""

from packloss.core.advantages import group_advantages
from packloss.core.components import Aggregation, ComponentInputs, ComponentOutput
from packloss.core.corrections import RolloutCorrection
from packloss.core.engine import LossResult, compute_loss
from packloss.core.entropy import AdaptiveEntropy, Entropy
from packloss.core.layout import Layout, PaddedLayout
from packloss.core.metrics import all_reduce_metrics, merge_metrics
from packloss.core.normalize import Normalize, StepDenominators, count_denominators
from packloss.core.pg import DPPO, IPO, REF_KL, KLPenalty, PolicyGradient
from packloss.core.plan import Component, Outputs, Plan
from packloss.core.recipe import PRESETS, Part, Recipe, preset
from packloss.core.sft import SFT
from packloss.core.trust_regions import TRUST_REGIONS, PolicyTerms, Surrogate, TrustRegion, register_trust_region
from packloss.vocab import VocabDistill, VocabParallel

__all__ = [
    "Plan",
    "Component",
    "Outputs",
    "compute_loss",
    "LossResult",
    "Normalize",
    "StepDenominators",
    "count_denominators",
    "PolicyGradient",
    "KLPenalty",
    "RolloutCorrection",
    "TrustRegion",
    "PolicyTerms",
    "Surrogate",
    "TRUST_REGIONS",
    "register_trust_region",
    "Recipe",
    "Part",
    "PRESETS",
    "preset",
    "DPPO",
    "IPO",
    "REF_KL",
    "SFT",
    "Entropy",
    "AdaptiveEntropy",
    "VocabDistill",
    "VocabParallel",
    "ComponentInputs",
    "ComponentOutput",
    "Aggregation",
    "merge_metrics",
    "all_reduce_metrics",
    "Layout",
    "PaddedLayout",
    "group_advantages",
]

__version__ = "0.2.0"
