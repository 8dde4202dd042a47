"""Custom rl losses used by the tests (imported through ``CustomLossConfig.import_path`` and by
``packloss check``). Like prime-rl's own custom losses they take a ``LossInputs`` and return
``LossOutputs``, and they read only prime-rl's fields (no ``inputs.mean``): the per-sequence
reference calls them with its own, independent ``LossInputs``."""

from __future__ import annotations

import torch

from packloss.compat.prime_rl import LossInputs, LossOutputs
from packloss.core.segments import broadcast, segment_count


def additive_loss(inputs: LossInputs, coef: float = 1.0) -> LossOutputs:
    """Additive over tokens: ``Σ_{t∈m} −coef · A · exp(trn − inf)``. Safe per bin or per sequence."""
    m = inputs.loss_mask
    ratio = torch.exp(torch.where(m, inputs.trainer_logprobs - inputs.inference_logprobs, 0.0))
    per_token = -coef * torch.where(m, inputs.advantages, 0.0) * ratio
    if inputs.loss_weights is not None:
        per_token = per_token * torch.where(m, inputs.loss_weights, 0.0)
    mean_ratio = torch.where(m, ratio, 0.0).detach().sum() / m.sum().clamp_min(1)  # no sync: a tensor
    return LossOutputs(loss=per_token.sum(), metrics={"custom_ratio": mean_ratio})


def per_sequence_mean_naive(inputs: LossInputs) -> LossOutputs:
    """NOT additive: divides by the member count of whatever it is called on (a sequence or a bin)."""
    m = inputs.loss_mask
    per_token = torch.where(m, -inputs.trainer_logprobs * inputs.advantages, 0.0)
    return LossOutputs(loss=per_token.sum() / m.sum().clamp_min(1), metrics={})


def per_sequence_mean_segmented(inputs: LossInputs) -> LossOutputs:
    """The same per-sequence mean, made exact on a packed bin with the layout fields."""
    m = inputs.loss_mask
    per_token = torch.where(m, -inputs.trainer_logprobs * inputs.advantages, 0.0)
    count = broadcast(segment_count(m, inputs.seq_ids, inputs.num_seqs), inputs.seq_ids)
    return LossOutputs(loss=(per_token / count.clamp_min(1)).sum(), metrics={})


def constant_loss(inputs: LossInputs) -> LossOutputs:
    """Returns a detached constant: compute_loss must still hand back a backward-able total."""
    return LossOutputs(loss=torch.zeros(()), metrics={})
