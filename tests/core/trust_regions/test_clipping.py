"""packloss.core.trust_regions.clipping: PPO's family (ppo_clip with dual clip, ppo_clip_clamped, cispo,
cispo_cap) and the soft gate sapo against per-sequence paper references; NaN safety; no syncs."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import (
    drift,
    one_bin,
    region_family_tests,
)
from packloss import Component, KLPenalty, Outputs, Plan, PolicyGradient, compute_loss
from packloss.core.trust_regions import CISPO, SAPO, CISPOCap, ClampedPPOClip, PPOClip

# name → (objective, ratio base of the paper reference: "inf", "old" or "sg" (on-policy))
OBJECTIVES = {
    "ppo_clip": (PolicyGradient(PPOClip(0.2, 0.28), ratio="rollout"), "inf"),
    "dual_clip": (PolicyGradient(PPOClip(dual_clip_c=3.0), ratio="rollout", penalties=drift(0.01)), "inf"),
    "cispo": (PolicyGradient(CISPO(0.9, 0.25), ratio="rollout"), "inf"),
    "grpo_ref_kl": (PolicyGradient(PPOClip(), ratio="rollout", penalties=(KLPenalty(0.04),)), "inf"),
    "opd_cispo": (PolicyGradient(CISPO(), ratio="rollout", advantage="ref_kl", penalties=drift(1e-3)), "inf"),
    # three streams: the trust region against π_old, on-policy without the stream
    "ppo_old": (PolicyGradient(PPOClip(0.2, 0.28), penalties=(KLPenalty(0.04),)), "old"),
    "ppo_on_policy": (PolicyGradient(PPOClip(0.2, 0.28)), "sg"),
    "cispo_on_policy": (PolicyGradient(CISPO(0.9, 0.25)), "sg"),
    # verl 0.9.1's sapo
    "sapo_old": (PolicyGradient(SAPO()), "old"),
    "sapo_rollout": (PolicyGradient(SAPO(2.0, 4.0), ratio="rollout", adv_coef=0.5), "inf"),
    "sapo_on_policy": (PolicyGradient("sapo", penalties=(KLPenalty(0.04),)), "sg"),
    # OpenRLHF's "ppo": PPO's clip on the clamped ratio
    "ppo_clip_clamped_rollout": (
        PolicyGradient(ClampedPPOClip(0.2, 0.28, dual_clip_c=1.3), ratio="rollout", penalties=drift(1e-3)),
        "inf",
    ),
    "ppo_clip_clamped_old": (PolicyGradient(ClampedPPOClip(0.1, 0.1), penalties=(KLPenalty(0.04),)), "old"),
}


def ppo_clip_paper(tr: PPOClip, trn, denominator, a, adv, log_ratio=None):
    """Schulman et al. 2017; dual clip: Ye et al. 2020."""
    ratio = (trn - denominator if log_ratio is None else log_ratio).exp()
    objective = torch.min(ratio * a, ratio.clamp(1 - tr.clip_low, 1 + tr.clip_high) * a)
    if tr.dual_clip_c is not None:
        objective = torch.where(a < 0, torch.max(objective, tr.dual_clip_c * a), objective)
    return objective


def ppo_clip_clamped_paper(tr: ClampedPPOClip, trn, denominator, a, adv):
    """OpenRLHF's "ppo": PPO's clip (with dual clip) on r = exp(clamp(log r, −20, 20))."""
    return ppo_clip_paper(tr, trn, denominator, a, adv, log_ratio=(trn - denominator).clamp(-20, 20))


def cispo_paper(tr: CISPO, trn, denominator, a, adv):
    """MiniMax-M1: REINFORCE with a detached, clipped IS weight."""
    return (trn - denominator).exp().clamp(1 - tr.clip_low, 1 + tr.clip_high).detach() * a * trn


def sapo_paper(tr: SAPO, trn, denominator, a, adv):
    """Gao et al. 2025: J_t = f(r_t) A_t, f(x) = σ(τ(x − 1)) · 4/τ, τ by the sign of A_t."""
    ratio = (trn - denominator).exp()
    tau = torch.where(a > 0, torch.tensor(tr.tau_pos, dtype=trn.dtype), torch.tensor(tr.tau_neg, dtype=trn.dtype))
    return torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a


PAPERS = {"ppo_clip": ppo_clip_paper, "ppo_clip_clamped": ppo_clip_clamped_paper, "cispo": cispo_paper,
          "sapo": sapo_paper}  # fmt: skip

# the regions that came from the TRL adapter: (region, per-sequence reference), ratios against π_old
CAP_REGIONS = {
    "cispo_cap": (CISPOCap(1.3), lambda seq: -(torch.exp(seq.trn - seq.old).clamp(max=1.3).detach() * seq.adv
                                                * seq.trn * seq.w).sum()),
}  # fmt: skip
globals().update(region_family_tests(OBJECTIVES, PAPERS, CAP_REGIONS))


def test_clip_metrics_count_what_they_claim():
    r = torch.tensor([0.5, 0.9, 1.5, 1.1, 5.0, 0.7])
    a = torch.tensor([-1.0, -1.0, 1.0, 1.0, -1.0, 1.0])
    trn = torch.zeros(6, requires_grad=True)
    params = PolicyGradient(PPOClip(0.2, 0.28, dual_clip_c=3.0), ratio="rollout")
    plan = Plan([6], {"rl": Component(params, mask=torch.ones(6, dtype=torch.bool))}, -r.log(), advantages=a)
    out = compute_loss(plan, Outputs(logprobs=trn))
    assert out.metrics["rl/clip_frac_low"].item() == pytest.approx(1 / 6)  # r=0.5, A<0
    assert out.metrics["rl/clip_frac_high"].item() == pytest.approx(1 / 6)  # r=1.5, A>0
    assert out.metrics["rl/dual_clip_frac"].item() == pytest.approx(1 / 6)  # r=5, A<0
    assert out.metrics["rl/is_masked"].item() == pytest.approx(3 / 6)
    out.loss.backward()
    assert torch.equal(trn.grad[[0, 2, 4]], torch.zeros(3))  # clipped tokens carry no gradient
    assert (trn.grad[[1, 3, 5]] != 0).all()


def test_sapo_clamps_the_log_ratio_like_verl():
    """verl computes r = exp(clamp(log r, −20, 20)): finite at log r = ±25, no gradient through the clamp."""
    out, grad = one_bin(SAPO(), [25.0, -25.0, 0.0], [1.0, -1.0, 1.0])
    r = torch.tensor([20.0, -20.0, 0.0], dtype=torch.float64).exp()
    tau = torch.tensor([1.0, 1.05, 1.0], dtype=torch.float64)
    a = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    assert torch.isclose(out.loss, -(torch.sigmoid(tau * (r - 1)) * 4 / tau * a).sum(), rtol=1e-12)
    assert torch.equal(grad[:2], torch.zeros(2, dtype=torch.float64)) and grad[2] == -1.0  # ∇ at r = 1: −A


def test_ppo_clip_clamped_is_ppo_clip_inside_the_clamp_and_flat_past_it():
    """OpenRLHF's ``"ppo"``: r = e^20 (A < 0) meets the dual clip −c; r = e^−20 (A > 0) keeps its value
    e^−20 with no gradient, where PPOClip's e^−25 still has one; inside the clamp both are PPO's clip."""
    log_r, adv = [25.0, -25.0, 0.5, 0.1], [-1.0, 1.0, 1.0, -1.0]
    out, grad = one_bin(ClampedPPOClip(0.2, 0.2, dual_clip_c=3.0), log_r, adv)
    # J = [max(min(−e^20, −1.2), −3), min(e^−20, 0.8), min(e^0.5, 1.2), max(−e^0.1, −3)]
    expected = -(-3.0 + math.exp(-20.0) + 1.2 - math.exp(0.1))
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    assert torch.equal(grad[:3], torch.zeros(3, dtype=torch.float64)) and grad[3].item() == pytest.approx(math.exp(0.1))
    assert out.metrics["rl/clip_frac_high"].item() == pytest.approx(1 / 4)  # e^0.5 > 1.2 with A > 0
    assert out.metrics["rl/clip_frac_low"].item() == 0
    assert out.metrics["rl/dual_clip_frac"].item() == pytest.approx(1 / 4)  # e^20 > 3 with A < 0
    assert out.metrics["rl/is_masked"].item() == pytest.approx(2 / 4)
    assert out.metrics["rl/clip_ratio"].item() == pytest.approx(1 / 4)  # clip(r)·A < r·A: only e^0.5
    plain, plain_grad = one_bin(PPOClip(0.2, 0.2, dual_clip_c=3.0), log_r, adv)
    assert plain.loss.item() == pytest.approx(-(-3.0 + math.exp(-25.0) + 1.2 - math.exp(0.1)), rel=1e-12)
    assert plain_grad[1].item() == pytest.approx(-math.exp(-25.0), rel=1e-9)  # the unclamped ratio moves
    assert torch.equal(plain_grad[[0, 2, 3]], grad[[0, 2, 3]])


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: PPOClip(clip_low=1.0), ValueError, "PPOClip.clip_low must be in"),
        (lambda: PPOClip(clip_high=-0.1), ValueError, "PPOClip.clip_high must be >= 0"),
        (lambda: PPOClip(dual_clip_c=1.0), ValueError, "dual_clip_c must be > 1"),
        (lambda: PPOClip(dual_clip_c=float("nan")), ValueError, "dual_clip_c must be finite"),
        (lambda: PPOClip(clip_high=float("nan")), ValueError, "clip_high must be finite"),
        (lambda: PPOClip(clip_low=True), TypeError, "clip_low must be a number"),
        (lambda: ClampedPPOClip(dual_clip_c=0.5), ValueError, "ClampedPPOClip.dual_clip_c must be > 1"),
        (lambda: CISPO(clip_low=-0.5), ValueError, "CISPO.clip_low must be in"),
        (lambda: SAPO(tau_pos=0.0), ValueError, "SAPO.tau_pos must be > 0"),
        (lambda: SAPO(tau_neg=-1.0), ValueError, "SAPO.tau_neg must be > 0"),
        (lambda: SAPO(tau_neg=float("inf")), ValueError, "SAPO.tau_neg must be finite"),
        (lambda: SAPO(tau_pos="1"), TypeError, "SAPO.tau_pos must be a number"),
        (lambda: CISPOCap(0.0), ValueError, "CISPOCap.cap must be > 0"),
        (lambda: CISPOCap(float("inf")), ValueError, "CISPOCap.cap must be finite"),
    ],
)
def test_trust_region_validation(build, error, match):
    with pytest.raises(error, match=match):
        build()
