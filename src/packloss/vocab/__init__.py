"""Full-vocabulary losses: per-token divergences from logits, the fused LM head, its distillation,
sampler-support log-probs and the ``VocabDistill`` engine component, on one vocabulary core
(:mod:`packloss.vocab.core`)."""

from packloss.vocab.component import VocabDistill
from packloss.vocab.core import DIVERGENCES, VocabParallel
from packloss.vocab.distill import divergence, forward_kl, jsd, reverse_kl, soft_cross_entropy
from packloss.vocab.fused_objective import FusedObjective
from packloss.vocab.head import linear_logprobs
from packloss.vocab.head_distill import linear_distill
from packloss.vocab.multi_teacher import MultiTeacherDistill, TeacherHeads
from packloss.vocab.sharded import HeadWeight, head_weight, sharded_linear_logprobs
from packloss.vocab.support import logprobs_at, support_logprobs
from packloss.vocab.topk import TopKDistill, linear_topk_divergence, topk_divergence

__all__ = [
    "VocabParallel",
    "DIVERGENCES",
    "divergence",
    "reverse_kl",
    "forward_kl",
    "jsd",
    "soft_cross_entropy",
    "linear_logprobs",
    "HeadWeight",
    "head_weight",
    "sharded_linear_logprobs",
    "support_logprobs",
    "logprobs_at",
    "linear_distill",
    "VocabDistill",
    "FusedObjective",
    "TopKDistill",
    "MultiTeacherDistill",
    "TeacherHeads",
    "topk_divergence",
    "linear_topk_divergence",
]
