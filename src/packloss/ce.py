"""The ``ce`` component: masked negative log-likelihood (SFT, ECHO observation tokens)."""

from __future__ import annotations

import torch

from packloss.component import LossInputs, LossOutputs, make_outputs, upcast

__all__ = ["ce_loss"]


def ce_loss(inputs: LossInputs) -> LossOutputs:
    """``loss = Σ_{t∈m} −trn_t · w_t`` over the members ``m`` (every stream ``[N]``).

    Metric ``nll``: unweighted mean of ``−trn`` over the members.
    """
    m = inputs.loss_mask  # [N]
    trn = upcast(inputs.trainer_logprobs)  # [N]
    nll = -trn
    if inputs.loss_weights is not None:
        nll = nll * upcast(inputs.loss_weights)
    loss = torch.where(m, nll, 0.0).sum()
    return make_outputs(inputs, loss, {"nll": (-trn, m)})
