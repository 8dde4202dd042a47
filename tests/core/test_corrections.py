"""Rollout corrections (TIS / MIS, token and sequence level) and the off-policy sequence mask against a
per-sequence reference written from their definitions; constant in θ; on the policy-gradient term
only; NaN-safe; no syncs."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from conftest import bin_of, check_against_paper, packings, poison_non_members, with_old
from packloss import KLPenalty, OffPolicyMask, PolicyGradient, RolloutCorrection, compute_loss
from packloss.core.trust_regions import PPOClip
from packloss.testing import OpCounter

CORRECTIONS = {
    "token_tis": RolloutCorrection("token", "truncate", high=1.5),
    "token_tis_low": RolloutCorrection("token", "truncate", high=1.5, low=0.8),
    "token_mis": RolloutCorrection("token", "mask", high=1.3, low=0.7),
    "token_filter": RolloutCorrection("token", "mask", high=1.3, low=0.7, weighted=False),
    "seq_tis": RolloutCorrection("sequence", "truncate", high=2.0),
    "seq_mis": RolloutCorrection("sequence", "mask", high=3.0, low=0.3),
    "seq_geo_mis": RolloutCorrection("sequence", "mask", high=1.2, low=0.8, sequence_agg="mean"),
}
# ratio base of the objective: "old" with the stream, "sg" on-policy (no stream), "inf" (ratio="rollout")
BASES = ("old", "sg", "inf")


def objective_of(correction: RolloutCorrection, base: str) -> PolicyGradient:
    ratio = "rollout" if base == "inf" else "old"
    return PolicyGradient(PPOClip(0.2, 0.28), ratio=ratio, penalties=(KLPenalty(0.05),), correction=correction)


def paper_loss(seq, c: RolloutCorrection, base: str) -> torch.Tensor:
    """One sequence: ``Σ_t w_t (−c_t · min(r_t A, clip(r_t) A) + β k3(ref − trn))`` with ``c`` the
    importance weight of the rollout mismatch (π_old / π_rollout, or π_θ / π_rollout detached)."""
    trn = seq.trn
    denominator = {"old": seq.old, "sg": trn.detach(), "inf": seq.inf}[base]
    ratio = (trn - denominator).exp()
    pg = torch.min(ratio * seq.adv, ratio.clamp(0.8, 1.28) * seq.adv)
    numerator = seq.old if base == "old" else trn.detach()
    log_rho = numerator - seq.inf
    if c.level == "sequence":
        total = log_rho.sum() if c.sequence_agg == "sum" else log_rho.mean()
        log_rho = total.expand_as(log_rho)
    rho = log_rho.exp()
    low = 0.0 if c.low is None else c.low
    if c.mode == "truncate":
        weight = rho.clamp(min=low, max=c.high)
    else:
        inside = (rho >= low) & (rho <= c.high)
        weight = torch.where(inside, rho if c.weighted else torch.ones_like(rho), torch.zeros_like(rho))
    x = seq.ref - trn
    kl = x.exp() - x - 1
    return ((-weight * pg + 0.05 * kl) * seq.w).sum()


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("name", sorted(CORRECTIONS))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=packings())
def test_correction_matches_reference(name, base, case):
    c = CORRECTIONS[name]
    check_against_paper(objective_of(c, base), lambda seq: paper_loss(seq, c, base), case, with_old=base == "old")


def test_correction_is_constant_in_theta():
    """The gradient of a corrected loss is the weight times the uncorrected per-token gradient."""
    streams = with_old(bin_of("hot", seed=4))
    c = RolloutCorrection("token", "truncate", high=1.1)
    plain = PolicyGradient(PPOClip())
    corrected = PolicyGradient(PPOClip(), correction=c)
    result = compute_loss(streams.plan(corrected), streams.outputs())
    (g,) = torch.autograd.grad(result.loss, streams.trainer_logprobs)
    (g_plain,) = torch.autograd.grad(
        compute_loss(streams.plan(plain), streams.outputs()).loss, streams.trainer_logprobs
    )
    m = streams.loss_mask
    rho = (streams.old_logprobs - streams.inference_logprobs).exp().clamp(max=1.1)
    torch.testing.assert_close(g[m], (g_plain * rho)[m])
    assert (rho[m] < 1.1).any() and (rho[m] == 1.1).any()  # both branches occur in this data


def test_correction_metrics():
    streams = with_old(bin_of("hot", seed=5))
    c = RolloutCorrection("token", "mask", high=1.05, low=0.95)
    out = compute_loss(streams.plan(PolicyGradient(PPOClip(), correction=c)), streams.outputs())
    m = streams.loss_mask
    rho = (streams.old_logprobs - streams.inference_logprobs).exp()[m]
    outside = ((rho > 1.05) | (rho < 0.95)).double().mean()
    assert out.metrics["rl/rollout_is_masked"].item() == pytest.approx(outside.item(), rel=1e-6)
    weight = torch.where((rho > 1.05) | (rho < 0.95), 0.0, rho).mean()
    assert out.metrics["rl/rollout_is_weight"].item() == pytest.approx(weight.item(), rel=1e-6)
    assert 0 < outside < 1


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_correction_is_nan_safe_and_sync_free(name):
    objective = objective_of(CORRECTIONS[name], "old")
    clean = with_old(bin_of("sdft", seed=2))
    poisoned, _, _ = poison_non_members(clean)
    out_clean = compute_loss(clean.plan(objective), clean.outputs())
    out_poisoned = compute_loss(poisoned.plan(objective), poisoned.outputs())
    assert torch.equal(out_clean.loss, out_poisoned.loss)
    (g_clean,) = torch.autograd.grad(out_clean.loss, clean.trainer_logprobs)
    (g_poisoned,) = torch.autograd.grad(out_poisoned.loss, poisoned.trainer_logprobs)
    assert torch.equal(g_clean, g_poisoned)
    totals = set()
    for num_seqs in (1, 16, 256):
        streams = with_old(bin_of("sdft", num_tokens=1024, num_seqs=num_seqs, seed=3))
        plan = streams.plan(objective)  # built before the forward, outside the hot path
        with OpCounter() as counter:
            compute_loss(plan, streams.outputs()).loss.backward()
        assert counter.num_syncs == 0, counter.syncs
        totals.add(counter.total)
    assert len(totals) == 1, totals


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(level="batch"), ValueError, "RolloutCorrection.level must be one of"),
        (dict(mode="clip"), ValueError, "RolloutCorrection.mode must be one of"),
        (dict(high=0.0), ValueError, "RolloutCorrection.high must be > 0"),
        (dict(high=float("nan")), ValueError, "RolloutCorrection.high must be finite"),
        (dict(low=2.0, high=1.0), ValueError, "RolloutCorrection.low must be in"),
        (dict(low="0.5"), TypeError, "RolloutCorrection.low must be a number"),
        (dict(sequence_agg="max"), ValueError, "RolloutCorrection.sequence_agg must be one of"),
        (dict(weighted=1), TypeError, "RolloutCorrection.weighted must be a bool"),
    ],
)
def test_correction_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        RolloutCorrection(**kwargs)


def test_correction_needs_the_rollout_stream():
    streams = bin_of("hot").replace(inference_logprobs=None)
    with pytest.raises((ValueError, TypeError), match="rollout_logprobs"):
        streams.plan(PolicyGradient(correction=RolloutCorrection()))


def opsm_paper_loss(seq, threshold: float, against: str) -> torch.Tensor:
    """One sequence under off-policy sequence masking: the PPO clip term is dropped when the sequence's
    advantage is negative and ``mean(base − sg(trn)) > threshold``; the KL penalty stays."""
    trn = seq.trn
    ratio = (trn - seq.inf).exp()
    pg = torch.min(ratio * seq.adv, ratio.clamp(0.8, 1.28) * seq.adv)
    base = seq.inf if against == "rollout" else (trn.detach() if seq.old is None else seq.old)
    drifted = (base - trn.detach()).mean() > threshold
    keep = (seq.adv >= 0) | ~drifted
    x = seq.ref - trn
    return ((-torch.where(keep, pg, 0.0) + 0.05 * (x.exp() - x - 1)) * seq.w).sum()


@pytest.mark.parametrize("against, with_old_stream", [("rollout", False), ("old", True), ("old", False)])
@pytest.mark.parametrize("threshold", [-0.05, 0.1])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=packings())
def test_off_policy_mask_matches_reference(against, with_old_stream, threshold, case):
    opm = OffPolicyMask(threshold, against)
    objective = PolicyGradient(PPOClip(0.2, 0.28), ratio="rollout", penalties=(KLPenalty(0.05),), off_policy_mask=opm)
    check_against_paper(
        objective, lambda seq: opsm_paper_loss(seq, threshold, against), case, with_old=with_old_stream, rtol=1e-9
    )


def test_off_policy_mask_drops_what_it_reports_nan_safe_and_sync_free():
    clean = with_old(bin_of("sdft", seed=7))
    objective = PolicyGradient(PPOClip(), off_policy_mask=OffPolicyMask(0.0))
    plan = clean.plan(objective)
    out = compute_loss(plan, clean.outputs())
    m, adv = plan.members["rl"], clean.advantages
    drift = torch.zeros(m.shape, dtype=torch.float64)
    ends = list(itertools.accumulate(clean.seq_lens))
    for start, end in zip([0, *ends[:-1]], ends, strict=True):
        sel = m[start:end]
        if sel.any():
            x = (clean.inference_logprobs - clean.trainer_logprobs.detach())[start:end][sel]
            drift[start:end] = x.mean()
    dropped = m & (adv < 0) & (drift > 0)
    assert 0 < int(dropped.sum()) < int((m & (adv < 0)).sum())  # the mask binds on some negative tokens, not all
    expected = dropped[m].double().mean()
    assert out.metrics["rl/off_policy_masked"].item() == pytest.approx(expected.item(), rel=1e-6)
    poisoned, _, _ = poison_non_members(clean)
    out_poisoned = compute_loss(poisoned.plan(objective), poisoned.outputs())
    assert torch.equal(out.loss, out_poisoned.loss)
    totals = set()
    for num_seqs in (1, 16, 256):
        streams = with_old(bin_of("sdft", num_tokens=1024, num_seqs=num_seqs, seed=3))
        plan = streams.plan(objective)
        with OpCounter() as counter:
            compute_loss(plan, streams.outputs()).loss.backward()
        assert counter.num_syncs == 0, counter.syncs
        totals.add(counter.total)
    assert len(totals) == 1, totals


def test_off_policy_mask_validation():
    with pytest.raises(ValueError, match="OffPolicyMask.threshold must be finite"):
        OffPolicyMask(float("nan"))
    with pytest.raises(ValueError, match="OffPolicyMask.against must be one of"):
        OffPolicyMask(0.1, "ref")
    with pytest.raises(TypeError, match="off_policy_mask must be an OffPolicyMask"):
        PolicyGradient(off_policy_mask=0.1)
    streams = bin_of("hot").replace(inference_logprobs=None)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        streams.plan(PolicyGradient(off_policy_mask=OffPolicyMask(0.1)))
