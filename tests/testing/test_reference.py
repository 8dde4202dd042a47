"""packloss.testing.reference: prime-rl's per-sequence loss (before #2951) on bins small enough to compute
by hand: DPPO, IPO, the SFT and on-policy distillation terms, the config dispatch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from packloss.compat.prime_rl import DefaultLossConfig, IPOLossConfig
from packloss.testing import reference

F64 = torch.float64


def _log(*p: float) -> torch.Tensor:
    return torch.tensor(p, dtype=F64).log()


def test_dppo_on_one_sequence_by_hand():
    """p_inf = 0.5 everywhere, p_trn = 0.5, 0.4, 0.9, A = 1: the last token's probability rose by 0.4 > 0.2
    and drops from the policy gradient; the squared-log-ratio KL (1e-3) counts every member."""
    trn = _log(0.5, 0.4, 0.9).requires_grad_()
    loss, metrics = reference.compute_loss(
        [trn], [_log(0.5, 0.5, 0.5)], None, [torch.ones(3, dtype=F64)], [torch.ones(3, dtype=torch.bool)],
        None, None, None, reference.setup_rl_loss_fn(DefaultLossConfig()), rl_scale=3, ce_scale=1, ref_kl_scale=1,
    )  # fmt: skip
    a, b = math.log(0.8), math.log(1.8)
    assert loss.item() == pytest.approx((-(1.0 + 0.8) + 1e-3 * (a**2 + b**2)) / 3, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, trn)
    want = torch.tensor([-1.0, -0.8 + 2e-3 * a, 2e-3 * b], dtype=F64) / 3
    assert torch.allclose(grad, want, rtol=1e-12, atol=0)
    assert metrics["is_masked"].tolist() == pytest.approx([1 / 3])  # one value per sequence
    assert metrics["is_masked_high"].tolist() == pytest.approx([1 / 3])
    assert metrics["masked_mismatch_kl"].tolist() == pytest.approx([1.8 - b - 1])
    assert metrics["masked_advantage_positive"].tolist() == pytest.approx([1.0])


def test_ipo_drops_both_directions_and_weights_scale_the_loss():
    """IPO (threshold 0.1): p 0.5 → 0.65 and 0.5 → 0.3 drop; 0.5 → 0.55 stays (weight 2)."""
    trn = _log(0.65, 0.3, 0.55).requires_grad_()
    fn = reference.setup_rl_loss_fn(IPOLossConfig())
    adv = torch.full((3,), -0.5, dtype=F64)
    w = torch.tensor([1.0, 1.0, 2.0], dtype=F64)
    loss, metrics = reference.compute_loss(
        [trn], [_log(0.5, 0.5, 0.5)], None, [adv], [torch.ones(3, dtype=torch.bool)], [w], None, None, fn,
        rl_scale=1, ce_scale=1, ref_kl_scale=1,
    )  # fmt: skip
    logs = [math.log(1.3), math.log(0.6), math.log(1.1)]
    kl = 1e-3 * (logs[0] ** 2 + logs[1] ** 2 + 2 * logs[2] ** 2)
    assert loss.item() == pytest.approx(-2 * (-0.5 * 1.1) + kl, rel=1e-12)
    assert metrics["is_masked"].tolist() == pytest.approx([2 / 3])


def test_sft_and_distillation_terms_and_their_scales():
    """Two sequences: ce weights on one token of each (NLL · w / ce_scale), the distillation's advantage
    ref − trn (drift KL 1e-3) on the other tokens; the rl component has no member."""
    trn = [_log(0.5, 0.25).requires_grad_(), _log(0.8, 0.5).requires_grad_()]
    inf = [_log(0.5, 0.25), _log(0.8, 0.5)]
    ref = [_log(0.5, 0.5), _log(0.2, 0.5)]
    none = [torch.zeros(2, dtype=torch.bool)] * 2
    ce = [torch.tensor([2.0, 0.0], dtype=F64), torch.tensor([0.0, 1.0], dtype=F64)]
    ref_kl = [torch.tensor([0.0, 1.0], dtype=F64), torch.tensor([1.0, 0.0], dtype=F64)]
    loss, metrics = reference.compute_loss(
        trn, inf, ref, [torch.zeros(2, dtype=F64)] * 2, none, [torch.zeros(2, dtype=F64)] * 2, ce, ref_kl,
        reference.setup_rl_loss_fn(DefaultLossConfig()), rl_scale=1, ce_scale=2, ref_kl_scale=4,
    )  # fmt: skip
    nll = 2.0 * -math.log(0.5) + 1.0 * -math.log(0.5)
    distill = -(math.log(0.5) - math.log(0.25)) - (math.log(0.2) - math.log(0.8))  # −(ref − trn) · r, r = 1
    assert loss.item() == pytest.approx(nll / 2 + distill / 4, rel=1e-12)
    assert metrics["nll"].tolist() == pytest.approx([-math.log(0.5), -math.log(0.5)])
    assert distill == pytest.approx(math.log(2.0))
    assert metrics["ref_kl"].tolist() == pytest.approx([math.log(2.0), math.log(0.25)])


def test_custom_losses_and_missing_streams():
    config = SimpleNamespace(import_path="custom_losses:additive_loss", kwargs={"coef": 2.0})
    fn = reference.setup_rl_loss_fn(config)
    inputs = reference.LossInputs(_log(0.5, 0.4), _log(0.5, 0.5), None, torch.tensor([1.0, 1.0], dtype=F64),
                                  torch.tensor([True, False]))  # fmt: skip
    assert fn(inputs).loss.item() == pytest.approx(-2.0)  # −coef · A · r on the one member
    assert inputs.seq_ids.tolist() == [0, 0] and inputs.cu_seqlens.tolist() == [0, 2]  # one sequence by default
    with pytest.raises(ValueError, match="ref_kl_loss_fn needs ref_logprobs"):
        reference.ref_kl_loss_fn(inputs)
