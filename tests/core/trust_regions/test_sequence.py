"""packloss.core.trust_regions.sequence: the regions on a sequence's ratio (gspo, sequence_level,
sequence_ratio_clip, geo_mean) against per-sequence paper references; NaN safety; no syncs."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import (
    drift,
    one_bin,
    region_family_tests,
)
from packloss import TRUST_REGIONS, Component, KLPenalty, Outputs, Plan, PolicyGradient, compute_loss
from packloss.core.trust_regions import GMPO, GSPO, CISPOCap, PPOClip, SequenceLevel, SequenceRatioClip

# name → (objective, ratio base of the paper reference: "inf", "old" or "sg" (on-policy))
OBJECTIVES = {
    "gspo": (PolicyGradient(GSPO(3e-4, 4e-4), ratio="rollout"), "inf"),
    "gspo_wide": (PolicyGradient(GSPO(0.2, 0.2), ratio="rollout", penalties=drift(1e-3)), "inf"),
    "gspo_old": (PolicyGradient(GSPO(0.2, 0.2)), "old"),
    "geo_mean_old": (PolicyGradient(GMPO()), "old"),
    "geo_mean_rollout": (PolicyGradient(GMPO(0.1, 0.3, eps=0.0), ratio="rollout", penalties=drift(1e-3)), "inf"),
    "geo_mean_distill": (PolicyGradient(GMPO(0.4, 0.4), ratio="rollout", advantage="ref_kl"), "inf"),
    # OpenRLHF's "gspo": PPO's clip on the sequence ratio with its full gradient
    "sequence_ratio_clip_rollout": (PolicyGradient(SequenceRatioClip(0.2, 0.28), ratio="rollout"), "inf"),
    "sequence_ratio_clip_dual_old": (
        PolicyGradient(SequenceRatioClip(0.1, 0.1, dual_clip_c=1.1), penalties=(KLPenalty(0.04),)),
        "old",
    ),
    "sequence_ratio_clip_on_policy": (PolicyGradient("sequence_ratio_clip", adv_coef=1.5), "sg"),
}


def gspo_paper(tr: GSPO, trn, denominator, a, adv):
    """Zheng et al. 2025, GSPO-token."""
    s = (trn - denominator).mean().exp()
    s_token = s.detach() * (trn - trn.detach()).exp()
    return torch.min(s_token * a, s_token.clamp(1 - tr.clip_low, 1 + tr.clip_high) * a)


def sequence_ratio_clip_paper(tr: SequenceRatioClip, trn, denominator, a, adv):
    """OpenRLHF's "gspo": PPO's clip (with dual clip) on s_i = exp(mean log r), differentiable."""
    s = (trn - denominator).mean().exp().expand_as(trn)
    objective = torch.min(s * a, s.clamp(1 - tr.clip_low, 1 + tr.clip_high) * a)
    if tr.dual_clip_c is not None:
        objective = torch.where(a < 0, torch.max(objective, tr.dual_clip_c * a), objective)
    return objective


def gmpo_paper(tr: GMPO, trn, denominator, a, adv):
    """Zhao et al. 2025: Â · (Π_t r̃_t)^{1/|o|}, r̃_t the ratio clipped in log space to the pessimistic
    side of sgn(A_t); every token of the sequence carries the sequence's value."""
    log_ratio = trn - denominator
    sign = torch.sign(a)
    clipped = torch.min(sign * log_ratio, sign * log_ratio.clamp(-tr.clip_low, tr.clip_high)) * sign
    n = len(trn)
    return torch.ones_like(trn) * a.sum() / n * (clipped.sum() / n).exp()


PAPERS = {"gspo": gspo_paper, "sequence_ratio_clip": sequence_ratio_clip_paper, "geo_mean": gmpo_paper}


def _f64(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)  # torch.where(cond, float, float) would round to float32


def _sequence_reference(seq, inner):
    """GSPO's sequence-level objective: the inner region on s = exp(mean log r), differentiable."""
    s = torch.exp((seq.trn - seq.old).mean()).expand_as(seq.trn)
    if isinstance(inner, PPOClip):
        objective = torch.min(s * seq.adv, s.clamp(1 - inner.clip_low, 1 + inner.clip_high) * seq.adv)
        if inner.dual_clip_c is not None:
            objective = torch.where(seq.adv < 0, torch.max(objective, inner.dual_clip_c * seq.adv), objective)
    elif isinstance(inner, CISPOCap):
        objective = s.clamp(max=inner.cap).detach() * seq.adv * seq.trn
    else:  # SAPO: (4/τ) σ(τ (s − 1)) A
        tau = torch.where(seq.adv > 0, _f64(inner.tau_pos), _f64(inner.tau_neg))
        objective = 4 / tau * torch.sigmoid(tau * (s - 1)) * seq.adv
    return -(objective * seq.w).sum()


def _sapo_regions():
    return [TRUST_REGIONS["sapo"](1.0, 1.05)]


# the sequence-level region from the TRL adapter: (region, per-sequence reference), ratios against π_old
SEQUENCE_REGIONS = {
    "sequence_ppo": (SequenceLevel(PPOClip(0.2, 0.28)), lambda seq: _sequence_reference(seq, PPOClip(0.2, 0.28))),
    "sequence_dual": (SequenceLevel(PPOClip(0.2, 0.28, 1.4)),
                      lambda seq: _sequence_reference(seq, PPOClip(0.2, 0.28, 1.4))),
    "sequence_cispo": (SequenceLevel(CISPOCap(1.1)), lambda seq: _sequence_reference(seq, CISPOCap(1.1))),
    **{f"sequence_{r.name}": (SequenceLevel(r), lambda seq, r=r: _sequence_reference(seq, r)) for r in _sapo_regions()},
}  # fmt: skip
globals().update(region_family_tests(OBJECTIVES, PAPERS, SEQUENCE_REGIONS))


def test_gspo_sequence_ratio_metrics():
    lens = [3, 2, 4]
    log_r = torch.tensor([0.1, 0.2, 0.3, -0.4, -0.2, 0.0, 0.0, 0.0, 0.0])
    mask = torch.tensor([1, 1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.bool)  # third sequence has no members
    plan = Plan(lens, {"rl": Component(PolicyGradient(GSPO(), ratio="rollout"), mask)}, torch.full((9,), -1.0),
                advantages=torch.ones(9))  # fmt: skip
    outputs = Outputs(logprobs=log_r - 1)
    out = compute_loss(plan, outputs)
    s = torch.tensor([0.2, -0.3]).exp()
    assert out.metrics["rl/seq_ratio_mean"].item() == pytest.approx(s.mean().item(), rel=1e-6)
    assert out.metrics["rl/seq_ratio_min"].item() == pytest.approx(s.min().item(), rel=1e-6)
    assert out.metrics["rl/seq_ratio_max"].item() == pytest.approx(s.max().item(), rel=1e-6)
    assert out.counts["rl/seq_ratio_mean"].item() == 2
    per_seq = compute_loss(plan, outputs, per_sequence_metrics=True)
    assert torch.allclose(per_seq.metrics["rl/seq_ratio_mean"][:2], s)


def test_gmpo_clips_on_the_pessimistic_side_and_reports_verl_fractions():
    # seq 0 (A > 0): log r 0.5 clipped to 0.2, −0.5 kept; seq 1 (A < 0): −0.5 clipped to −0.2, 0.5 kept
    out, grad = one_bin(GMPO(), [0.5, -0.5, -0.5, 0.5], [1.0, 1.0, -1.0, -1.0], lens=[2, 2])
    rho = torch.tensor([(0.2 - 0.5) / 2, (-0.2 + 0.5) / 2], dtype=torch.float64).exp()
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64) * 2 / (2 + 1e-8)
    assert torch.isclose(out.loss, -(2 * adv * rho).sum(), rtol=1e-12)
    assert grad[0] == 0 and grad[2] == 0 and grad[1] != 0 and grad[3] != 0  # clipped tokens carry no gradient
    assert out.metrics["rl/clip_frac_high"].item() == pytest.approx(0.5)  # both A > 0 tokens are outside
    assert out.metrics["rl/clip_frac_low"].item() == pytest.approx(0.5)
    assert out.metrics["rl/is_masked"].item() == pytest.approx(0.5)
    assert out.metrics["rl/seq_ratio_max"].item() == pytest.approx(rho.max().item())


def test_sequence_ratio_clip_moves_every_member_of_its_sequence():
    """s_i = exp(mean log r) with its full gradient: each token's term moves all members by s_i / n_i
    (GSPO-token moves only its own token); a clipped sequence has no gradient."""
    log_r, adv = [0.1, 0.3, 0.5, 0.5], [1.0, 3.0, 1.0, 1.0]
    out, grad = one_bin(SequenceRatioClip(0.2, 0.28), log_r, adv, lens=[2, 2])
    s0, s1 = math.exp(0.2), math.exp(0.5)  # s1 > 1.28: clipped
    assert out.loss.item() == pytest.approx(-(4 * s0 + 2 * 1.28), rel=1e-12)
    want = torch.tensor([-2 * s0, -2 * s0, 0.0, 0.0], dtype=torch.float64)  # ∂(−s0 · (1 + 3))/∂trn_u = −4 s0 / 2
    assert torch.allclose(grad, want, rtol=1e-12, atol=0)
    assert out.metrics["rl/clip_ratio"].item() == pytest.approx(0.5)  # clip(s)·A < s·A on sequence 1
    assert out.metrics["rl/clip_frac_high"].item() == pytest.approx(0.5)
    assert out.metrics["rl/seq_ratio_min"].item() == pytest.approx(s0)
    assert out.metrics["rl/seq_ratio_max"].item() == pytest.approx(s1)
    _, token_grad = one_bin(GSPO(0.2, 0.28), log_r, adv, lens=[2, 2])
    assert torch.allclose(token_grad, torch.tensor([-s0, -3 * s0, 0.0, 0.0], dtype=torch.float64), rtol=1e-12)


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: GSPO(clip_high=float("nan")), ValueError, "GSPO.clip_high must be finite"),
        (lambda: GMPO(clip_low=-0.1), ValueError, "GMPO.clip_low must be >= 0"),
        (lambda: GMPO(clip_high=float("nan")), ValueError, "GMPO.clip_high must be finite"),
        (lambda: GMPO(eps=-1e-8), ValueError, "GMPO.eps must be >= 0"),
        (lambda: GMPO(eps=None), TypeError, "GMPO.eps must be a number"),
        (lambda: SequenceLevel(SequenceLevel()), TypeError, "token-level TrustRegion"),
        (lambda: SequenceLevel("ppo_clip"), TypeError, "SequenceLevel.inner must be a token-level TrustRegion"),
        (lambda: SequenceRatioClip(clip_low=1.5), ValueError, "SequenceRatioClip.clip_low must be in"),
    ],
)
def test_trust_region_validation(build, error, match):
    with pytest.raises(error, match=match):
        build()
