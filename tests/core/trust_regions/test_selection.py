"""Step-wide token selection (Clip-Cov, KL-Cov, M2PO): against a per-step reference written from the
papers' formulas with Python loops and sorting, over hypothesis-drawn packings split into random bins;
several bins = one bin; two gloo ranks = one process; NaN-safe; sync-free and flat; deterministic
where verl's Clip-Cov is random."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import bin_of, draw_bin, packings, poison_non_members, with_old
from packloss import (
    Component,
    Outputs,
    Plan,
    PolicyGradient,
    compute_loss,
    count_denominators,
    merge_metrics,
)
from packloss.core.trust_regions import M2PO, ClipCov, KLCov, PPOClip
from packloss.testing import OpCounter, run_gloo

# name → (objective, whether the plan carries old_logprobs)
OBJECTIVES = {
    "clip_cov": (PolicyGradient(ClipCov(0.2, 0.02, 0.6, 0.2, 0.28)), True),
    # ratio="rollout" with an old stream: r̂ = exp(old − inf) ≠ 1, so tokens clipped at r̂ are no candidates
    "clip_cov_rollout": (PolicyGradient(ClipCov(0.3, -0.5, 0.5, 0.1, 0.1), ratio="rollout"), True),
    "kl_cov": (PolicyGradient(KLCov(0.2, 0.5)), True),
    "kl_cov_on_policy": (PolicyGradient(KLCov(0.1, 1.0)), False),  # p = inf, ratio sg(trn)
    "kl_cov_rollout_coef": (PolicyGradient(KLCov(0.3, 2.0), ratio="rollout", adv_coef=0.5), True),
    "m2po": (PolicyGradient(M2PO(0.01), ratio="rollout"), True),
    "m2po_old": (PolicyGradient(M2PO(0.003)), True),
}


# ---------------------------------------------------------------------------------------------------
# The reference: the step's selection with Python loops and sorting, then each sequence's loss
# ---------------------------------------------------------------------------------------------------


def reference_selection(objective: PolicyGradient, b, has_old: bool) -> set[int]:
    """Token indices selected over the whole step, from the papers' definitions (Python floats)."""
    region = objective.trust_region
    weights = b.weights
    members = [t for t in range(len(b.mask)) if b.mask[t] and (weights is None or weights[t] != 0)]
    if not members:
        return set()
    adv = {t: float(b.adv[t]) for t in members}
    p = {t: float(b.old[t] if has_old else b.inf[t]) for t in members}
    count = len(members)
    if isinstance(region, M2PO):
        # Zheng et al.: drop the largest (log π_old/π_behav)² until the kept mean is ≤ τ; ties with the
        # last dropped value go too (the documented tie rule: the choice must not depend on positions).
        x = {t: (float(b.old[t]) - float(b.inf[t])) ** 2 for t in members}
        order = sorted(members, key=lambda t: -x[t])
        dropped = 0
        while dropped < count and sum(x[t] for t in order[dropped:]) / (count - dropped) > region.m2_threshold:
            dropped += 1
        if dropped == 0:
            return set()
        last = x[order[dropped - 1]]
        return {t for t in members if x[t] >= last}
    # Cui et al.: the centred product of advantage and log-prob, means over the step's members
    a_bar = sum(adv.values()) / count
    p_bar = sum(p.values()) / count
    cov = {t: (adv[t] - a_bar) * (p[t] - p_bar) for t in members}
    if isinstance(region, ClipCov):
        candidates = []
        for t in members:
            r_hat = math.exp(p[t] - float(b.inf[t])) if objective.ratio == "rollout" else 1.0
            a = objective.adv_coef * adv[t]
            clipped = (a > 0 and r_hat > 1 + region.clip_high) or (a < 0 and r_hat < 1 - region.clip_low)
            if region.clip_cov_lb < cov[t] < region.clip_cov_ub and not clipped:
                candidates.append(t)
        k = max(1, int(region.clip_cov_ratio * count))
    else:
        candidates = list(members)
        k = max(1, int(region.kl_cov_ratio * count))
    ranked = sorted(candidates, key=lambda t: -cov[t])
    if len(ranked) <= k:
        return set(ranked)
    kth = cov[ranked[k - 1]]
    return {t for t in candidates if cov[t] >= kth}


def reference_loss(objective: PolicyGradient, b, has_old: bool) -> tuple[torch.Tensor, set[int]]:
    """The step's token-mean loss ``Σ_t w_t ℓ_t / M`` summed sequence by sequence with plain autograd."""
    region = objective.trust_region
    selected = reference_selection(objective, b, has_old)
    n_members = 0
    total = b.trn.sum() * 0
    start = 0
    for length in b.lens:
        for t in range(start, start + length):
            w = 1.0 if b.weights is None else float(b.weights[t])
            if not b.mask[t] or w == 0:
                continue
            n_members += 1
            trn = b.trn[t]
            if objective.ratio == "rollout":
                base = b.inf[t]
            else:
                base = b.old[t] if has_old else trn.detach()
            log_r = trn - base
            r = log_r.exp()
            a = objective.adv_coef * b.adv[t]
            if isinstance(region, ClipCov):  # PPO clip, the selected tokens' gradient zeroed
                j = torch.min(r * a, r.clamp(1 - region.clip_low, 1 + region.clip_high) * a)
                j = j * 0 if t in selected else j
            elif isinstance(region, KLCov):  # no clip; |log r| penalty on the selected tokens
                j = r * a - (region.ppo_kl_coef * log_r.abs() if t in selected else 0)
            else:  # M2PO: the kept tokens' importance-weighted policy gradient
                j = r * a * (0 if t in selected else 1)
            total = total + w * -j
        start += length
    return total / max(n_members, 1), selected


# ---------------------------------------------------------------------------------------------------
# The engine over a random split of the step into bins
# ---------------------------------------------------------------------------------------------------


def split_bins(lens: list[int], seed: int, num_bins: int | None = None) -> list[list[int]]:
    """The sequences shuffled and cut into 1..3 contiguous bins (or ``num_bins``)."""
    rng = random.Random(seed)
    order = list(range(len(lens)))
    rng.shuffle(order)
    num_bins = num_bins or rng.randint(1, min(3, len(lens)))
    cuts = sorted(rng.sample(range(1, len(lens)), num_bins - 1)) if num_bins > 1 else []
    return [order[i:j] for i, j in zip([0, *cuts], [*cuts, len(lens)], strict=True)]


def engine_bins(objective, b, has_old: bool, bins: list[list[int]], normalize: str = "token"):
    """``[(plan, outputs)]`` of each bin (its tokens index the step's streams; ``trn`` stays one leaf)."""
    starts = [0]
    for length in b.lens:
        starts.append(starts[-1] + length)
    parts = []
    for seqs in bins:
        idx = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in seqs])
        comp = Component(objective, b.mask[idx], None if b.weights is None else b.weights[idx], normalize)
        plan = Plan([b.lens[s] for s in seqs], {"rl": comp}, b.inf[idx], b.ref[idx], b.adv[idx],
                    old_logprobs=b.old[idx] if has_old else None)  # fmt: skip
        parts.append((plan, Outputs(logprobs=b.trn[idx])))
    return parts


def engine_step(objective, b, has_old: bool, bins: list[list[int]], step: bool = True):
    """``(loss, gradient, number selected)`` of the step with step denominators (or per-bin ones)."""
    parts = engine_bins(objective, b, has_old, bins)
    den = count_denominators([p for p, _ in parts]) if step else None
    results = [compute_loss(p, o, den) for p, o in parts]
    loss = sum(r.loss for r in results)
    (grad,) = torch.autograd.grad(loss, b.trn)
    key = "rl/is_masked" if isinstance(objective.trust_region, M2PO) else "rl/cov_selected"
    selected = sum(round(float(r.metrics[key] * r.counts[key])) for r in results)
    return loss, grad, selected


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=packings(), split=st.integers(0, 2**16))
def test_matches_step_reference(name, case, split):
    objective, has_old = OBJECTIVES[name]
    b = draw_bin(*case)
    expected, selected = reference_loss(objective, b, has_old)
    (grad_ref,) = torch.autograd.grad(expected, b.trn, allow_unused=True)
    grad_ref = torch.zeros_like(b.trn) if grad_ref is None else grad_ref
    loss, grad, n_selected = engine_step(objective, b, has_old, split_bins(case[0], split))
    assert n_selected == len(selected)
    assert abs(loss.item() - expected.item()) <= 1e-9 * max(1.0, abs(expected.item())), (loss.item(), expected.item())
    assert torch.allclose(grad, grad_ref, rtol=1e-9, atol=1e-12), (grad - grad_ref).abs().max()


def test_reference_selects_something():
    """The hypothesis cases exercise the selection: over many packings each region selects tokens."""
    for name, (objective, has_old) in OBJECTIVES.items():
        sizes = [len(reference_selection(objective, draw_bin([6, 9, 4, 10], seed, [False] * 4, False), has_old))
                 for seed in range(20)]  # fmt: skip
        assert sum(sizes) > 0 and any(s > 1 for s in sizes), (name, sizes)


# ---------------------------------------------------------------------------------------------------
# Packing invariance, and what per-micro-batch selection (verl's) would give instead
# ---------------------------------------------------------------------------------------------------


def big_case(seed: int = 7) -> SimpleNamespace:
    lens = [random.Random(seed + i).randint(3, 30) for i in range(24)]
    return draw_bin(lens, seed, [i % 7 == 3 for i in range(24)], True)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_several_bins_equal_one_bin(name):
    objective, has_old = OBJECTIVES[name]
    b = big_case()
    whole_loss, whole, whole_selected = engine_step(objective, b, has_old, [list(range(len(b.lens)))])
    assert whole_selected > 1 and whole.abs().sum() > 0
    for seed, num_bins in ((1, 2), (2, 4), (3, 7)):
        loss, grad, selected = engine_step(objective, b, has_old, split_bins(b.lens, seed, num_bins))
        assert selected == whole_selected
        assert torch.allclose(grad, whole, rtol=1e-12, atol=1e-15), (num_bins, (grad - whole).abs().max())
        assert torch.allclose(loss, whole_loss, rtol=1e-12)
    # without step denominators every bin selects over itself (verl's per-micro-batch choice): it differs
    _, per_bin, _ = engine_step(objective, b, has_old, split_bins(b.lens, 2, 4), step=False)
    _, one_bin, _ = engine_step(objective, b, has_old, [list(range(len(b.lens)))], step=False)
    assert torch.equal(one_bin, whole)  # one bin alone: its own statistics are the step's
    assert not torch.allclose(per_bin, whole, rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------------------------------------------
# Clip-Cov: deterministic where verl draws at random; ties
# ---------------------------------------------------------------------------------------------------


def _band_case():
    """10 on-policy tokens, all inside the (1, 5) covariance band with distinct covariances."""
    adv = torch.tensor([3.0, 3.0, 3.0, 3.0, 3.0, -3.0, -3.0, -3.0, -3.0, -3.0], dtype=torch.float64)
    logp = torch.tensor([-0.1, -0.25, -0.33, -0.47, -0.52, -2.03, -2.21, -2.38, -2.66, -2.71], dtype=torch.float64)
    cov = (adv - adv.mean()) * (logp - logp.mean())
    return adv, logp, cov


def test_clip_cov_takes_the_largest_covariances_where_verl_draws_at_random():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    adv, logp, cov = _band_case()
    band = ((cov > 1) & (cov < 5)).nonzero().flatten().tolist()
    assert len(band) == 10 and len(set(cov.tolist())) == 10  # more band tokens than k = ⌊0.2 · 10⌋ = 2
    region = ClipCov(clip_cov_ratio=0.2)  # verl's defaults otherwise: lb 1, ub 5, clip 0.2
    trn = logp.clone().requires_grad_()
    plan = Plan([10], {"rl": Component(PolicyGradient(region), torch.ones(10, dtype=torch.bool))},
                advantages=adv, old_logprobs=logp)  # fmt: skip
    ours = []
    for _ in range(3):
        (grad,) = torch.autograd.grad(compute_loss(plan, Outputs(logprobs=trn)).loss, trn)
        ours.append(frozenset((grad == 0).nonzero().flatten().tolist()))
    top2 = frozenset(sorted(band, key=lambda t: -cov[t].item())[:2])
    assert ours == [top2] * 3  # deterministic: the two band tokens of largest covariance
    config = SimpleNamespace(
        policy_loss=SimpleNamespace(clip_cov_ratio=0.2, clip_cov_lb=1.0, clip_cov_ub=5.0),
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, global_batch_info={},
    )  # fmt: skip
    theirs = set()
    for seed in range(12):
        torch.manual_seed(seed)
        log_prob = logp[None].clone().requires_grad_()
        loss, _ = core_algos.compute_policy_loss_clip_cov(
            logp[None], log_prob, adv[None], torch.ones(1, 10), config=config
        )
        (grad,) = torch.autograd.grad(loss, log_prob)
        picked = frozenset((grad[0] == 0).nonzero().flatten().tolist())
        assert len(picked) == 2 and picked <= set(band)  # the same count, from the same band
        theirs.add(picked)
    assert len(theirs) > 1  # verl's choice changes with the seed ...
    assert theirs != {top2}  # ... and is not ours: the difference is the deterministic choice


def test_ties_at_the_threshold_are_all_selected():
    """Two members share the largest covariance: both are selected (k = 1), whatever the packing."""
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    logp = torch.tensor([-0.5, -0.5, -0.5, -1.5, -1.5, -1.0], dtype=torch.float64)
    trn = logp.clone().requires_grad_()
    mask = torch.ones(6, dtype=torch.bool)
    for lens in ([6], [2, 4], [1, 1, 1, 3]):
        plan = Plan(lens, {"rl": Component(PolicyGradient(KLCov(0.1, 1.0)), mask)}, advantages=adv,
                    old_logprobs=logp)  # fmt: skip
        out = compute_loss(plan, Outputs(logprobs=trn), count_denominators([plan]))
        # cov = A (p − p̄), p̄ = −11/12: 5/12 (×3), 7/12 (×2, the largest, tied), 1/12
        assert out.metrics["rl/cov_selected"].item() * 6 == pytest.approx(2)
    plan = Plan([6], {"rl": Component(PolicyGradient(ClipCov(0.1, 0.0, 1.0)), mask)}, advantages=adv,
                old_logprobs=logp)  # fmt: skip
    assert compute_loss(plan, Outputs(logprobs=trn)).metrics["rl/cov_selected"].item() * 6 == pytest.approx(2)


def test_m2po_keeps_the_second_moment_under_its_threshold():
    b = big_case(3)
    objective = PolicyGradient(M2PO(0.004), ratio="rollout")
    parts = engine_bins(objective, b, True, split_bins(b.lens, 5, 3))
    den = count_denominators([p for p, _ in parts])
    results = [compute_loss(p, o, den) for p, o in parts]
    metrics, _ = merge_metrics(results)
    assert metrics["rl/m2"].item() > 0.004  # something to drop ...
    assert 0 < metrics["rl/is_masked"].item() < 1
    assert metrics["rl/m2_kept"].item() <= 0.004  # ... and the kept second moment is within τ


# ---------------------------------------------------------------------------------------------------
# Two ranks = one process
# ---------------------------------------------------------------------------------------------------

DIST_NAMES = ("clip_cov", "kl_cov", "m2po")


def _gloo_worker(rank, world_size):
    b = big_case()
    bins = split_bins(b.lens, 4, 5)
    out = {}
    for name in DIST_NAMES:
        objective, has_old = OBJECTIVES[name]
        parts = engine_bins(objective, b, has_old, bins)[rank::world_size]
        with OpCounter() as counter:
            den = count_denominators([p for p, _ in parts], all_reduce=True, max_rank_tokens=sum(b.lens), check=False)
        collectives = {op: n for op, n in counter.ops.items() if "allreduce" in op or "allgather" in op}
        total = sum(compute_loss(p, o, den).loss for p, o in parts)
        (grad,) = torch.autograd.grad(total, b.trn)
        out[name] = (grad, collectives, counter.num_syncs)
        # a rank without micro-batches joins with modes= and objectives=
        mine = engine_bins(objective, b, has_old, bins)[0::2] if rank == 0 else []
        den = count_denominators([p for p, _ in mine], all_reduce=True, modes={"rl": "token"},
                                 objectives={"rl": objective}, max_rank_tokens=sum(b.lens))  # fmt: skip
        total = sum((compute_loss(p, o, den).loss for p, o in mine), b.trn.sum() * 0)
        (out[name + "/empty"],) = torch.autograd.grad(total, b.trn)
    dist.barrier()
    return out


def test_two_ranks_equal_one_process():
    ranks = run_gloo(_gloo_worker, world_size=2, timeout=240)
    b = big_case()
    bins = split_bins(b.lens, 4, 5)
    for name in DIST_NAMES:
        objective, has_old = OBJECTIVES[name]
        _, single, _ = engine_step(objective, b, has_old, bins)
        split = ranks[0][name][0] + ranks[1][name][0]
        assert torch.allclose(split, single, rtol=1e-12, atol=1e-15), name
        for rank in ranks:
            _, collectives, syncs = rank[name]
            all_reduces = sum(n for op, n in collectives.items() if "allreduce" in op)
            gathers = sum(n for op, n in collectives.items() if "allgather" in op)
            assert (all_reduces, gathers) == (1, 1), collectives  # the counts' all_reduce and one all_gather
            assert syncs == 0
        # rank 0 alone holds the even bins; rank 1 none: the step is the even bins
        _, even, _ = engine_step(objective, b, has_old, bins[0::2])
        assert torch.allclose(ranks[0][name + "/empty"] + ranks[1][name + "/empty"], even, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------------------------------------
# NaN safety, syncs and op counts
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@pytest.mark.parametrize("step", [False, True])
def test_nan_safe(name, step):
    objective, has_old = OBJECTIVES[name]
    clean = with_old(bin_of("sdft", seed=2)) if has_old else bin_of("sdft", seed=2)
    poisoned, _, _ = poison_non_members(clean)
    outs = []
    for streams in (clean, poisoned):
        plan = streams.plan(objective)
        den = count_denominators([plan]) if step else None
        out = compute_loss(plan, streams.outputs(), den)
        (grad,) = torch.autograd.grad(out.loss, streams.trainer_logprobs)
        outs.append((out, grad))
    (out_clean, g_clean), (out_poisoned, g_poisoned) = outs
    assert torch.isfinite(g_poisoned).all() and torch.isfinite(out_poisoned.loss)
    assert torch.equal(out_clean.loss, out_poisoned.loss)
    assert torch.equal(g_clean, g_poisoned)
    for key, value in out_clean.metrics.items():
        assert torch.equal(value, out_poisoned.metrics[key]), key


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@pytest.mark.parametrize("step", [False, True])
def test_sync_free_and_flat(name, step):
    objective, has_old = OBJECTIVES[name]
    totals = set()
    for num_seqs in (1, 16, 256):
        streams = bin_of("sdft", num_tokens=1024, num_seqs=num_seqs, seed=3)
        streams = with_old(streams) if has_old else streams
        plan = streams.plan(objective)
        with OpCounter() as counter:
            den = count_denominators([plan]) if step else None
            compute_loss(plan, streams.outputs(), den, per_sequence_metrics=True).loss.backward()
        assert counter.num_syncs == 0, counter.syncs
        totals.add(counter.total)
    assert len(totals) == 1, totals


# ---------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: ClipCov(clip_cov_ratio=0.0), ValueError, "ClipCov.clip_cov_ratio must be in"),
        (lambda: ClipCov(clip_cov_ratio=1.5), ValueError, "ClipCov.clip_cov_ratio must be in"),
        (lambda: ClipCov(clip_cov_lb=5.0, clip_cov_ub=1.0), ValueError, "clip_cov_lb < clip_cov_ub"),
        (lambda: ClipCov(clip_cov_ub=float("nan")), ValueError, "ClipCov.clip_cov_ub must be finite"),
        (lambda: ClipCov(clip_low=1.0), ValueError, "ClipCov.clip_low must be in"),
        (lambda: ClipCov(clip_high=-0.1), ValueError, "ClipCov.clip_high must be >= 0"),
        (lambda: KLCov(kl_cov_ratio=-0.1), ValueError, "KLCov.kl_cov_ratio must be in"),
        (lambda: KLCov(ppo_kl_coef=-1.0), ValueError, "KLCov.ppo_kl_coef must be >= 0"),
        (lambda: KLCov(ppo_kl_coef=float("inf")), ValueError, "KLCov.ppo_kl_coef must be finite"),
        (lambda: KLCov(kl_cov_ratio="0.1"), TypeError, "KLCov.kl_cov_ratio must be a number"),
        (lambda: M2PO(-0.1), ValueError, "M2PO.m2_threshold must be >= 0"),
        (lambda: M2PO(float("nan")), ValueError, "M2PO.m2_threshold must be finite"),
    ],
)
def test_validation(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_missing_streams_and_live_advantages_are_errors():
    streams = bin_of("sdft", seed=1)
    outputs = streams.outputs()
    with pytest.raises(ValueError, match="M2PO .* needs the plan's old_logprobs and rollout_logprobs"):
        compute_loss(streams.plan(PolicyGradient(M2PO())), outputs)
    with pytest.raises(ValueError, match="KLCov reads the advantages before the forward: .* advantage='shipped'"):
        count_denominators([streams.plan(PolicyGradient(KLCov(), advantage="ref_kl"))])
    plan = Plan(streams.seq_lens, {"rl": Component(PolicyGradient(ClipCov()), streams.loss_mask)},
                advantages=streams.advantages)  # fmt: skip
    with pytest.raises(ValueError, match="ClipCov reads old_logprobs .* the plan has neither"):
        compute_loss(plan, outputs)


def test_denominators_must_carry_the_selection():
    streams = with_old(bin_of("sdft", seed=1))
    outputs = streams.outputs()
    clip_cov = streams.plan(PolicyGradient(ClipCov(0.1)))
    with pytest.raises(ValueError, match="'rl' selects tokens over the step .* hold no selection"):
        compute_loss(clip_cov, outputs, count_denominators([streams.plan(PolicyGradient(PPOClip()))]))
    with pytest.raises(
        ValueError, match="clip_cov_ratio=0.1.* hold PolicyGradient\\(trust_region=ClipCov\\(clip_cov_ratio=0.2"
    ):
        compute_loss(clip_cov, outputs, count_denominators([streams.plan(PolicyGradient(ClipCov(0.2)))]))
    with pytest.raises(ValueError, match="every micro-batch of a step must select the same way"):
        count_denominators([clip_cov, streams.plan(PolicyGradient(ClipCov(0.1), ratio="rollout"))])
    with pytest.raises(ValueError, match="needs max_rank_tokens="):  # raised before any collective
        count_denominators([clip_cov], all_reduce=True)
    with pytest.raises(ValueError, match="tokens > max_rank_tokens=10"):
        count_denominators([clip_cov], all_reduce=True, max_rank_tokens=10)
    with pytest.raises(ValueError, match="objectives\\['kl'\\] is not a component"):
        count_denominators([clip_cov], objectives={"kl": PolicyGradient(KLCov())})
