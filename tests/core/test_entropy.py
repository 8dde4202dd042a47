"""The entropy term (fixed or tensor coefficient) and the adaptive coefficient's update rule."""

from __future__ import annotations

import pytest
import torch

from packloss import AdaptiveEntropy, Component, Entropy, Outputs, Plan, compute_loss
from packloss.testing import OpCounter


def _step(coef, entropy, mask, lens=(3, 4)):
    plan = Plan(list(lens), {"entropy": Component(Entropy(coef), mask)})
    return compute_loss(plan, Outputs(entropy=entropy))


def test_entropy_term_is_minus_coef_times_mean_entropy():
    h = torch.tensor([0.5, 1.0, 2.0, 0.1, float("nan"), 0.7, 1.3], requires_grad=True)
    mask = torch.tensor([1, 1, 0, 1, 0, 1, 1], dtype=torch.bool)  # the NaN sits off the members
    out = _step(0.2, h, mask)
    members = h.detach()[mask]
    assert out.loss.item() == pytest.approx(-0.2 * members.mean().item(), rel=1e-6)
    assert out.metrics["entropy/entropy"].item() == pytest.approx(members.mean().item(), rel=1e-6)
    out.loss.backward()
    assert torch.equal(h.grad, torch.where(mask, -0.2 / mask.sum(), 0.0))


def test_tensor_coefficient_equals_the_number():
    g = torch.Generator().manual_seed(0)
    h = torch.rand(7, generator=g)
    mask = torch.rand(7, generator=g) < 0.7
    assert torch.equal(_step(0.3, h, mask).loss, _step(torch.tensor(0.3), h, mask).loss)


def test_adaptive_coefficient_moves_towards_the_target_on_device():
    control = AdaptiveEntropy(target=1.0, lr=0.5, coef=0.1, max_coef=0.4)
    with OpCounter() as counter:
        control.update(torch.tensor(0.8))  # below target: the bonus grows by 0.5 · 0.2
    assert counter.num_syncs == 0
    assert control.value.item() == pytest.approx(0.2)
    control.update(torch.tensor(0.0))  # far below: clamped at max_coef
    assert control.value.item() == pytest.approx(0.4)
    control.update(torch.tensor(5.0))  # far above: clamped at min_coef
    assert control.value.item() == 0.0
    # the component reads the same tensor: its loss follows the update without being rebuilt
    h, mask = torch.ones(7), torch.ones(7, dtype=torch.bool)
    component = Component(control.entropy, mask)
    control.update(torch.tensor(0.9))
    out = compute_loss(Plan([3, 4], {"entropy": component}), Outputs(entropy=h))
    assert out.loss.item() == pytest.approx(-0.05)


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: Entropy(float("nan")), ValueError, "coef must be finite"),
        (lambda: Entropy("0.1"), TypeError, "coef must be a number"),
        (lambda: Entropy(torch.ones(2)), ValueError, "coef must be a number or a 0-d floating-point tensor"),
        (lambda: Entropy(torch.tensor(1)), ValueError, "0-d floating-point tensor"),
        (lambda: AdaptiveEntropy(target=-1.0), ValueError, "AdaptiveEntropy.target must be >= 0"),
        (lambda: AdaptiveEntropy(target=1.0, lr=0.0), ValueError, "AdaptiveEntropy.lr must be > 0"),
        (lambda: AdaptiveEntropy(target=float("inf")), ValueError, "AdaptiveEntropy.target must be finite"),
        (lambda: AdaptiveEntropy(target=1.0, coef=2.0), ValueError, "min_coef <= coef <= max_coef"),
        (lambda: AdaptiveEntropy(target=1.0).update(0.3), TypeError, "entropy must be a 0-d tensor"),
    ],
)
def test_validation(build, error, match):
    with pytest.raises(error, match=match):
        build()
