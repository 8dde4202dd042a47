"""packloss.core.pg: the policy-gradient objective against its formula written out token by token in
plain Python; its arguments' validation; the historical loss types."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import one_sequence
from packloss import DPPO, IPO, REF_KL, KLPenalty, PolicyGradient
from packloss.core.trust_regions import DPPOMask, OneSided


def token_loss(trn, inf, ref, adv, member, w, p: PolicyGradient) -> float:
    """One token of a prime-rl-shaped objective (ratio vs rollout, squared-log-ratio drift) in scalar
    Python (float64)."""
    if not member:
        return 0.0
    log_r = trn - inf
    a = (ref - trn) if p.advantage == "ref_kl" else adv
    dp = math.exp(trn) - math.exp(inf)
    region = p.trust_region
    if region.name == "dppo":
        masked = dp > region.high if a > 0 else dp < -region.low
    elif region.name == "ipo":
        masked = abs(dp) > region.threshold
    else:
        masked = dp < -region.threshold
    pg = 0.0 if masked else p.adv_coef * a * math.exp(log_r)
    kl_tau = sum(k.coef for k in p.penalties)
    return (-pg + kl_tau * log_r**2) * w


PARAMS = {
    "dppo": DPPO,
    "ipo": IPO,
    "ref_kl": REF_KL,
    "dppo_custom": PolicyGradient(
        DPPOMask(0.05, 0.3), ratio="rollout", adv_coef=0.7, penalties=(KLPenalty(0.1, "squared_log_ratio", "rollout"),)
    ),
    "one_sided_shipped": PolicyGradient(
        OneSided(0.1), ratio="rollout", penalties=KLPenalty(1e-3, "squared_log_ratio", "rollout")
    ),
}


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("weighted", [False, True])
def test_pg_loss_matches_scalar_formula(name, weighted):
    params = PARAMS[name]
    g = torch.Generator().manual_seed(7)
    n = 64
    p_inf = torch.rand(n, generator=g, dtype=torch.float64) * 0.9 + 0.05
    trn = (p_inf + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 0.8).clamp(1e-3, 1).log()
    inf = p_inf.log()
    ref = (torch.rand(n, generator=g, dtype=torch.float64) * 0.9 + 0.05).log()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[::7] = 0.0  # A == 0 takes DPPO's low branch
    mask = torch.rand(n, generator=g) < 0.8
    w = torch.rand(n, generator=g, dtype=torch.float64) * 2 if weighted else None
    trn = trn.requires_grad_()
    out = one_sequence(params, trn, inf, ref, adv, mask, w)
    expected = sum(
        token_loss(
            trn[i].item(),
            inf[i].item(),
            ref[i].item(),
            adv[i].item(),
            bool(mask[i]),
            1.0 if w is None else w[i].item(),
            params,
        )
        for i in range(n)
    )
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.metrics["rl/is_masked"].item() > 0  # the region fires in this data


def test_ref_kl_advantage_is_detached():
    """∂loss/∂trn for ref_kl flows only through the ratio: −keep·(ref−trn)·r + 2·kl_tau·log_r."""
    trn = torch.tensor([-1.0, -0.5], requires_grad=True)
    inf = torch.tensor([-1.1, -0.5])
    ref = torch.tensor([-0.8, -0.2])
    mask = torch.tensor([True, True])
    out = one_sequence(REF_KL, trn, inf, ref, None, mask)
    out.loss.backward()
    log_r = (trn - inf).detach()
    expected = -(ref - trn.detach()) * log_r.exp() + 2 * 1e-3 * log_r
    assert torch.allclose(trn.grad, expected, atol=1e-6)


def test_metrics_definitions():
    trn = torch.tensor([-0.1, -3.0, -0.2, -2.0])
    inf = torch.tensor([-2.0, -0.1, -0.2, -2.0])
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    mask = torch.tensor([True, True, True, False])
    out = one_sequence(DPPO, trn, inf, None, adv, mask)
    # token 0: A>0, dp = e^-0.1 - e^-2 > 0.2 → masked high; token 1: A<0, dp < -0.2 → masked low
    assert out.metrics["rl/is_masked"].item() == pytest.approx(2 / 3)
    assert out.metrics["rl/is_masked_high"].item() == pytest.approx(1 / 3)
    assert out.metrics["rl/is_masked_low"].item() == pytest.approx(1 / 3)
    assert out.metrics["rl/masked_advantage_positive"].item() == pytest.approx(0.5)
    assert out.counts["rl/is_masked"].item() == 3
    assert out.counts["rl/masked_mismatch_kl"].item() == 2
    assert out.metrics["rl/unmasked_mismatch_kl"].item() == pytest.approx(0.0)


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: PolicyGradient(advantage="gae"), ValueError, "advantage must be one of"),
        (lambda: PolicyGradient(trust_region="box"), ValueError, "trust_region must be a TrustRegion or one of"),
        (lambda: PolicyGradient(ratio="proximal"), ValueError, "ratio must be one of"),
        (lambda: PolicyGradient(adv_coef=float("nan")), ValueError, "adv_coef must be finite"),
        (lambda: PolicyGradient(penalties=(0.1,)), TypeError, "penalties must hold KLPenalty"),
        (lambda: PolicyGradient(correction="tis"), TypeError, "correction must be a RolloutCorrection"),
    ],
)
def test_params_validation(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_instances_are_the_historical_loss_types():
    drift = (KLPenalty(1e-3, "squared_log_ratio", "rollout"),)
    assert DPPO == PolicyGradient(DPPOMask(0.2, 0.2), ratio="rollout", penalties=drift)
    assert IPO.trust_region.name == "ipo" and IPO.trust_region.threshold == 0.1 and IPO.penalties == drift
    assert (REF_KL.advantage, REF_KL.trust_region, REF_KL.penalties, REF_KL.adv_coef) == (
        "ref_kl",
        OneSided(0.2),
        drift,
        1.0,
    )
    with pytest.raises(ValueError, match="needs the plan's ref_logprobs"):
        one_sequence(REF_KL, torch.zeros(2), torch.zeros(2), None, None, torch.ones(2, dtype=torch.bool))
