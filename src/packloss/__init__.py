"""packloss: sync-free, vectorised losses for LLM post-training on packed micro-batches."""

from packloss.core.advantages import gae_advantages, group_advantages
from packloss.core.bin import (
    Aggregation,
    Component,
    ComponentInputs,
    ComponentOutput,
    Normalize,
    Objective,
    Plan,
)
from packloss.core.context_parallel import ContextShard, gradient_scale
from packloss.core.corrections import GatedCorrection, OffPolicyMask, RolloutCorrection
from packloss.core.engine import LossResult, compute_loss
from packloss.core.entropy import AdaptiveEntropy, Entropy
from packloss.core.kl import KLPenalty, RatioWeightedKL
from packloss.core.kto import KTO, kto_reference_kl
from packloss.core.layout import Layout, PaddedLayout
from packloss.core.metrics import all_reduce_metrics, merge_metrics
from packloss.core.outputs import Outputs
from packloss.core.pg import DPPO, IPO, REF_KL, PolicyGradient
from packloss.core.preference import DPO, ORPO, SimPO
from packloss.core.recipe import POLICY, PRESETS, Recipe, preset
from packloss.core.sampler import DistributionalIPO, ScoreCentering
from packloss.core.sft import SFT
from packloss.core.step import StepDenominators, count_denominators
from packloss.core.trust_regions import TRUST_REGIONS, PolicyTerms, Surrogate, TrustRegion, register_trust_region
from packloss.core.value import ValueLoss
from packloss.vocab import FusedObjective, MultiTeacherDistill, TeacherHeads, TopKDistill, VocabDistill, VocabParallel

__all__ = [
    "Plan",
    "Component",
    "Outputs",
    "ContextShard",
    "gradient_scale",
    "compute_loss",
    "LossResult",
    "Normalize",
    "StepDenominators",
    "count_denominators",
    "Objective",
    "PolicyGradient",
    "KLPenalty",
    "RatioWeightedKL",
    "RolloutCorrection",
    "GatedCorrection",
    "OffPolicyMask",
    "TrustRegion",
    "PolicyTerms",
    "Surrogate",
    "TRUST_REGIONS",
    "register_trust_region",
    "Recipe",
    "POLICY",
    "PRESETS",
    "preset",
    "DPPO",
    "IPO",
    "REF_KL",
    "SFT",
    "Entropy",
    "AdaptiveEntropy",
    "VocabDistill",
    "FusedObjective",
    "TopKDistill",
    "MultiTeacherDistill",
    "TeacherHeads",
    "VocabParallel",
    "ComponentInputs",
    "ComponentOutput",
    "Aggregation",
    "merge_metrics",
    "all_reduce_metrics",
    "Layout",
    "PaddedLayout",
    "group_advantages",
    "gae_advantages",
    "ValueLoss",
    "DistributionalIPO",
    "ScoreCentering",
    "DPO",
    "SimPO",
    "ORPO",
    "KTO",
    "kto_reference_kl",
]

__version__ = "0.3.0"
