"""packloss.core.pg: the policy-gradient objective against its formula written out token by token in
plain Python; its arguments' validation; the historical loss types; finite gradients wherever the loss
is finite, for every region, correction and penalty at extreme log-ratios."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import one_sequence
from packloss import (
    DPPO,
    IPO,
    REF_KL,
    TRUST_REGIONS,
    Component,
    GatedCorrection,
    KLPenalty,
    Outputs,
    Plan,
    PolicyGradient,
    RolloutCorrection,
    compute_loss,
)
from packloss.core.trust_regions import ClampedPPOClip, DPPOMask, OneSided, PPOClip, SequenceRatioClip


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


def _extreme_objectives() -> dict[str, PolicyGradient]:
    """Every registered trust region, every correction and every penalty."""
    objectives = {name: PolicyGradient(name) for name in TRUST_REGIONS}
    objectives["ppo_clip_dual"] = PolicyGradient(PPOClip(dual_clip_c=3.0))
    objectives["ppo_clip_clamped_dual"] = PolicyGradient(ClampedPPOClip(dual_clip_c=3.0))
    objectives["sequence_ratio_clip_dual"] = PolicyGradient(SequenceRatioClip(dual_clip_c=3.0))
    for level in ("token", "sequence"):
        for mode, low in (("truncate", None), ("mask", 0.5)):
            correction = RolloutCorrection(level, mode, high=2.0, low=low)
            objectives[f"correction/{level}/{mode}"] = PolicyGradient("ppo_clip", correction=correction)
        for gating in ("binary_kl", "tv"):
            correction = GatedCorrection(level=level, mode="mask", high=1.0, gating=gating)
            objectives[f"gated/{level}/{gating}"] = PolicyGradient("ppo_clip", correction=correction)
    for estimator in ("k1", "k2", "k3", "squared_log_ratio"):
        for against in ("old", "rollout", "ref"):
            penalty = KLPenalty(0.1, estimator, against)
            objectives[f"penalty/{estimator}/{against}"] = PolicyGradient("ppo_clip", penalties=(penalty,))
    return objectives


EXTREME_OBJECTIVES = _extreme_objectives()
_LOG_RATIOS = st.one_of(
    st.sampled_from([0.0, 1e4, -1e4, 100.0, -100.0, 800.0, -800.0, math.inf]),  # inf: old/rollout = −inf
    st.floats(-1e4, 1e4),
)


@st.composite
def _extreme_bins(draw):
    """A packed bin whose member tokens carry log-ratios up to ±1e4 (and −inf old / rollout log-probs)
    against π_old, π_rollout and the reference; advantages per sequence or per token."""
    lens = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    n = sum(lens)
    tokens = st.lists(_LOG_RATIOS, min_size=n, max_size=n)
    trn = draw(st.lists(st.floats(-5.0, -0.01), min_size=n, max_size=n))
    old, rollout, ref = (draw(tokens) for _ in range(3))
    if draw(st.booleans()):
        per_seq = draw(st.lists(st.sampled_from([1.0, -1.0, 0.5, -2.0]), min_size=len(lens), max_size=len(lens)))
        adv = [a for a, k in zip(per_seq, lens, strict=True) for _ in range(k)]
    else:
        adv = draw(st.lists(st.sampled_from([1.0, -1.0, 0.5, 0.0]), min_size=n, max_size=n))
    member = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return tuple(lens), trn, old, rollout, ref, adv, member


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(EXTREME_OBJECTIVES))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_extreme_bins())
def test_gradient_is_finite_wherever_the_loss_is(name, dtype, case):
    lens, trn, old, rollout, ref, adv, member = case
    trn = torch.tensor(trn, dtype=dtype, requires_grad=True)
    streams = {
        key: trn.detach() - torch.tensor(log_ratio, dtype=dtype)
        for key, log_ratio in (("old_logprobs", old), ("rollout_logprobs", rollout), ("ref_logprobs", ref))
    }
    m = torch.tensor(member)
    plan = Plan(lens, {"pg": Component(EXTREME_OBJECTIVES[name], m)}, advantages=torch.tensor(adv, dtype=dtype),
                **streams)  # fmt: skip
    loss = compute_loss(plan, Outputs(logprobs=trn)).loss
    if torch.isfinite(loss):
        (grad,) = torch.autograd.grad(loss, trn)
        assert torch.isfinite(grad).all(), (loss, grad)


def test_a_clipped_overflowing_ratio_has_the_clipped_value_and_no_gradient():
    """PPO clip, A > 0 and log r = 100 (r overflows float32): J = (1 + ε)·A, and the token's gradient
    is exactly 0 (it was 0 · inf = NaN before the ratio was bounded)."""
    trn = torch.tensor([-1.0, -2.0], requires_grad=True)
    summed = Component(PolicyGradient("ppo_clip"), torch.ones(2, dtype=torch.bool), None, "constant", 1.0)
    plan = Plan((2,), {"pg": summed}, old_logprobs=torch.tensor([-101.0, -2.0]), advantages=torch.tensor([1.0, 1.0]))
    loss = compute_loss(plan, Outputs(logprobs=trn)).loss
    (grad,) = torch.autograd.grad(loss, trn)
    assert loss.item() == pytest.approx(-(1.2 + 1.0))
    assert grad.tolist() == [0.0, -1.0]


def test_ratio_cap_is_straight_through():
    """``ratio_cap=C``: each kept token's term takes the value ``min(r, C)·A`` and the gradient of the
    uncapped ``r·A`` (``∂r/∂trn = r``); the metric counts the members whose ratio was capped."""
    trn = torch.tensor([-0.1, -2.0, -0.5, -1.0], dtype=torch.float64, requires_grad=True)
    inf = torch.tensor([-1.5, -2.1, -0.4, -3.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0, 0.7], dtype=torch.float64)
    mask = torch.tensor([True, True, True, False])
    objective = PolicyGradient("none", ratio="rollout", ratio_cap=2.0)
    plan = Plan([2, 2], {"pg": Component(objective, mask, None, "constant", 1.0)}, inf, None, adv)
    out = compute_loss(plan, Outputs(logprobs=trn))
    r = [math.exp(trn[i].item() - inf[i].item()) for i in range(3)]  # e^1.4 ≈ 4.06 > 2, e^0.1, e^−0.1
    assert r[0] > 2.0 > r[1] and r[2] < 2.0
    value = -(2.0 * 1.0 + r[1] * -0.5 + r[2] * 2.0)
    assert out.loss.item() == pytest.approx(value, rel=1e-12)
    (grad,) = torch.autograd.grad(out.loss, trn)
    want = torch.tensor([-r[0] * 1.0, -r[1] * -0.5, -r[2] * 2.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=0)
    assert out.metrics["pg/ratio_capped"].item() == pytest.approx(1 / 3)


def test_ratio_cap_validation():
    with pytest.raises(ValueError, match="PolicyGradient.ratio_cap must be > 0"):
        PolicyGradient(ratio_cap=0.0)
    with pytest.raises(ValueError, match="ratio_cap caps the token ratio r, which trust region GSPO"):
        PolicyGradient("gspo", ratio_cap=10.0)
