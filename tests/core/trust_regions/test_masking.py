"""packloss.core.trust_regions.masking: the regions that drop tokens (dppo, ipo, one_sided, none, icepop,
icepop_log, dppo_tv, dppo_kl) against per-sequence paper references; NaN safety; no syncs."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import (
    drift,
    one_bin,
    region_family_tests,
)
from packloss import REF_KL, KLPenalty, PolicyGradient
from packloss.core.trust_regions import DPPOKL, DPPOTV, DPPOMask, IcePop, IcePopLogBand, IPOMask, OneSided

# name → (objective, ratio base of the paper reference: "inf", "old" or "sg" (on-policy))
OBJECTIVES = {
    "none": (PolicyGradient("none", ratio="rollout", penalties=drift(1e-3)), "inf"),
    "icepop": (PolicyGradient(IcePop(0.7, 1.5), ratio="rollout", penalties=drift(1e-3)), "inf"),
    "k1": (PolicyGradient("none", ratio="rollout", penalties=drift(0.1, "k1")), "inf"),
    "k2": (PolicyGradient(DPPOMask(), ratio="rollout", penalties=drift(0.1, "k2")), "inf"),
    "k3": (PolicyGradient(IPOMask(), ratio="rollout", penalties=drift(0.1, "k3")), "inf"),
    "ref_kl_k2": (PolicyGradient("none", ratio="rollout", penalties=(KLPenalty(0.1, "k2"), *drift(1e-3))), "inf"),
    "ref_kl": (REF_KL, "inf"),
    "one_sided_old": (PolicyGradient(OneSided(0.1)), "old"),
    "dppo_old_drift_old": (PolicyGradient(DPPOMask(), penalties=(KLPenalty(0.1, "k3", "old"),)), "old"),
    "dppo_tv_old": (PolicyGradient(DPPOTV()), "old"),
    "dppo_tv_rollout": (PolicyGradient(DPPOTV(0.1, 0.15, ratio_cap=1.2), ratio="rollout"), "inf"),
    "dppo_kl_old": (PolicyGradient(DPPOKL(0.02, 0.05)), "old"),
    "dppo_kl_rollout": (PolicyGradient(DPPOKL(ratio_cap=1.3), ratio="rollout", adv_coef=0.7), "inf"),
    # prime-rl's IcePop band (#3526): both bounds inside the drawn ratios, so both drop tokens
    "icepop_log_rollout": (PolicyGradient(IcePopLogBand(0.8, 1.25), ratio="rollout", penalties=drift(1e-3)), "inf"),
    "icepop_log_old": (PolicyGradient(IcePopLogBand(0.7, 1.3), adv_coef=0.5), "old"),
    "icepop_log_on_policy": (PolicyGradient("icepop_log"), "sg"),
}


def none_paper(tr: object, trn, denominator, a, adv):
    """The plain importance-weighted policy gradient: J = r · A."""
    return (trn - denominator).exp() * a


def icepop_paper(tr: IcePop, trn, denominator, a, adv):
    """Drop tokens whose ratio leaves [low, high]."""
    ratio = (trn - denominator).exp()
    return ((ratio >= tr.low) & (ratio <= tr.high)) * ratio * a


def icepop_log_paper(tr: IcePopLogBand, trn, denominator, a, adv):
    """prime-rl's band: keep tokens with log(ratio_low) ≤ log r ≤ log(ratio_high); J = keep · A · r."""
    log_ratio = trn - denominator
    keep = (log_ratio >= math.log(tr.ratio_low)) & (log_ratio <= math.log(tr.ratio_high))
    return keep * log_ratio.exp() * a


def ipo_paper(tr: IPOMask, trn, denominator, a, adv):
    """Drop tokens whose probability moved by more than the threshold either way."""
    return ((trn.exp() - denominator.exp()).abs() <= tr.threshold) * (trn - denominator).exp() * a


def one_sided_paper(tr: OneSided, trn, denominator, a, adv):
    """prime-rl's ref_kl region: drop tokens whose probability fell by more than the threshold."""
    return ((trn.exp() - denominator.exp()) >= -tr.threshold) * (trn - denominator).exp() * a


def dppo_paper(tr: DPPOMask, trn, denominator, a, adv):
    """prime-rl's DPPO: drop A > 0 tokens whose probability rose by > high, A ≤ 0 ones that fell by > low."""
    dp = trn.exp() - denominator.exp()
    masked = torch.where(adv > 0, dp > tr.high, dp < -tr.low)
    return (~masked) * (trn - denominator).exp() * a


def dppo_tv_paper(tr: DPPOTV, trn, denominator, a, adv):
    """DPPO-Binary-TV: keep A > 0 tokens with p − p_old ≤ δ_high, others with p − p_old ≥ −δ_low;
    REINFORCE with the detached IS ratio truncated at C."""
    dp = (trn.exp() - denominator.exp()).detach()
    keep = torch.where(a > 0, dp <= tr.high, dp >= -tr.low)
    return keep * (trn - denominator).exp().clamp(max=tr.ratio_cap).detach() * a * trn


def dppo_kl_paper(tr: DPPOKL, trn, denominator, a, adv):
    """DPPO-Binary-KL: KL(Bern(p_old) ‖ Bern(p)) of the sampled token; a token drops only past the
    threshold in the direction its advantage pushes."""
    p, p_old = trn.detach().exp(), denominator.exp()
    # with verl's 1e-8 guard (documented on DPPOKL): without it p = 1 (trn = 0, which draw_bin makes)
    # gives an infinite divergence where verl's and packloss's are finite
    kl = p_old * (p_old / p).log() + (1 - p_old) * ((1 - p_old + 1e-8) / (1 - p + 1e-8)).log()
    keep = torch.where(a > 0, (kl <= tr.high) | (p <= p_old), (kl <= tr.low) | (p >= p_old))
    return keep * (trn - denominator).exp().clamp(max=tr.ratio_cap).detach() * a * trn


PAPERS = {
    "none": none_paper,
    "icepop": icepop_paper,
    "icepop_log": icepop_log_paper,
    "ipo": ipo_paper,
    "one_sided": one_sided_paper,
    "dppo": dppo_paper,
    "dppo_tv": dppo_tv_paper,
    "dppo_kl": dppo_kl_paper,
}


globals().update(region_family_tests(OBJECTIVES, PAPERS))


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: IcePop(2.0, 1.0), ValueError, "low < high"),
        (lambda: IPOMask(float("inf")), ValueError, "IPOMask.threshold must be finite"),
        (lambda: DPPOTV(low=-0.1), ValueError, "DPPOTV.low must be >= 0"),
        (lambda: DPPOTV(high=float("inf")), ValueError, "DPPOTV.high must be finite"),
        (lambda: DPPOTV(ratio_cap=0.0), ValueError, "DPPOTV.ratio_cap must be > 0"),
        (lambda: DPPOKL(high=-1.0), ValueError, "DPPOKL.high must be >= 0"),
        (lambda: DPPOKL(ratio_cap=True), TypeError, "DPPOKL.ratio_cap must be a number"),
        (lambda: DPPOKL(low=float("nan")), ValueError, "DPPOKL.low must be finite"),
        (lambda: DPPOMask(low=-0.1), ValueError, "DPPOMask.low must be >= 0"),
        (lambda: DPPOMask(high=float("nan")), ValueError, "DPPOMask.high must be finite"),
        (lambda: OneSided(threshold="0.1"), TypeError, "OneSided.threshold must be a number"),
        (lambda: IcePopLogBand(0.0, 5.0), ValueError, "IcePopLogBand needs 0 < ratio_low <= ratio_high"),
        (lambda: IcePopLogBand(2.0, 1.5), ValueError, "IcePopLogBand needs 0 < ratio_low <= ratio_high"),
        (lambda: IcePopLogBand(ratio_high=float("inf")), ValueError, "IcePopLogBand.ratio_high must be finite"),
    ],
)
def test_trust_region_validation(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_dppo_tv_clamps_the_log_ratio_like_verl():
    """verl computes r = exp(clamp(log r, −20, 20)): finite at log r = ±25, no gradient through the clamp."""
    out, grad = one_bin(DPPOTV(high=2.0, low=2.0, ratio_cap=5.0), [25.0, -25.0], [1.0, -1.0], base=-30.0)
    assert torch.isfinite(out.loss)
    expected = torch.tensor([-5.0, math.exp(-20.0)], dtype=torch.float64)  # −A · min(r, C), r clamped at e^−20
    assert torch.allclose(grad, expected, rtol=1e-12, atol=0)
    assert out.metrics["rl/is_truncated"].item() == pytest.approx(0.5)


def test_dppo_kl_drops_only_in_the_advantage_direction():
    # p_old = e^−1; a token whose p rose far (A > 0) drops, one whose p fell as far (A > 0) is kept
    out, grad = one_bin(DPPOKL(low=0.01, high=0.01), [1.0, -1.0, 1.0, -1.0], [1.0, 1.0, -1.0, -1.0])
    assert grad[0] == 0 and grad[1] != 0 and grad[2] != 0 and grad[3] == 0
    assert out.metrics["rl/is_masked"].item() == pytest.approx(0.5)
    assert out.metrics["rl/is_masked_high"].item() == pytest.approx(0.25)
    assert out.metrics["rl/is_masked_low"].item() == pytest.approx(0.25)


def test_icepop_log_band_masks_before_exp():
    """A dropped member's ratio is replaced before ``exp``: log r = ±1000 (e^1000 = inf in float64) gives a
    finite loss and no gradient; the kept members carry J = A · r."""
    log_r = [1000.0, -1000.0, 0.5, -0.5, 1.5]
    adv = [1.0, -1.0, 2.0, -1.0, 1.0]
    out, grad = one_bin(IcePopLogBand(0.2, 5.0), log_r, adv)  # log 0.2 = −1.609, log 5 = 1.609
    expected = -(2.0 * math.exp(0.5) - math.exp(-0.5) + math.exp(1.5))
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    want = torch.tensor([0.0, 0.0, -2.0 * math.exp(0.5), math.exp(-0.5), -math.exp(1.5)], dtype=torch.float64)
    assert torch.isfinite(grad).all() and torch.allclose(grad, want, rtol=1e-12, atol=0)
    assert out.metrics["rl/is_masked"].item() == pytest.approx(2 / 5)
    # a narrower band drops the ratio e^1.5 too
    narrow, grad = one_bin(IcePopLogBand(0.2, 4.0), log_r, adv)
    assert narrow.loss.item() == pytest.approx(-(2.0 * math.exp(0.5) - math.exp(-0.5)), rel=1e-12)
    assert grad[4] == 0 and narrow.metrics["rl/is_masked"].item() == pytest.approx(3 / 5)
