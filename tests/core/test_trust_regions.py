"""Every objective of the skeleton against an independent per-sequence reference written straight
from its paper formula with plain autograd, over hypothesis-drawn packings; NaN safety; no syncs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from conftest import bin_of, check_against_paper, packings, poison_non_members, with_old
from packloss import Component, KLPenalty, Outputs, Plan, PolicyGradient, compute_loss
from packloss.core.trust_regions import (
    CISPO,
    GSPO,
    TRUST_REGIONS,
    DPPOMask,
    IcePop,
    IPOMask,
    PolicyTerms,
    PPOClip,
    Surrogate,
    TrustRegion,
    register_trust_region,
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
    # three streams: the trust region against π_old, on-policy without the stream
    "ppo_old": (PolicyGradient(PPOClip(0.2, 0.28), penalties=(KLPenalty(0.04),)), "old"),
    "ppo_on_policy": (PolicyGradient(PPOClip(0.2, 0.28)), "sg"),
    "dppo_old_drift_old": (PolicyGradient(DPPOMask(), penalties=(KLPenalty(0.1, "k3", "old"),)), "old"),
    "gspo_old": (PolicyGradient(GSPO(0.2, 0.2)), "old"),
    "cispo_on_policy": (PolicyGradient(CISPO(0.9, 0.25)), "sg"),
}


def estimator(kind: str, x: torch.Tensor) -> torch.Tensor:
    return {"squared_log_ratio": x**2, "k1": -x, "k2": x**2 / 2, "k3": x.exp() - x - 1}[kind]


def paper_sequence_loss(seq, p: PolicyGradient, base: str) -> torch.Tensor:
    """One sequence's summed loss over its members, from the papers' formulas."""
    trn, inf, ref = seq.trn, seq.inf, seq.ref
    denominator = {"inf": inf, "old": seq.old, "sg": trn.detach()}[base]
    log_ratio = trn - denominator
    ratio = log_ratio.exp()
    a = p.adv_coef * ((ref - trn).detach() if p.advantage == "ref_kl" else seq.adv)
    tr = p.trust_region
    if tr.name == "none":  # plain importance-weighted policy gradient
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
