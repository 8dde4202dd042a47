"""Every objective of the skeleton against an independent per-sequence reference written straight
from its paper formula with plain autograd, over hypothesis-drawn packings; NaN safety; no syncs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import bin_of, poison_non_members
from packloss import Component, Outputs, PGParams, Plan, compute_loss
from packloss.testing import OpCounter

OBJECTIVES = {
    "none": PGParams(trust_region="none"),
    "ppo_clip": PGParams(trust_region="ppo_clip", clip_low=0.2, clip_high=0.28, kl_tau=0.0),
    "dual_clip": PGParams(trust_region="ppo_clip", dual_clip_c=3.0, kl_tau=0.01),
    "icepop": PGParams(trust_region="icepop", icepop_low=0.7, icepop_high=1.5),
    "cispo": PGParams(trust_region="cispo", clip_low=0.9, clip_high=0.25, kl_tau=0.0),
    "gspo": PGParams(trust_region="gspo", clip_low=3e-4, clip_high=4e-4, kl_tau=0.0),
    "gspo_wide": PGParams(trust_region="gspo", clip_low=0.2, clip_high=0.2),
    "tis": PGParams(trust_region="ppo_clip", tis_cap=1.2),
    "k1": PGParams(trust_region="none", kl_estimator="k1", kl_tau=0.1),
    "k2": PGParams(trust_region="dppo", kl_estimator="k2", kl_tau=0.1),
    "k3": PGParams(trust_region="ipo", kl_estimator="k3", kl_tau=0.1),
    "grpo_ref_kl": PGParams(trust_region="ppo_clip", kl_tau=0.0, ref_kl_coef=0.04),
    "ref_kl_k2": PGParams(trust_region="none", ref_kl_coef=0.1, ref_kl_estimator="k2"),
    "opd_cispo": PGParams(advantage="ref_kl", trust_region="cispo"),
}


def estimator(kind: str, x: torch.Tensor) -> torch.Tensor:
    return {"squared_log_ratio": x**2, "k1": -x, "k2": x**2 / 2, "k3": x.exp() - x - 1}[kind]


def paper_sequence_loss(trn, inf, ref, adv, w, p: PGParams) -> torch.Tensor:
    """One sequence's summed loss over its members (already selected), from the papers' formulas."""
    log_ratio = trn - inf
    ratio = log_ratio.exp()
    a = p.adv_tau * ((ref - trn).detach() if p.advantage == "ref_kl" else adv)
    lo, hi = 1 - p.clip_low, 1 + p.clip_high
    if p.trust_region == "none":  # plain importance-weighted policy gradient
        objective = ratio * a
    elif p.trust_region == "ppo_clip":  # Schulman et al. 2017; dual clip: Ye et al. 2020
        objective = torch.min(ratio * a, ratio.clamp(lo, hi) * a)
        if p.dual_clip_c is not None:
            objective = torch.where(a < 0, torch.max(objective, p.dual_clip_c * a), objective)
    elif p.trust_region == "icepop":  # drop tokens whose ratio leaves [low, high]
        objective = ((ratio >= p.icepop_low) & (ratio <= p.icepop_high)) * ratio * a
    elif p.trust_region == "cispo":  # MiniMax-M1: REINFORCE with a detached, clipped IS weight
        objective = ratio.clamp(lo, hi).detach() * a * trn
    elif p.trust_region == "gspo":  # Zheng et al. 2025, GSPO-token
        s = log_ratio.mean().exp()
        s_token = s.detach() * (trn - trn.detach()).exp()
        objective = torch.min(s_token * a, s_token.clamp(lo, hi) * a)
    elif p.trust_region == "ipo":
        objective = ((trn.exp() - inf.exp()).abs() <= p.ipo_threshold) * ratio * a
    else:  # dppo
        dp = trn.exp() - inf.exp()
        masked = torch.where(a / p.adv_tau > 0, dp > p.dppo_mask_high, dp < -p.dppo_mask_low)
        objective = (~masked) * ratio * a
    loss = -objective + p.kl_tau * estimator(p.kl_estimator, log_ratio)
    if p.ref_kl_coef:
        loss = loss + p.ref_kl_coef * estimator(p.ref_kl_estimator, ref - trn)
    if p.tis_cap is not None:
        loss = loss * ratio.detach().clamp(max=p.tis_cap)
    return (loss * w).sum()


@st.composite
def packings(draw):
    lens = draw(st.lists(st.integers(1, 10), min_size=1, max_size=7))
    seed = draw(st.integers(0, 2**31 - 1))
    empty = draw(st.lists(st.booleans(), min_size=len(lens), max_size=len(lens)))  # all-masked sequences
    weighted = draw(st.booleans())
    return lens, seed, empty, weighted


def draw_bin(lens, seed, empty, weighted):
    """Float64 streams: the engine keeps float64 (it only promotes below float32), so both sides agree
    to 1e-6 without float32 summation-order noise."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    p_inf = torch.rand(n, generator=g) * 0.9 + 0.05
    trn = (p_inf * torch.exp((torch.rand(n, generator=g) - 0.5) * 1.2)).clamp(1e-3, 1).log()
    ref = (torch.rand(n, generator=g) * 0.9 + 0.05).log()
    adv = torch.repeat_interleave(torch.randn(len(lens), generator=g), torch.tensor(lens))
    mask = torch.rand(n, generator=g) < 0.8
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    mask &= ~torch.tensor(empty)[seq_ids]
    weights = (torch.rand(n, generator=g) * 2).where(torch.rand(n, generator=g) < 0.8, 0.0) if weighted else None
    f64 = torch.float64
    weights = None if weights is None else weights.to(f64)
    return trn.to(f64).requires_grad_(), p_inf.log().to(f64), ref.to(f64), adv.to(f64), mask, weights


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=packings())
def test_objective_matches_paper_reference(name, case):
    params = OBJECTIVES[name]
    lens, seed, empty, weighted = case
    trn, inf, ref, adv, mask, weights = draw_bin(*case)
    plan = Plan(lens, {"rl": Component(params, mask, weights, "constant", 1.0)}, inf, ref, adv)
    members = plan.members["rl"]
    result = compute_loss(plan, Outputs(logprobs=trn))
    (grad,) = torch.autograd.grad(result.loss, trn)

    expected = trn.sum() * 0
    cu = plan.layout.cu_seqlens.tolist()
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        sel = members[start:end]
        if not sel.any():
            continue
        w = torch.ones(int(sel.sum()), dtype=torch.float64) if weights is None else weights[start:end][sel]
        piece = [t[start:end][sel] for t in (trn, inf, ref, adv)]
        expected = expected + paper_sequence_loss(*piece, w, params)
    (grad_ref,) = torch.autograd.grad(expected, trn)
    scale = max(1.0, expected.abs().item())
    assert abs(result.loss.item() - expected.item()) <= 1e-6 * scale, (result.loss.item(), expected.item())
    assert torch.allclose(grad, grad_ref, rtol=1e-6, atol=1e-6), (grad - grad_ref).abs().max()


def test_clip_metrics_count_what_they_claim():
    r = torch.tensor([0.5, 0.9, 1.5, 1.1, 5.0, 0.7])
    a = torch.tensor([-1.0, -1.0, 1.0, 1.0, -1.0, 1.0])
    trn = torch.zeros(6, requires_grad=True)
    params = PGParams(trust_region="ppo_clip", clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, kl_tau=0)
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
    plan = Plan(lens, {"rl": Component(PGParams(trust_region="gspo"), mask)}, torch.full((9,), -1.0),
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
    params = OBJECTIVES[name]
    clean = bin_of("sdft", seed=2)
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
    params = OBJECTIVES[name]
    totals = set()
    for num_seqs in (1, 16, 256):
        streams = bin_of("sdft", num_tokens=1024, num_seqs=num_seqs, seed=3)
        constants = {"rl": 1000.0, "ref_kl": 10.0} if mode == "constant" else None
        groups = [s // 3 for s in range(num_seqs)]
        plan = streams.plan(params, normalize=mode, constants=constants, group_ids=groups)
        with OpCounter() as counter:
            compute_loss(plan, streams.outputs(), per_sequence_metrics=True).loss.backward()
        assert counter.num_syncs == 0, counter.syncs
        totals.add(counter.total)
    assert len(totals) == 1, totals


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(trust_region="ppo"), "trust_region must be one of"),
        (dict(kl_estimator="k4"), "kl_estimator must be one of"),
        (dict(ref_kl_estimator="exact"), "ref_kl_estimator must be one of"),
        (dict(clip_low=1.0), "clip_low must be in"),
        (dict(clip_high=-0.1), "clip_high must be >= 0"),
        (dict(trust_region="ppo_clip", dual_clip_c=1.0), "dual_clip_c must be > 1"),
        (dict(dual_clip_c=3.0), "dual_clip_c needs trust_region='ppo_clip'"),
        (dict(icepop_low=2.0, icepop_high=1.0), "icepop_low < icepop_high"),
        (dict(tis_cap=0.0), "tis_cap must be > 0"),
        (dict(ref_kl_coef=-1.0), "ref_kl_coef must be >= 0"),
        (dict(kl_tau=-1e-3), "kl_tau must be >= 0"),
        (dict(dppo_mask_high=float("nan")), "dppo_mask_high must be finite"),
        (dict(ipo_threshold=float("inf")), "ipo_threshold must be finite"),
        (dict(clip_high=float("nan")), "clip_high must be finite"),
        (dict(adv_tau=float("nan")), "adv_tau must be finite"),
        (dict(trust_region="ppo_clip", dual_clip_c=float("nan")), "dual_clip_c must be finite"),
        (dict(tis_cap=float("inf")), "tis_cap must be finite"),
    ],
)
def test_objective_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PGParams(**kwargs)


def test_objective_params_types():
    with pytest.raises(TypeError, match="kl_tau must be a number"):
        PGParams(kl_tau="0.1")
    with pytest.raises(TypeError, match="clip_low must be a number"):
        PGParams(clip_low=True)


def test_ref_kl_penalty_needs_reference():
    streams = bin_of("hot")
    with pytest.raises(ValueError, match="'rl' needs the plan's ref_logprobs"):
        streams.plan(PGParams(ref_kl_coef=0.1))
