"""Full-vocabulary losses: per-token divergences from logits, the fused LM head and its distillation,
and the ``VocabDistill`` engine component, on one vocabulary core (:mod:`packloss.vocab.core`)."""

from packloss.vocab.component import VocabDistill
from packloss.vocab.core import DIVERGENCES, VocabParallel
from packloss.vocab.distill import divergence, forward_kl, jsd, reverse_kl, soft_cross_entropy
from packloss.vocab.head import linear_logprobs
from packloss.vocab.head_distill import linear_distill

__all__ = [
    "VocabParallel",
    "DIVERGENCES",
    "divergence",
    "reverse_kl",
    "forward_kl",
    "jsd",
    "soft_cross_entropy",
    "linear_logprobs",
    "linear_distill",
    "VocabDistill",
]
