"""packloss.core.sft: SFT's per-token loss is −trn on the members, its ``{name}/loss`` metric the mean NLL;
it reads only the trainer's log-probs."""

from __future__ import annotations

import pytest
import torch

from conftest import one_sequence, toy
from packloss import SFT, Component, Outputs, Plan, compute_loss


def test_sft_loss():
    trn = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    w = torch.tensor([0.5, 0.0, 2.0])
    out = one_sequence(SFT(), trn, None, None, None, torch.ones(3, dtype=torch.bool), w)
    assert out.loss.item() == pytest.approx(0.5 + 6.0)
    assert out.metrics["rl/loss"].item() == pytest.approx(2.0)  # the mean NLL over the members


def test_sft_only_step_needs_only_logprobs():
    _, seq_lens, _, trainer, mask = toy()
    plan = Plan(seq_lens, {"sft": Component(SFT(), mask=mask)})
    result = compute_loss(plan, Outputs(logprobs=trainer))
    expected = -(trainer.detach()[mask]).sum() / mask.sum()
    assert torch.allclose(result.loss, expected, rtol=1e-6)
    assert torch.allclose(result.metrics["sft/loss"], expected, rtol=1e-6)
    assert result.counts["sft/loss"].item() == mask.sum().item()
    result.loss.backward()
    assert torch.equal(trainer.grad, torch.where(mask, -1.0 / mask.sum(), 0.0))


def test_per_token_losses_are_reported_zero_off_members():
    _, seq_lens, _, trainer, mask = toy()
    result = compute_loss(Plan(seq_lens, {"sft": Component(SFT(), mask=mask)}), Outputs(logprobs=trainer))
    assert torch.equal(result.per_token["sft"], torch.where(mask, -trainer.detach(), 0.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logprobs_are_computed_in_float32(dtype):
    trn = torch.tensor([-1.0, -2.5, -0.25, -4.0], dtype=dtype, requires_grad=True)
    mask = torch.tensor([True, False, True, True])
    result = compute_loss(Plan([2, 2], {"sft": Component(SFT(), mask=mask)}), Outputs(logprobs=trn))
    assert result.loss.dtype == torch.float32 and result.per_token["sft"].dtype == torch.float32
    assert result.loss.item() == pytest.approx((1.0 + 0.25 + 4.0) / 3)  # values exact in both dtypes
    result.loss.backward()
    assert trn.grad.dtype == dtype
    assert trn.grad.float().tolist() == pytest.approx([-1 / 3, 0.0, -1 / 3, -1 / 3], rel=1e-2)


def test_sft_weights_scale_the_loss_not_the_metric():
    """Weights multiply ℓ_t in the loss; the ``loss`` metric stays the unweighted mean NLL of the members."""
    trn = torch.tensor([-1.0, -3.0, -2.0], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([1.0, 3.0, 0.0], dtype=torch.float64)  # the third token is no member (weight 0)
    plan = Plan([3], {"nll": Component(SFT(), weights=w)})
    result = compute_loss(plan, Outputs(logprobs=trn))
    assert result.loss.item() == pytest.approx((1.0 * 1.0 + 3.0 * 3.0) / 2)  # token mean over 2 members
    assert result.metrics["nll/loss"].item() == pytest.approx((1.0 + 3.0) / 2)
    (grad,) = torch.autograd.grad(result.loss, trn)
    assert grad.tolist() == pytest.approx([-0.5, -1.5, 0.0])
