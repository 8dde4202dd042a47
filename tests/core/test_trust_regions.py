"""Every objective of the skeleton against an independent per-sequence reference written straight
from its paper formula with plain autograd, over hypothesis-drawn packings; NaN safety; no syncs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from conftest import bin_of, check_against_paper, packings, poison_non_members, with_old
from packloss import REF_KL, Component, KLPenalty, Outputs, Plan, PolicyGradient, compute_loss
from packloss.core.trust_regions import (
    CISPO,
    DPPOKL,
    DPPOTV,
    GMPO,
    GPG,
    GSPO,
    SAPO,
    TOPR,
    TRUST_REGIONS,
    DPPOMask,
    IcePop,
    IPOMask,
    OneSided,
    PolicyTerms,
    PPOClip,
    Surrogate,
    TrustRegion,
    register_trust_region,
    trust_region,
)
from packloss.testing import OpCounter


def drift(coef: float, estimator: str = "squared_log_ratio") -> tuple[KLPenalty, ...]:
    return (KLPenalty(coef, estimator, "rollout"),)


# name → (objective, ratio base of the paper reference: "inf", "old" or "sg" (on-policy))
OBJECTIVES = {
    "none": (PolicyGradient("none", ratio="rollout", penalties=drift(1e-3)), "inf"),
    "ppo_clip": (PolicyGradient(PPOClip(0.2, 0.28), ratio="rollout"), "inf"),
    "dual_clip": (PolicyGradient(PPOClip(dual_clip_c=3.0), ratio="rollout", penalties=drift(0.01)), "inf"),
    "icepop": (PolicyGradient(IcePop(0.7, 1.5), ratio="rollout", penalties=drift(1e-3)), "inf"),
    "cispo": (PolicyGradient(CISPO(0.9, 0.25), ratio="rollout"), "inf"),
    "gspo": (PolicyGradient(GSPO(3e-4, 4e-4), ratio="rollout"), "inf"),
    "gspo_wide": (PolicyGradient(GSPO(0.2, 0.2), ratio="rollout", penalties=drift(1e-3)), "inf"),
    "k1": (PolicyGradient("none", ratio="rollout", penalties=drift(0.1, "k1")), "inf"),
    "k2": (PolicyGradient(DPPOMask(), ratio="rollout", penalties=drift(0.1, "k2")), "inf"),
    "k3": (PolicyGradient(IPOMask(), ratio="rollout", penalties=drift(0.1, "k3")), "inf"),
    "grpo_ref_kl": (PolicyGradient(PPOClip(), ratio="rollout", penalties=(KLPenalty(0.04),)), "inf"),
    "ref_kl_k2": (PolicyGradient("none", ratio="rollout", penalties=(KLPenalty(0.1, "k2"), *drift(1e-3))), "inf"),
    "opd_cispo": (PolicyGradient(CISPO(), ratio="rollout", advantage="ref_kl", penalties=drift(1e-3)), "inf"),
    "ref_kl": (REF_KL, "inf"),
    "one_sided_old": (PolicyGradient(OneSided(0.1)), "old"),
    # three streams: the trust region against π_old, on-policy without the stream
    "ppo_old": (PolicyGradient(PPOClip(0.2, 0.28), penalties=(KLPenalty(0.04),)), "old"),
    "ppo_on_policy": (PolicyGradient(PPOClip(0.2, 0.28)), "sg"),
    "dppo_old_drift_old": (PolicyGradient(DPPOMask(), penalties=(KLPenalty(0.1, "k3", "old"),)), "old"),
    "gspo_old": (PolicyGradient(GSPO(0.2, 0.2)), "old"),
    "cispo_on_policy": (PolicyGradient(CISPO(0.9, 0.25)), "sg"),
    # verl 0.9.1's loss modes and TOPR (references: PAPER_REGIONS below)
    "sapo_old": (PolicyGradient(SAPO()), "old"),
    "sapo_rollout": (PolicyGradient(SAPO(2.0, 4.0), ratio="rollout", adv_coef=0.5), "inf"),
    "sapo_on_policy": (PolicyGradient("sapo", penalties=(KLPenalty(0.04),)), "sg"),
    "geo_mean_old": (PolicyGradient(GMPO()), "old"),
    "geo_mean_rollout": (PolicyGradient(GMPO(0.1, 0.3, eps=0.0), ratio="rollout", penalties=drift(1e-3)), "inf"),
    "geo_mean_distill": (PolicyGradient(GMPO(0.4, 0.4), ratio="rollout", advantage="ref_kl"), "inf"),
    "gpg_on_policy": (PolicyGradient("gpg"), "sg"),
    "gpg_rollout": (PolicyGradient(GPG(), ratio="rollout", adv_coef=2.0, penalties=drift(1e-3)), "inf"),
    "dppo_tv_old": (PolicyGradient(DPPOTV()), "old"),
    "dppo_tv_rollout": (PolicyGradient(DPPOTV(0.1, 0.15, ratio_cap=1.2), ratio="rollout"), "inf"),
    "dppo_kl_old": (PolicyGradient(DPPOKL(0.02, 0.05)), "old"),
    "dppo_kl_rollout": (PolicyGradient(DPPOKL(ratio_cap=1.3), ratio="rollout", adv_coef=0.7), "inf"),
    "topr_rollout": (PolicyGradient("topr", ratio="rollout"), "inf"),
    "topr_old": (PolicyGradient(TOPR(0.1, 0.8), adv_coef=1.5), "old"),
    "topr_distill": (PolicyGradient(TOPR(), ratio="rollout", advantage="ref_kl"), "inf"),
}


def estimator(kind: str, x: torch.Tensor) -> torch.Tensor:
    return {"squared_log_ratio": x**2, "k1": -x, "k2": x**2 / 2, "k3": x.exp() - x - 1}[kind]


def sapo_paper(tr: SAPO, trn, denominator, a):
    """Gao et al. 2025: J_t = f(r_t) A_t, f(x) = σ(τ(x − 1)) · 4/τ, τ by the sign of A_t."""
    ratio = (trn - denominator).exp()
    tau = torch.where(a > 0, torch.tensor(tr.tau_pos, dtype=trn.dtype), torch.tensor(tr.tau_neg, dtype=trn.dtype))
    return torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a


def gmpo_paper(tr: GMPO, trn, denominator, a):
    """Zhao et al. 2025: Â · (Π_t r̃_t)^{1/|o|}, r̃_t the ratio clipped in log space to the pessimistic
    side of sgn(A_t); every token of the sequence carries the sequence's value."""
    log_ratio = trn - denominator
    sign = torch.sign(a)
    clipped = torch.min(sign * log_ratio, sign * log_ratio.clamp(-tr.clip_low, tr.clip_high)) * sign
    n = len(trn)
    return torch.ones_like(trn) * a.sum() / n * (clipped.sum() / n).exp()


def gpg_paper(tr: GPG, trn, denominator, a):
    """Chu et al. 2025: J = A · log π."""
    return a * trn


def dppo_tv_paper(tr: DPPOTV, trn, denominator, a):
    """DPPO-Binary-TV: keep A > 0 tokens with p − p_old ≤ δ_high, others with p − p_old ≥ −δ_low;
    REINFORCE with the detached IS ratio truncated at C."""
    dp = (trn.exp() - denominator.exp()).detach()
    keep = torch.where(a > 0, dp <= tr.high, dp >= -tr.low)
    return keep * (trn - denominator).exp().clamp(max=tr.ratio_cap).detach() * a * trn


def dppo_kl_paper(tr: DPPOKL, trn, denominator, a):
    """DPPO-Binary-KL: KL(Bern(p_old) ‖ Bern(p)) of the sampled token; a token drops only past the
    threshold in the direction its advantage pushes."""
    p, p_old = trn.detach().exp(), denominator.exp()
    # with verl's 1e-8 guard (documented on DPPOKL): without it p = 1 (trn = 0, which draw_bin makes)
    # gives an infinite divergence where verl's and packloss's are finite
    kl = p_old * (p_old / p).log() + (1 - p_old) * ((1 - p_old + 1e-8) / (1 - p + 1e-8)).log()
    keep = torch.where(a > 0, (kl <= tr.high) | (p <= p_old), (kl <= tr.low) | (p >= p_old))
    return keep * (trn - denominator).exp().clamp(max=tr.ratio_cap).detach() * a * trn


def topr_paper(tr: TOPR, trn, denominator, a):
    """Le Roux et al. 2025: A ≥ 0: A ∇log π(τ); A < 0: [π(τ)/μ(τ)]_0^1 A ∇log π(τ)."""
    w = (trn - denominator).sum().exp().clamp(tr.low, tr.high).detach()
    return torch.where(a < 0, w, torch.ones_like(w)) * a * trn


PAPER_REGIONS = {
    "sapo": sapo_paper,
    "geo_mean": gmpo_paper,
    "gpg": gpg_paper,
    "dppo_tv": dppo_tv_paper,
    "dppo_kl": dppo_kl_paper,
    "topr": topr_paper,
}


def paper_sequence_loss(seq, p: PolicyGradient, base: str) -> torch.Tensor:
    """One sequence's summed loss over its members, from the papers' formulas."""
    trn, inf, ref = seq.trn, seq.inf, seq.ref
    denominator = {"inf": inf, "old": seq.old, "sg": trn.detach()}[base]
    log_ratio = trn - denominator
    ratio = log_ratio.exp()
    a = p.adv_coef * ((ref - trn).detach() if p.advantage == "ref_kl" else seq.adv)
    tr = p.trust_region
    if tr.name in PAPER_REGIONS:
        objective = PAPER_REGIONS[tr.name](tr, trn, denominator, a)
    elif tr.name == "none":  # plain importance-weighted policy gradient
        objective = ratio * a
    elif tr.name == "ppo_clip":  # Schulman et al. 2017; dual clip: Ye et al. 2020
        objective = torch.min(ratio * a, ratio.clamp(1 - tr.clip_low, 1 + tr.clip_high) * a)
        if tr.dual_clip_c is not None:
            objective = torch.where(a < 0, torch.max(objective, tr.dual_clip_c * a), objective)
    elif tr.name == "icepop":  # drop tokens whose ratio leaves [low, high]
        objective = ((ratio >= tr.low) & (ratio <= tr.high)) * ratio * a
    elif tr.name == "cispo":  # MiniMax-M1: REINFORCE with a detached, clipped IS weight
        objective = ratio.clamp(1 - tr.clip_low, 1 + tr.clip_high).detach() * a * trn
    elif tr.name == "gspo":  # Zheng et al. 2025, GSPO-token
        s = log_ratio.mean().exp()
        s_token = s.detach() * (trn - trn.detach()).exp()
        objective = torch.min(s_token * a, s_token.clamp(1 - tr.clip_low, 1 + tr.clip_high) * a)
    elif tr.name == "ipo":
        objective = ((trn.exp() - denominator.exp()).abs() <= tr.threshold) * ratio * a
    elif tr.name == "one_sided":  # prime-rl's ref_kl region: drop tokens whose probability fell by > threshold
        objective = ((trn.exp() - denominator.exp()) >= -tr.threshold) * ratio * a
    else:  # dppo
        dp = trn.exp() - denominator.exp()
        masked = torch.where(a / p.adv_coef > 0, dp > tr.high, dp < -tr.low)
        objective = (~masked) * ratio * a
    loss = -objective
    for k in p.penalties:
        x = {"ref": ref - trn, "rollout": trn - inf, "old": trn - (seq.old if seq.old is not None else inf)}[k.against]
        loss = loss + k.coef * estimator(k.estimator, x)
    return (loss * seq.w).sum()


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=packings())
def test_objective_matches_paper_reference(name, case):
    objective, base = OBJECTIVES[name]
    check_against_paper(objective, lambda seq: paper_sequence_loss(seq, objective, base), case, with_old=base == "old")


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


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_objective_is_nan_safe(name):
    params, base = OBJECTIVES[name]
    clean = bin_of("sdft", seed=2)
    clean = with_old(clean) if base == "old" else clean
    poisoned, _, _ = poison_non_members(clean)
    out_clean = compute_loss(clean.plan(params), clean.outputs())
    out_poisoned = compute_loss(poisoned.plan(params), poisoned.outputs())
    (g_clean,) = torch.autograd.grad(out_clean.loss, clean.trainer_logprobs)
    (g_poisoned,) = torch.autograd.grad(out_poisoned.loss, poisoned.trainer_logprobs)
    assert torch.isfinite(g_poisoned).all() and torch.isfinite(out_poisoned.loss)
    assert torch.equal(out_clean.loss, out_poisoned.loss)
    assert torch.equal(g_clean, g_poisoned)
    for key, value in out_clean.metrics.items():
        assert torch.equal(value, out_poisoned.metrics[key]), key


MODES = ("token", "position", "sequence_mean", "sequence_sum", "constant", "group_mean")


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@pytest.mark.parametrize("mode", MODES)
def test_objective_and_mode_sync_free_and_flat(name, mode):
    params, base = OBJECTIVES[name]
    totals = set()
    for num_seqs in (1, 16, 256):
        streams = bin_of("sdft", num_tokens=1024, num_seqs=num_seqs, seed=3)
        streams = with_old(streams) if base == "old" else streams
        constants = {"rl": 1000.0, "ref_kl": 10.0} if mode == "constant" else None
        groups = [s // 3 for s in range(num_seqs)]
        plan = streams.plan(params, normalize=mode, constants=constants, group_ids=groups)
        with OpCounter() as counter:
            compute_loss(plan, streams.outputs(), per_sequence_metrics=True).loss.backward()
        assert counter.num_syncs == 0, counter.syncs
        totals.add(counter.total)
    assert len(totals) == 1, totals


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: PPOClip(clip_low=1.0), ValueError, "PPOClip.clip_low must be in"),
        (lambda: PPOClip(clip_high=-0.1), ValueError, "PPOClip.clip_high must be >= 0"),
        (lambda: PPOClip(dual_clip_c=1.0), ValueError, "dual_clip_c must be > 1"),
        (lambda: PPOClip(dual_clip_c=float("nan")), ValueError, "dual_clip_c must be finite"),
        (lambda: PPOClip(clip_high=float("nan")), ValueError, "clip_high must be finite"),
        (lambda: PPOClip(clip_low=True), TypeError, "clip_low must be a number"),
        (lambda: IcePop(2.0, 1.0), ValueError, "low < high"),
        (lambda: IPOMask(float("inf")), ValueError, "IPOMask.threshold must be finite"),
        (lambda: CISPO(clip_low=-0.5), ValueError, "CISPO.clip_low must be in"),
        (lambda: GSPO(clip_high=float("nan")), ValueError, "GSPO.clip_high must be finite"),
        (lambda: SAPO(tau_pos=0.0), ValueError, "SAPO.tau_pos must be > 0"),
        (lambda: SAPO(tau_neg=-1.0), ValueError, "SAPO.tau_neg must be > 0"),
        (lambda: SAPO(tau_neg=float("inf")), ValueError, "SAPO.tau_neg must be finite"),
        (lambda: SAPO(tau_pos="1"), TypeError, "SAPO.tau_pos must be a number"),
        (lambda: GMPO(clip_low=-0.1), ValueError, "GMPO.clip_low must be >= 0"),
        (lambda: GMPO(clip_high=float("nan")), ValueError, "GMPO.clip_high must be finite"),
        (lambda: GMPO(eps=-1e-8), ValueError, "GMPO.eps must be >= 0"),
        (lambda: GMPO(eps=None), TypeError, "GMPO.eps must be a number"),
        (lambda: GPG(0.1), TypeError, "positional argument"),  # GPG has no parameters
        (lambda: DPPOTV(low=-0.1), ValueError, "DPPOTV.low must be >= 0"),
        (lambda: DPPOTV(high=float("inf")), ValueError, "DPPOTV.high must be finite"),
        (lambda: DPPOTV(ratio_cap=0.0), ValueError, "DPPOTV.ratio_cap must be > 0"),
        (lambda: DPPOKL(high=-1.0), ValueError, "DPPOKL.high must be >= 0"),
        (lambda: DPPOKL(ratio_cap=True), TypeError, "DPPOKL.ratio_cap must be a number"),
        (lambda: DPPOKL(low=float("nan")), ValueError, "DPPOKL.low must be finite"),
        (lambda: TOPR(low=-0.5), ValueError, "TOPR.low must be >= 0"),
        (lambda: TOPR(high=0.0), ValueError, "TOPR.high must be > 0"),
        (lambda: TOPR(low=2.0, high=1.0), ValueError, "TOPR.low must be <= TOPR.high"),
        (lambda: TOPR(high=float("inf")), ValueError, "TOPR.high must be finite"),
    ],
)
def test_trust_region_validation(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_penalty_streams_are_required():
    streams = bin_of("hot")
    with pytest.raises(ValueError, match="'rl' needs the plan's ref_logprobs"):
        streams.plan(PolicyGradient(penalties=(KLPenalty(0.1),)))
    with pytest.raises(ValueError, match="'rl' needs the plan's old_logprobs"):
        streams.plan(PolicyGradient(penalties=(KLPenalty(0.1, against="old"),)))


def test_register_a_trust_region_in_user_code():
    """A user's region, registered in their own module, runs through the engine by name."""

    @register_trust_region("test_band")
    @dataclass(frozen=True)
    class Band(TrustRegion):
        eps: float = 0.1

        def surrogate(self, t: PolicyTerms) -> Surrogate:
            kept = t.m & ((t.r - 1).abs() <= self.eps)
            return Surrogate(kept * t.a * t.r, {"is_masked": t.m & ~kept})

    try:
        assert TRUST_REGIONS["test_band"] is Band
        case = ([4, 3], 5, [False, False], False)

        def paper(seq):
            ratio = (seq.trn - seq.inf).exp()
            return -((ratio - 1).abs() <= 0.1).to(ratio.dtype).mul(seq.adv * ratio).sum()

        check_against_paper(PolicyGradient("test_band", ratio="rollout"), paper, case)
        with pytest.raises(ValueError, match="already registered"):
            register_trust_region("test_band")(type("Other", (TrustRegion,), {}))
    finally:
        TRUST_REGIONS.pop("test_band", None)


def test_new_regions_are_registered_with_verl_defaults():
    """Names resolve to the classes; defaults are verl 0.9.1's ActorConfig values (tau_pos/neg,
    clip_ratio_low/high, clip_ratio_c) and the TOPR paper's [·]_0^1."""
    assert trust_region("sapo") == SAPO(tau_pos=1.0, tau_neg=1.05)
    assert trust_region("geo_mean") == GMPO(clip_low=0.2, clip_high=0.2, eps=0.0)
    assert trust_region("gpg") == GPG()
    assert trust_region("dppo_tv") == DPPOTV(low=0.2, high=0.2, ratio_cap=3.0)
    assert trust_region("dppo_kl") == DPPOKL(low=0.2, high=0.2, ratio_cap=3.0)
    assert trust_region("topr") == TOPR(low=0.0, high=1.0)
    assert TRUST_REGIONS["dppo"] is DPPOMask  # prime-rl's binary DPPO keeps its name


def _one_bin(region, log_r, adv, lens=None, base=-1.0):
    """A single-component plan over ``log_r`` against π_rollout (all members), float64."""
    n = len(log_r)
    trn = (torch.tensor(log_r, dtype=torch.float64) + base).requires_grad_()
    members = torch.ones(n, dtype=torch.bool)
    component = Component(PolicyGradient(region, ratio="rollout"), members, None, "constant", 1.0)
    inf = torch.full((n,), base, dtype=torch.float64)
    plan = Plan(lens or [n], {"rl": component}, inf, advantages=torch.tensor(adv, dtype=torch.float64))
    out = compute_loss(plan, Outputs(logprobs=trn))
    (grad,) = torch.autograd.grad(out.loss, trn)
    return out, grad


def test_sapo_and_dppo_clamp_the_log_ratio_like_verl():
    """verl computes r = exp(clamp(log r, −20, 20)): finite at log r = ±25, no gradient through the clamp."""
    out, grad = _one_bin(SAPO(), [25.0, -25.0, 0.0], [1.0, -1.0, 1.0])
    r = torch.tensor([20.0, -20.0, 0.0], dtype=torch.float64).exp()
    tau = torch.tensor([1.0, 1.05, 1.0], dtype=torch.float64)
    a = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    assert torch.isclose(out.loss, -(torch.sigmoid(tau * (r - 1)) * 4 / tau * a).sum(), rtol=1e-12)
    assert torch.equal(grad[:2], torch.zeros(2, dtype=torch.float64)) and grad[2] == -1.0  # ∇ at r = 1: −A
    out, grad = _one_bin(DPPOTV(high=2.0, low=2.0, ratio_cap=5.0), [25.0, -25.0], [1.0, -1.0], base=-30.0)
    assert torch.isfinite(out.loss)
    expected = torch.tensor([-5.0, math.exp(-20.0)], dtype=torch.float64)  # −A · min(r, C), r clamped at e^−20
    assert torch.allclose(grad, expected, rtol=1e-12, atol=0)
    assert out.metrics["rl/is_truncated"].item() == pytest.approx(0.5)


def test_gmpo_clips_on_the_pessimistic_side_and_reports_verl_fractions():
    # seq 0 (A > 0): log r 0.5 clipped to 0.2, −0.5 kept; seq 1 (A < 0): −0.5 clipped to −0.2, 0.5 kept
    out, grad = _one_bin(GMPO(), [0.5, -0.5, -0.5, 0.5], [1.0, 1.0, -1.0, -1.0], lens=[2, 2])
    rho = torch.tensor([(0.2 - 0.5) / 2, (-0.2 + 0.5) / 2], dtype=torch.float64).exp()
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64) * 2 / (2 + 1e-8)
    assert torch.isclose(out.loss, -(2 * adv * rho).sum(), rtol=1e-12)
    assert grad[0] == 0 and grad[2] == 0 and grad[1] != 0 and grad[3] != 0  # clipped tokens carry no gradient
    assert out.metrics["rl/clip_frac_high"].item() == pytest.approx(0.5)  # both A > 0 tokens are outside
    assert out.metrics["rl/clip_frac_low"].item() == pytest.approx(0.5)
    assert out.metrics["rl/is_masked"].item() == pytest.approx(0.5)
    assert out.metrics["rl/seq_ratio_max"].item() == pytest.approx(rho.max().item())


def test_topr_truncates_only_negative_sequences():
    # seq 0: A > 0, π/μ = e^0.6 (no weight); seq 1: A < 0, π/μ = e^0.6 → 1; seq 2: A < 0, π/μ = e^−0.4
    out, grad = _one_bin(TOPR(), [0.3, 0.3, 0.3, 0.3, -0.2, -0.2], [2.0, 2.0, -1.0, -1.0, -1.0, -1.0], lens=[2, 2, 2])
    expected = -torch.tensor([2.0, 2.0, -1.0, -1.0, -math.exp(-0.4), -math.exp(-0.4)], dtype=torch.float64)
    assert torch.allclose(grad, expected, rtol=1e-12, atol=0)
    assert out.metrics["rl/truncated_frac_high"].item() == pytest.approx(2 / 6)
    assert out.metrics["rl/truncated_frac_low"].item() == 0
    assert out.metrics["rl/negative_is_weight"].item() == pytest.approx((1 + math.exp(-0.4)) / 2)


def test_dppo_kl_drops_only_in_the_advantage_direction():
    # p_old = e^−1; a token whose p rose far (A > 0) drops, one whose p fell as far (A > 0) is kept
    out, grad = _one_bin(DPPOKL(low=0.01, high=0.01), [1.0, -1.0, 1.0, -1.0], [1.0, 1.0, -1.0, -1.0])
    assert grad[0] == 0 and grad[1] != 0 and grad[2] != 0 and grad[3] == 0
    assert out.metrics["rl/is_masked"].item() == pytest.approx(0.5)
    assert out.metrics["rl/is_masked_high"].item() == pytest.approx(0.25)
    assert out.metrics["rl/is_masked_low"].item() == pytest.approx(0.25)
