"""packloss: sync-free, vectorised losses for LLM post-training on packed micro-batches."""

from packloss.batch import PackedBatch
from packloss.ce import ce_loss
from packloss.component import LossFn, LossInputs, LossOutputs
from packloss.compute import LossResult, compute_loss
from packloss.distill import forward_kl, jsd, reverse_kl, soft_cross_entropy
from packloss.head import linear_distill, linear_logprobs
from packloss.metrics import all_reduce_metrics, merge_metrics
from packloss.normalize import NORMALIZE_MODES, StepDenominators, count_denominators
from packloss.pg import DPPO, IPO, REF_KL, PGParams, pg_loss

__all__ = [
    "PackedBatch",
    "LossInputs",
    "LossOutputs",
    "LossFn",
    "LossResult",
    "compute_loss",
    "PGParams",
    "pg_loss",
    "ce_loss",
    "DPPO",
    "IPO",
    "REF_KL",
    "merge_metrics",
    "all_reduce_metrics",
    "NORMALIZE_MODES",
    "StepDenominators",
    "count_denominators",
    "reverse_kl",
    "forward_kl",
    "jsd",
    "soft_cross_entropy",
    "linear_logprobs",
    "linear_distill",
]

__version__ = "0.1.0"
