"""packloss.core.trust_regions.reinforce: the REINFORCE-style regions (gpg, topr, vespo) against
per-sequence paper references; NaN safety; no syncs."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import (
    drift,
    one_bin,
    region_family_tests,
)
from packloss import PolicyGradient, RolloutCorrection
from packloss.core.trust_regions import GPG, TOPR, VESPO

# name → (objective, ratio base of the paper reference: "inf", "old" or "sg" (on-policy))
OBJECTIVES = {
    "gpg_on_policy": (PolicyGradient("gpg"), "sg"),
    "gpg_rollout": (PolicyGradient(GPG(), ratio="rollout", adv_coef=2.0, penalties=drift(1e-3)), "inf"),
    "topr_rollout": (PolicyGradient("topr", ratio="rollout"), "inf"),
    "topr_old": (PolicyGradient(TOPR(0.1, 0.8), adv_coef=1.5), "old"),
    "topr_distill": (PolicyGradient(TOPR(), ratio="rollout", advantage="ref_kl"), "inf"),
}


def gpg_paper(tr: GPG, trn, denominator, a, adv):
    """Chu et al. 2025: J = A · log π."""
    return a * trn


def topr_paper(tr: TOPR, trn, denominator, a, adv):
    """Le Roux et al. 2025: A ≥ 0: A ∇log π(τ); A < 0: [π(τ)/μ(τ)]_0^1 A ∇log π(τ)."""
    w = (trn - denominator).sum().exp().clamp(tr.low, tr.high).detach()
    return torch.where(a < 0, w, torch.ones_like(w)) * a * trn


PAPERS = {"gpg": gpg_paper, "topr": topr_paper}


def _f64(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)  # torch.where(cond, float, float) would round to float32


def _vespo_reference(seq, region: VESPO):
    """VESPO (arXiv:2602.10693): φ(w) = e^λ · w^k · e^(−λw) of the sequence weight, as TRL clamps it."""
    log_w = (seq.trn - seq.old).detach().clamp(-20, 20).sum()
    c = region.correction
    if c is not None:  # token-level rollout weights folded into w (TRL's vespo)
        rho = torch.exp(seq.old - seq.inf)
        if c.mode == "truncate":
            weight = rho.clamp(min=c.low, max=c.high)
        else:
            weight = torch.where((rho <= c.high) & (rho >= (c.low or 0.0)), rho, 0.0)
        log_w = log_w + torch.log(weight).clamp(math.log(1e-8), 20).sum()
    w = log_w.clamp(math.log(1e-8), 20).exp()
    pos = seq.adv >= 0
    k = torch.where(pos, _f64(region.k_pos), _f64(region.k_neg))
    lam = torch.where(pos, _f64(region.lambda_pos), _f64(region.lambda_neg))
    phi = torch.exp(lam) * w**k * torch.exp(-lam * w)
    return -(phi * seq.adv * seq.trn * seq.w).sum()


# VESPO from the TRL adapter: (region, per-sequence reference), ratios against π_old
VESPO_REGIONS = {
    "vespo": (VESPO(), lambda seq: _vespo_reference(seq, VESPO())),
    "vespo_tis": (VESPO(correction=RolloutCorrection(mode="truncate", high=2.0, low=0.5)),
                  lambda seq: _vespo_reference(seq, VESPO(correction=RolloutCorrection(mode="truncate", high=2.0,
                                                                                      low=0.5)))),
    "vespo_mis": (VESPO(1.5, 2.5, 2.0, 1.0, RolloutCorrection(mode="mask", high=1.5)),
                  lambda seq: _vespo_reference(seq, VESPO(1.5, 2.5, 2.0, 1.0, RolloutCorrection(mode="mask",
                                                                                                high=1.5)))),
}  # fmt: skip
globals().update(region_family_tests(OBJECTIVES, PAPERS, VESPO_REGIONS))


def test_topr_truncates_only_negative_sequences():
    # seq 0: A > 0, π/μ = e^0.6 (no weight); seq 1: A < 0, π/μ = e^0.6 → 1; seq 2: A < 0, π/μ = e^−0.4
    out, grad = one_bin(TOPR(), [0.3, 0.3, 0.3, 0.3, -0.2, -0.2], [2.0, 2.0, -1.0, -1.0, -1.0, -1.0], lens=[2, 2, 2])
    expected = -torch.tensor([2.0, 2.0, -1.0, -1.0, -math.exp(-0.4), -math.exp(-0.4)], dtype=torch.float64)
    assert torch.allclose(grad, expected, rtol=1e-12, atol=0)
    assert out.metrics["rl/truncated_frac_high"].item() == pytest.approx(2 / 6)
    assert out.metrics["rl/truncated_frac_low"].item() == 0
    assert out.metrics["rl/negative_is_weight"].item() == pytest.approx((1 + math.exp(-0.4)) / 2)


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: GPG(0.1), TypeError, "positional argument"),  # GPG has no parameters
        (lambda: TOPR(low=-0.5), ValueError, "TOPR.low must be >= 0"),
        (lambda: TOPR(high=0.0), ValueError, "TOPR.high must be > 0"),
        (lambda: TOPR(low=2.0, high=1.0), ValueError, "TOPR.low must be <= TOPR.high"),
        (lambda: TOPR(high=float("inf")), ValueError, "TOPR.high must be finite"),
        (lambda: VESPO(k_pos=float("nan")), ValueError, "VESPO.k_pos must be finite"),
        (lambda: VESPO(correction=RolloutCorrection(level="sequence")), ValueError, "token-level"),
        (lambda: VESPO(correction=0.5), TypeError, "VESPO.correction must be a RolloutCorrection"),
    ],
)
def test_trust_region_validation(build, error, match):
    with pytest.raises(error, match=match):
        build()
