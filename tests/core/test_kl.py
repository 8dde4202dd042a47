"""packloss.core.kl: the estimators K(x), KLPenalty (its streams and metric) and RatioWeightedKL against a
per-sequence reference; NaN safety; no syncs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from conftest import bin_of, check_against_paper, module_part_tests, one_sequence, packings
from packloss import Component, KLPenalty, Outputs, Plan, PolicyGradient, compute_loss
from packloss.core.kl import KL_ESTIMATORS, RatioWeightedKL, kl_estimate
from packloss.core.trust_regions import SequenceLevel


def _kl_reference(seq, coef: float, level: str):
    log_r = seq.trn - seq.old
    rho = torch.exp(log_r.mean() if level == "sequence" else log_r)
    x = seq.ref - seq.trn
    return (coef * rho * (x.exp() - x - 1) * seq.w).sum()


# the ratio-weighted KL as a module's KL part, at the sequence level
MODULE_OBJECTIVES = {"kl_sequence": (PolicyGradient(SequenceLevel()), RatioWeightedKL(0.04, "sequence"))}


@pytest.mark.parametrize("level", ["token", "sequence"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=packings())
def test_ratio_weighted_kl_matches_reference(level, case):
    check_against_paper(RatioWeightedKL(0.3, level), lambda seq: _kl_reference(seq, 0.3, level), case,
                        with_old=True, rtol=1e-9)  # fmt: skip


globals().update(module_part_tests(MODULE_OBJECTIVES))


def test_ratio_weighted_kl_metrics_by_hand():
    """ρ = exp(trn − old) per token, x = ref − trn: the loss is coef · Σ ρ k3 (summed), the metrics are
    the member means of k3 (``ref_kl_penalty``) and of ρ · k3 (``ratio_weighted_kl``)."""
    trn = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.1, -2.0, -9.0], dtype=torch.float64)
    ref = torch.tensor([-0.5, -2.5, 0.0], dtype=torch.float64)
    mask = torch.tensor([True, True, False])
    component = Component(RatioWeightedKL(0.5), mask, None, "constant", 1.0)
    plan = Plan([3], {"kl": component}, ref_logprobs=ref, old_logprobs=old)
    out = compute_loss(plan, Outputs(logprobs=trn))
    k3 = [math.exp(0.5) - 1.5, math.exp(-0.5) - 0.5]  # e^x − x − 1 at x = 0.5, −0.5
    rho = [math.exp(0.1), 1.0]
    assert out.loss.item() == pytest.approx(0.5 * (rho[0] * k3[0] + rho[1] * k3[1]), rel=1e-12)
    assert out.metrics["kl/ref_kl_penalty"].item() == pytest.approx((k3[0] + k3[1]) / 2, rel=1e-12)
    assert out.metrics["kl/ratio_weighted_kl"].item() == pytest.approx((rho[0] * k3[0] + rho[1] * k3[1]) / 2)
    (grad,) = torch.autograd.grad(out.loss, trn)
    # ∂/∂trn [ρ (e^x − x − 1)] = ρ (e^x − x − 1) + ρ (1 − e^x)  (∂ρ/∂trn = ρ, ∂x/∂trn = −1)
    x = [0.5, -0.5]
    want = [0.5 * rho[i] * (k3[i] + 1 - math.exp(x[i])) for i in range(2)] + [0.0]
    assert torch.allclose(grad, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("squared_log_ratio", [1.0, 0.0, 0.25]),
        ("k1", [1.0, 0.0, -0.5]),
        ("k2", [0.5, 0.0, 0.125]),
        ("k3", [math.exp(-1.0), 0.0, math.exp(0.5) - 1.5]),
    ],
)
def test_kl_estimates_equal_their_formulas(kind, expected):
    x = torch.tensor([-1.0, 0.0, 0.5], dtype=torch.float64, requires_grad=True)
    k = kl_estimate(kind, x)
    assert torch.allclose(k, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    (grad,) = torch.autograd.grad(k.sum(), x)  # differentiable: K'(x) = 2x, −1, x, eˣ − 1
    derivative = {"squared_log_ratio": 2 * x, "k1": -torch.ones(3), "k2": x, "k3": x.exp() - 1}[kind]
    assert torch.allclose(grad, derivative.detach().to(torch.float64), rtol=1e-12, atol=0)
    assert kind in KL_ESTIMATORS


def test_kl_penalty_metric_is_the_mean_estimate_over_the_members():
    trn = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64, requires_grad=True)
    inf = torch.tensor([-1.5, -1.0, -0.5, 0.0], dtype=torch.float64)
    mask = torch.tensor([True, True, True, False])
    penalty = KLPenalty(0.1, "k1", "rollout")
    assert penalty.metric == "rollout_kl_penalty" and KLPenalty(0.1).metric == "ref_kl_penalty"
    out = one_sequence(PolicyGradient("none", ratio="rollout", penalties=(penalty,)), trn, inf, None,
                       torch.zeros(4, dtype=torch.float64), mask)  # fmt: skip
    # k1 = −(trn − inf) = [−0.5, 1.0, 0.0] on the members; the advantages are 0: the loss is 0.1 · Σ k1
    assert out.metrics["rl/rollout_kl_penalty"].item() == pytest.approx(0.5 / 3, rel=1e-12)
    assert out.loss.item() == pytest.approx(0.1 * 0.5, rel=1e-12)


def test_penalty_streams_are_required():
    streams = bin_of("hot")
    with pytest.raises(ValueError, match="'rl' needs the plan's ref_logprobs"):
        streams.plan(PolicyGradient(penalties=(KLPenalty(0.1),)))
    with pytest.raises(ValueError, match="'rl' needs the plan's old_logprobs"):
        streams.plan(PolicyGradient(penalties=(KLPenalty(0.1, against="old"),)))


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: KLPenalty(-1e-3), ValueError, "KLPenalty.coef must be >= 0"),
        (lambda: KLPenalty(0.1, estimator="k4"), ValueError, "KLPenalty.estimator must be one of"),
        (lambda: KLPenalty(0.1, against="teacher"), ValueError, "KLPenalty.against must be one of"),
        (lambda: RatioWeightedKL(-1.0), ValueError, "RatioWeightedKL.coef must be >= 0"),
        (lambda: RatioWeightedKL(0.1, "row"), ValueError, "RatioWeightedKL.level"),
    ],
)
def test_kl_validation(build, error, match):
    with pytest.raises(error, match=match):
        build()


@pytest.mark.parametrize("kind", ["k1+", "k3+"])
def test_straight_through_estimators_have_one_value_and_k2s_gradient(kind):
    """``k1+`` / ``k3+``: the value of k1 / k3, the gradient of k2 (``x``), at every ``x``."""
    x = torch.tensor([-3.0, -0.5, 0.0, 0.7, 4.0], dtype=torch.float64, requires_grad=True)
    value = kl_estimate(kind, x)
    torch.testing.assert_close(value, kl_estimate(kind[:-1], x.detach()), rtol=0, atol=0)
    (grad,) = torch.autograd.grad(value.sum(), x)
    torch.testing.assert_close(grad, x.detach(), rtol=0, atol=1e-15)
