"""packloss.core.sampler: DistributionalIPO and ScoreCentering equal a per-token float64 transcription
of prime-rl's ``DistributionalIPOLoss`` / ``ScoreCenteringLoss`` math (written here from its source,
summed per sequence with its ``loss_weights`` and divided as the mode says) over hypothesis bins —
loss, gradients w.r.t. the trainer's ``logprobs`` and ``topk_logprobs``, metrics — with NaN on every
non-member and pad; prime-rl's own test cases; the fused head (``logprobs_at``) equal to dense logits;
no sync, an op count flat in the sequences, float32 at least."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packloss import Component, KLPenalty, Outputs, Plan, PolicyGradient, compute_loss
from packloss.core.sampler import DistributionalIPO, ScoreCentering, check_candidates
from packloss.core.trust_regions import IPOMask
from packloss.testing import OpCounter
from packloss.vocab import linear_logprobs, logprobs_at

F64 = torch.float64
NAN = float("nan")
SUMMED = {"normalize": "constant", "constant": 1.0}  # prime-rl's per-token sum (its scale divides later)


# ---------------------------------------------------------------------------------------------------
# The reference: prime-rl's per-token math, one token at a time over its valid candidates
# ---------------------------------------------------------------------------------------------------


def _mismatch(trn, inf):
    x = trn.item() - inf.item()
    return torch.tensor(x, dtype=F64).exp().item() - x - 1


def _ref_dipo_token(lp, lq, trn, inf, adv, obj):
    """prime-rl's distributional IPO of one member token: ``lp`` / ``lq`` the trainer's / sampler's
    log-probs of its valid candidates (1-d). Returns ``(loss, metrics)``."""
    p, q = lp.exp(), lq.exp()
    p_tail = (1.0 - p.sum()).clamp_min(0.0)
    q_tail = (1.0 - q.sum()).clamp_min(0.0)
    tv = 0.5 * ((p.detach() - q).abs().sum() + (p_tail.detach() - q_tail).abs())
    masked = bool(tv > obj.eps)
    pg = 0.0 * trn if masked else -(obj.adv_tau * adv * torch.exp(trn - inf))
    tail = p_tail.clamp_min(1e-8).log() - q_tail.clamp_min(1e-8).log()
    squared = (q * (lp - lq).square()).sum() + q_tail * tail.square()
    metrics = {"is_masked": float(masked), "total_variation": float(tv), "squared_log_ratio": squared.item(),
               "head_mass": float(q.sum()), "mismatch": _mismatch(trn, inf)}  # fmt: skip
    return pg + obj.kl_tau * squared, metrics


def _ref_sc_token(lp, lq, trn, inf, adv, entropy, obj):
    """prime-rl's score centering of one member token (``entropy`` the trainer's, a constant)."""
    q, p = lq.exp(), lp.exp()
    q_tail = (1.0 - q.sum()).clamp_min(0.0)
    p_tail = (1.0 - p.detach().sum()).clamp_min(1e-6)
    alpha = (q_tail / p_tail).detach()
    residual = (q - alpha * p).detach()
    center = (residual * lp).sum() + alpha * (-entropy)
    metrics = {"head_mass": float(q.sum()), "rho": float(alpha), "mismatch": _mismatch(trn, inf)}
    return -adv * (trn - center), metrics


def _reference(b, obj, normalize):
    """The term ``Σ_t w_t ℓ_t / D`` over the members, sequence by sequence, and each metric's
    per-member values; ``D`` 1 (``constant``), the member count (``token``, prime-rl's ``rl_scale``) or the
    per-sequence means over the sequences with members (``sequence_mean``)."""
    seq_terms, values, start = [], {}, 0
    for length in b.lens:
        parts = []
        for t in range(start, start + length):
            if not b.member[t]:
                continue
            cols = [k for k in range(b.k) if b.ids[t, k] >= 0]
            lp, lq = b.topk_leaf[t, cols], b.lq[t, cols]
            if isinstance(obj, DistributionalIPO):
                loss, m = _ref_dipo_token(lp, lq, b.trn_leaf[t], b.inf[t], b.adv[t], obj)
            else:
                loss, m = _ref_sc_token(lp, lq, b.trn_leaf[t], b.inf[t], b.adv[t], b.entropy[t], obj)
            parts.append(b.weights[t] * loss)
            for key, value in m.items():
                values.setdefault(key, []).append(value)
        if parts:
            seq_terms.append((sum(parts), len(parts)))
        start += length
    if normalize == "constant":
        total = sum(s for s, _ in seq_terms)
    elif normalize == "token":
        total = sum(s for s, _ in seq_terms) / sum(n for _, n in seq_terms)
    else:
        total = sum(s / n for s, n in seq_terms) / len(seq_terms)
    return total, values


# ---------------------------------------------------------------------------------------------------
# Bins
# ---------------------------------------------------------------------------------------------------


def _bin(lens, k, v, seed, *, tail="open", drift=0.5, holes=0.3, pads=0.3, weighted=True, dtype=F64):
    """A packed bin: trainer and sampler distributions over ``v`` tokens, the sampler's top-``k`` ids
    (some ``−1``; every member keeps one), the sampled token drawn from the sampler. ``tail="tiny"``
    puts all but ~1e-7 of both distributions on ``k`` ids; ``v == k`` is a head holding everything."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    logits = torch.randn(n, v, generator=g, dtype=F64)
    if tail == "tiny":
        logits[torch.arange(n)[:, None], torch.randperm(v, generator=g)[:k]] += 18.0
    sampler = logits + drift * torch.randn(n, v, generator=g, dtype=F64)
    lp_full, lq_full = logits.log_softmax(-1), sampler.log_softmax(-1)
    ids = lq_full.topk(k, -1).indices  # [N, K]
    pad = torch.rand(n, k, generator=g) < pads
    pad[:, 0] = False
    perm = torch.randperm(k, generator=g)
    ids, pad = ids[:, perm], pad[:, perm]
    weights = torch.where(torch.rand(n, generator=g) < 0.2, 0.0, torch.rand(n, generator=g, dtype=F64) + 0.5)
    weights = weights if weighted else torch.ones(n, dtype=F64)
    member = (torch.rand(n, generator=g) >= holes) & (weights != 0)
    one = torch.randint(n, (1,), generator=g)
    member[one], weights[one] = True, 1.0
    mask = member | ((weights == 0) & (torch.rand(n, generator=g) < 0.5))  # zero weights drop masked tokens
    ids = torch.where(pad | (~member[:, None] & (torch.rand(n, 1, generator=g) < 0.5)), -1, ids)
    y = torch.multinomial(lq_full.exp(), 1, generator=g).squeeze(-1)
    rows = torch.arange(n)
    topk = lp_full.gather(-1, ids.clamp_min(0))
    return SimpleNamespace(
        lens=list(lens), k=k, ids=ids, member=member, weights=weights, weighted=weighted,
        trn_leaf=lp_full[rows, y].to(dtype).requires_grad_(), topk_leaf=topk.to(dtype).requires_grad_(),
        lq=lq_full.gather(-1, ids.clamp_min(0)), inf=lq_full[rows, y], adv=torch.randn(n, generator=g, dtype=F64),
        entropy=-(lp_full.exp() * lp_full).sum(-1), mask=mask,
    )  # fmt: skip


def _poisoned(b, x):
    """``x`` with NaN on every non-member (and on the pads, for ``[N, K]``)."""
    keep = b.member if x.dim() == 1 else b.member[:, None] & (b.ids >= 0)
    return torch.where(keep, x, NAN)


def _plan(b, obj, **component):
    dtype = b.trn_leaf.dtype
    weights = b.weights.to(dtype) if b.weighted else None
    mask = b.mask if b.weighted else b.member
    comp = Component(obj, mask=mask, weights=weights, **component)
    return Plan(b.lens, {"pg": comp}, rollout_logprobs=_poisoned(b, b.inf).to(dtype),
                advantages=_poisoned(b, b.adv).to(dtype), rollout_topk_ids=b.ids,
                rollout_topk_logprobs=_poisoned(b, b.lq).to(dtype))  # fmt: skip


def _outputs(b):
    dtype = b.trn_leaf.dtype
    return Outputs(logprobs=_poisoned(b, b.trn_leaf), topk_logprobs=_poisoned(b, b.topk_leaf),
                   entropy=_poisoned(b, b.entropy).to(dtype))  # fmt: skip


def _packloss(b, obj, **component):
    result = compute_loss(_plan(b, obj, **component), _outputs(b))
    grads = torch.autograd.grad(result.loss, (b.trn_leaf, b.topk_leaf))
    return result, grads


def _assert_equal(b, obj, normalize, rtol=1e-9, atol=1e-10):
    component = SUMMED if normalize == "constant" else {"normalize": normalize}
    result, grads = _packloss(b, obj, **component)
    want, want_metrics = _reference(b, obj, normalize)
    want_grads = torch.autograd.grad(want, (b.trn_leaf, b.topk_leaf), allow_unused=True)
    torch.testing.assert_close(result.loss.double(), want.detach().double(), rtol=rtol, atol=atol)
    for got, expected in zip(grads, want_grads, strict=True):
        expected = torch.zeros_like(got) if expected is None else expected
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)

    def mean(values, keep=None):
        kept = [x for i, x in enumerate(values) if keep is None or keep[i]]
        return sum(kept) / max(len(kept), 1)

    want = {key: mean(values) for key, values in want_metrics.items() if key != "mismatch"}
    mismatch = want_metrics["mismatch"]
    if isinstance(obj, ScoreCentering):
        want["unmasked_mismatch_kl"] = mean(mismatch)
    else:
        dropped = [bool(x) for x in want_metrics["is_masked"]]
        want["masked_mismatch_kl"] = mean(mismatch, dropped)
        want["unmasked_mismatch_kl"] = mean(mismatch, [not d for d in dropped])
    want["empty_head"] = 0.0
    assert sorted(result.metrics) == sorted(["pg/loss", *(f"pg/{key}" for key in want)])
    for key, value in want.items():
        rel = max(rtol, 1e-6 if key in ("is_masked", "empty_head") else 1e-8)  # fractions: float32 counts
        assert result.metrics[f"pg/{key}"].item() == pytest.approx(value, rel=rel, abs=atol), key
    return result


@st.composite
def _cases(draw):
    lens = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    tail = draw(st.sampled_from(["open", "open", "tiny", "full"]))
    k = draw(st.sampled_from([1, 2, 3, 5]))
    if tail == "full":
        k = max(k, 2)
    v = k if tail == "full" else k + draw(st.integers(1, 6))
    return SimpleNamespace(
        lens=lens, k=k, v=v, tail=tail, seed=draw(st.integers(0, 2**31 - 1)),
        drift=draw(st.sampled_from([0.05, 0.5, 2.0])), holes=draw(st.sampled_from([0.0, 0.3])),
        pads=draw(st.sampled_from([0.0, 0.3])), weighted=draw(st.booleans()),
        normalize=draw(st.sampled_from(["constant", "constant", "token", "sequence_mean"])),
    )  # fmt: skip


def _case_bin(c, dtype=F64):
    return _bin(c.lens, c.k, c.v, c.seed, tail=c.tail, drift=c.drift, holes=c.holes, pads=c.pads,
                weighted=c.weighted, dtype=dtype)  # fmt: skip


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases(), eps=st.sampled_from([0.0, 0.05, 0.2, 1.0]), kl_tau=st.sampled_from([0.0, 0.3]),
       adv_tau=st.sampled_from([1.0, 0.5]))  # fmt: skip
def test_distributional_ipo_equals_prime_rls_math(case, eps, kl_tau, adv_tau):
    b = _case_bin(case)
    obj = DistributionalIPO(eps=eps, adv_tau=adv_tau, kl_tau=kl_tau)
    result = _assert_equal(b, obj, case.normalize)
    assert torch.isfinite(result.loss)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases())
def test_score_centering_equals_prime_rls_math(case):
    _assert_equal(_case_bin(case), ScoreCentering(), case.normalize)


@pytest.mark.parametrize("obj", [DistributionalIPO(eps=0.2, kl_tau=0.3), ScoreCentering()], ids=["dipo", "sc"])
def test_float32_streams_match_the_float64_reference(obj):
    """float32 leaves: the loss is float32 and within float32 rounding of the float64 reference."""
    b = _bin([4, 7, 3], 4, 11, seed=5, dtype=torch.float32)
    result = _assert_equal(b, obj, "token", rtol=2e-5, atol=2e-6)
    assert result.loss.dtype == torch.float32


@pytest.mark.parametrize("obj", [DistributionalIPO(kl_tau=0.3), ScoreCentering()], ids=["dipo", "sc"])
def test_bfloat16_streams_are_computed_in_float32(obj):
    b = _bin([5, 3], 3, 8, seed=6, dtype=torch.float32)
    plan = _plan(b, obj)
    bf = Outputs(logprobs=_poisoned(b, b.trn_leaf).bfloat16(), topk_logprobs=_poisoned(b, b.topk_leaf).bfloat16(),
                 entropy=_poisoned(b, b.entropy).bfloat16())  # fmt: skip
    loss = compute_loss(plan, bf).loss
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


# ---------------------------------------------------------------------------------------------------
# prime-rl's own distributional IPO test cases
# ---------------------------------------------------------------------------------------------------


def _categorical(trainer_probs, sampler_probs, head=None, mask=None, weights=None):
    """prime-rl's test inputs: rows of full distributions; the sampled token is id 0, the head the first
    ``head`` ids. Returns ``(plan factory, outputs, logits leaf)``."""
    logits = torch.tensor(trainer_probs, dtype=F64).log().requires_grad_()
    trainer = logits.log_softmax(-1)
    sampler = torch.tensor(sampler_probs, dtype=F64).log()
    n, head = trainer.shape[0], head or trainer.shape[1]
    ids = torch.arange(head).expand(n, head)
    mask = torch.ones(n, dtype=torch.bool) if mask is None else mask

    def plan(obj, topk_ids=ids, topk_logprobs=sampler[:, :head]):
        comp = Component(obj, mask=mask, weights=weights, **SUMMED)
        return Plan([n], {"pg": comp}, rollout_logprobs=sampler[:, 0], advantages=torch.ones(n, dtype=F64),
                    rollout_topk_ids=topk_ids, rollout_topk_logprobs=topk_logprobs)  # fmt: skip

    return plan, Outputs(logprobs=trainer[:, 0], topk_logprobs=trainer[:, :head]), logits


def test_distributional_ipo_catches_unsampled_movement():
    """The sampled token did not move (IPO keeps it); the unsampled ones moved by TV 0.24 > 0.2."""
    plan, outputs, logits = _categorical([[0.5, 0.49, 0.01]], [[0.5, 0.25, 0.25]])
    result = compute_loss(plan(DistributionalIPO(eps=0.2)), outputs)
    ipo = compute_loss(plan(PolicyGradient(IPOMask(0.2), ratio="rollout")), outputs)
    assert result.metrics["pg/is_masked"].item() == 1
    assert ipo.metrics["pg/is_masked"].item() == 0
    assert result.metrics["pg/total_variation"].item() == pytest.approx(0.24, rel=1e-12)
    (grad,) = torch.autograd.grad(result.loss, logits)
    assert torch.equal(grad, torch.zeros_like(grad))  # kl_tau = 0 by default, and the gradient is gated


def test_distributional_ipo_gate_includes_its_boundary_and_drops_an_overflowing_ratio_safely():
    plan, outputs, _ = _categorical([[0.5, 0.49, 0.01]], [[0.5, 0.25, 0.25]])
    distance = compute_loss(plan(DistributionalIPO()), outputs).metrics["pg/total_variation"].item()
    assert compute_loss(plan(DistributionalIPO(eps=distance)), outputs).metrics["pg/is_masked"].item() == 0
    sampled = torch.tensor([1000.0], dtype=F64, requires_grad=True)
    extreme = Outputs(logprobs=sampled, topk_logprobs=outputs.topk_logprobs)
    result = compute_loss(plan(DistributionalIPO(eps=0.0)), extreme)
    (grad,) = torch.autograd.grad(result.loss, sampled)
    assert result.loss.item() == 0 and grad.item() == 0


@pytest.mark.parametrize("head", [2, 4])
@pytest.mark.parametrize("eps", [0.0, 1.0])
def test_distributional_ipo_is_the_categorical_objective_over_head_and_tail(head, eps):
    """Weight 0.7, kl_tau 0.3: ``0.7 (−[kept] p_0/q_0 + 0.3 Σ_b q_b (log p_b − log q_b)²)`` over the
    buckets (the head's ids, then the tail), and its gradient w.r.t. the logits (non-zero when gated)."""
    probs, sampler_probs = [[0.4, 0.3, 0.2, 0.1]], [[0.5, 0.2, 0.15, 0.15]]
    plan, outputs, logits = _categorical(probs, sampler_probs, head, weights=torch.tensor([0.7], dtype=F64))
    loss = compute_loss(plan(DistributionalIPO(eps=eps, kl_tau=0.3)), outputs).loss
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    trainer, sampler = logits.softmax(-1)[0], torch.tensor(sampler_probs[0], dtype=F64)
    buckets_p = torch.cat([trainer[:head], trainer[head:].sum().reshape(-1)]) if head < 4 else trainer
    buckets_q = torch.cat([sampler[:head], sampler[head:].sum().reshape(-1)]) if head < 4 else sampler
    penalty = (buckets_q * (buckets_p.log() - buckets_q.log()).square()).sum()
    pg = -trainer[0] / sampler[0] if eps == 1.0 else 0.0
    want = 0.7 * (pg + 0.3 * penalty)
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
    assert grad.abs().sum() > 0


def test_distributional_ipo_pads_and_non_member_rows_change_nothing():
    mask = torch.tensor([True, False])
    plan, outputs, logits = _categorical([[0.4, 0.6], [0.5, 0.5]], [[0.5, 0.5], [0.6, 0.4]], mask=mask)
    obj = DistributionalIPO(eps=1.0, kl_tau=0.2)
    want = compute_loss(plan(obj), outputs).loss
    (want_grad,) = torch.autograd.grad(want, logits, retain_graph=True)
    nan = torch.full((2, 1), NAN, dtype=F64)
    ids = torch.tensor([[0, 1, -1], [-1, -1, -1]])
    padded_plan = plan(obj, ids, torch.cat([plan(obj).rollout_topk_logprobs, nan], -1))
    padded = Outputs(logprobs=outputs.logprobs, topk_logprobs=torch.cat([outputs.topk_logprobs, nan], -1))
    loss = compute_loss(padded_plan, padded).loss
    (grad,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(loss, want, rtol=1e-14, atol=1e-16)
    torch.testing.assert_close(grad, want_grad, rtol=1e-14, atol=1e-16)
    assert torch.equal(grad[1], torch.zeros_like(grad[1]))


def test_distributional_ipo_sees_the_tail_mass_but_not_movement_inside_it():
    obj = DistributionalIPO(eps=1.0, kl_tau=0.2)
    plan, outputs, _ = _categorical([[0.5, 0.3, 0.1, 0.1]], [[0.5, 0.2, 0.15, 0.15]], head=2)
    assert compute_loss(plan(obj), outputs).metrics["pg/total_variation"].item() == pytest.approx(0.1, rel=1e-12)
    plan, outputs, _ = _categorical([[0.5, 0.2, 0.29, 0.01]], [[0.5, 0.2, 0.15, 0.15]], head=2)
    metrics = compute_loss(plan(obj), outputs).metrics
    assert metrics["pg/total_variation"].item() == pytest.approx(0.0, abs=1e-15)
    assert metrics["pg/squared_log_ratio"].item() == pytest.approx(0.0, abs=1e-15)


def test_distributional_ipo_equal_policies_is_ipo_and_an_empty_component_is_finite():
    plan, outputs, logits = _categorical([[0.5, 0.5]], [[0.5, 0.5]])
    result = compute_loss(plan(DistributionalIPO(kl_tau=0.3)), outputs)
    assert result.metrics["pg/squared_log_ratio"].item() == 0
    drift = KLPenalty(0.3, "squared_log_ratio", "rollout")
    ipo = compute_loss(plan(PolicyGradient(IPOMask(0.3), ratio="rollout", penalties=(drift,))), outputs)
    torch.testing.assert_close(result.loss, ipo.loss, rtol=0, atol=0)
    empty, _, _ = _categorical([[0.5, 0.5]], [[0.5, 0.5]], mask=torch.zeros(1, dtype=torch.bool))
    result = compute_loss(empty(DistributionalIPO(kl_tau=0.3), torch.full((1, 2), -1)), outputs)
    (grad,) = torch.autograd.grad(result.loss, logits)
    assert result.loss.item() == 0 and torch.equal(grad, torch.zeros_like(grad))
    assert all(torch.isfinite(v) for v in result.metrics.values())


@pytest.mark.parametrize("obj", [DistributionalIPO(), ScoreCentering()], ids=["dipo", "sc"])
def test_missing_streams_are_errors_naming_the_component(obj):
    b = _bin([3, 2], 2, 5, seed=1)
    comp = Component(obj, mask=b.member)
    with pytest.raises(ValueError, match=r"component 'pg' \(\w+\) needs the plan's rollout_topk_ids"):
        Plan(b.lens, {"pg": comp}, rollout_logprobs=b.inf, advantages=b.adv)
    with pytest.raises(ValueError, match="component 'pg' needs the plan's advantages"):
        Plan(b.lens, {"pg": comp}, rollout_logprobs=b.inf, rollout_topk_ids=b.ids, rollout_topk_logprobs=b.lq)
    plan = _plan(b, obj)
    with pytest.raises(ValueError, match="component 'pg' needs outputs.topk_logprobs"):
        compute_loss(plan, Outputs(logprobs=b.trn_leaf, entropy=b.entropy))
    with pytest.raises(ValueError, match=r"outputs.topk_logprobs of the shape of the plan's rollout_topk_ids \[5, 2\]"):
        compute_loss(plan, Outputs(logprobs=b.trn_leaf, topk_logprobs=b.topk_leaf[:, :1], entropy=b.entropy))
    if isinstance(obj, ScoreCentering):
        with pytest.raises(ValueError, match="component 'pg' needs outputs.entropy"):
            compute_loss(plan, Outputs(logprobs=b.trn_leaf, topk_logprobs=b.topk_leaf))


def test_parameters_are_checked():
    with pytest.raises(ValueError, match="DistributionalIPO.eps must be >= 0"):
        DistributionalIPO(eps=-0.1)
    with pytest.raises(ValueError, match="DistributionalIPO.kl_tau must be >= 0"):
        DistributionalIPO(kl_tau=-1.0)
    with pytest.raises(TypeError, match="DistributionalIPO.adv_tau must be a number"):
        DistributionalIPO(adv_tau="1")
    with pytest.raises(ValueError, match="ScoreCentering.tail_eps must be > 0"):
        ScoreCentering(tail_eps=0.0)


@pytest.mark.parametrize("obj", [DistributionalIPO(eps=0.0, kl_tau=0.3), ScoreCentering()], ids=["dipo", "sc"])
def test_a_member_without_candidates_has_an_empty_head(obj):
    """The documented rule (no sync; prime-rl raises): head empty, tail 1 on both sides. distributional
    IPO keeps it (TV 0) with no penalty; score centering scores ``trn + H`` (REINFORCE's gradient).
    ``check_candidates`` is prime-rl's check, opt-in."""
    trn = torch.tensor([-0.7], dtype=F64, requires_grad=True)
    ids, logprobs = torch.full((1, 3), -1), torch.full((1, 3), NAN, dtype=F64)
    entropy, adv, inf = torch.tensor([1.3], dtype=F64), torch.tensor([0.8], dtype=F64), torch.tensor([-0.9], dtype=F64)
    comp = Component(obj, mask=torch.ones(1, dtype=torch.bool), **SUMMED)
    plan = Plan([1], {"pg": comp}, rollout_logprobs=inf, advantages=adv, rollout_topk_ids=ids,
                rollout_topk_logprobs=logprobs)  # fmt: skip
    result = compute_loss(plan, Outputs(logprobs=trn, topk_logprobs=logprobs.clone(), entropy=entropy))
    (grad,) = torch.autograd.grad(result.loss, trn)
    if isinstance(obj, DistributionalIPO):
        ratio = torch.exp(trn.detach() - inf)
        want, want_grad = -0.8 * ratio, -0.8 * ratio
        assert result.metrics["pg/total_variation"].item() == 0 and result.metrics["pg/is_masked"].item() == 0
    else:
        want, want_grad = -0.8 * (trn.detach() + 1.3), torch.tensor([-0.8], dtype=F64)
    torch.testing.assert_close(result.loss, want.reshape(()), rtol=1e-14, atol=0)
    torch.testing.assert_close(grad, want_grad.reshape(1), rtol=1e-14, atol=0)
    assert result.metrics["pg/empty_head"].item() == 1
    with pytest.raises(ValueError, match="component 'pg' has a member token without a candidate"):
        check_candidates(plan, "pg")
    b = _bin([3, 2], 2, 5, seed=3)
    assert check_candidates(_plan(b, obj), "pg").num_tokens == 5


# ---------------------------------------------------------------------------------------------------
# prime-rl's own score centering test cases
# ---------------------------------------------------------------------------------------------------

VOCAB, SEQ, HEAD = 61, 7, 8


def _sc_plan(top_ids, sampler_lp, adv, mask=None, **component):
    mask = torch.ones(SEQ, dtype=torch.bool) if mask is None else mask
    comp = Component(ScoreCentering(), mask=mask, **(component or SUMMED))
    return Plan([3, 4], {"pg": comp}, advantages=adv, rollout_topk_ids=top_ids, rollout_topk_logprobs=sampler_lp)


def _sc_outputs(logits, top_ids, token):
    logp = logits.log_softmax(-1)
    return Outputs(logprobs=logp.gather(-1, token[:, None]).squeeze(-1),
                   topk_logprobs=logp.gather(-1, top_ids.clamp_min(0)),
                   entropy=-(logp.exp() * logp).sum(-1).detach())  # fmt: skip


def test_score_centering_with_an_exact_tail_is_full_score_centering():
    """A sampler whose tail is ``ρ`` times the trainer's: the top-k loss and gradient are the full
    ``−A (log p_y − Σ_v q_v log p_v)``."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(SEQ, VOCAB, generator=g, dtype=F64)
    p = logits.softmax(-1)
    top_p, top_ids = p.topk(HEAD, -1)
    q_head = top_p * (0.3 + torch.rand(SEQ, HEAD, generator=g, dtype=F64))
    q_head = q_head / q_head.sum(-1, keepdim=True) * 0.9 * top_p.sum(-1, keepdim=True).clamp(max=1.0)
    rho = (1 - q_head.sum(-1)) / (1 - top_p.sum(-1))
    q = rho[:, None] * p
    q.scatter_(1, top_ids, q_head)
    token = torch.randint(0, VOCAB, (SEQ,), generator=g)
    adv = torch.randn(SEQ, generator=g, dtype=F64)
    leaf = logits.clone().requires_grad_()
    loss = compute_loss(_sc_plan(top_ids, q_head.log(), adv), _sc_outputs(leaf, top_ids, token)).loss
    (grad,) = torch.autograd.grad(loss, leaf)
    full = logits.clone().requires_grad_()
    logp = full.log_softmax(-1)
    want = -(adv * (logp.gather(-1, token[:, None]).squeeze(-1) - (q * logp).sum(-1))).sum()
    (want_grad,) = torch.autograd.grad(want, full)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)


def test_score_centering_with_the_sampler_equal_to_the_trainer_is_reinforce():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(SEQ, VOCAB, generator=g, dtype=F64)
    logp = logits.log_softmax(-1)
    top_lp, top_ids = logp.topk(HEAD, -1)
    token = torch.randint(0, VOCAB, (SEQ,), generator=g)
    adv = torch.randn(SEQ, generator=g, dtype=F64)
    leaf = logits.clone().requires_grad_()
    loss = compute_loss(_sc_plan(top_ids, top_lp, adv), _sc_outputs(leaf, top_ids, token)).loss
    (grad,) = torch.autograd.grad(loss, leaf)
    plain = logits.clone().requires_grad_()
    want = -(adv * plain.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)).sum()
    (want_grad,) = torch.autograd.grad(want, plain)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)


def test_score_centering_gradient_reaches_only_the_sampled_token_and_the_head_gathers():
    """The entropy enters as a constant; pads and non-members get no gradient; a padded column holding
    NaN is the same as no column."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(SEQ, VOCAB, generator=g, dtype=F64)
    logp = logits.log_softmax(-1)
    top_lp, top_ids = logp.topk(HEAD, -1)
    sampler_lp = (top_lp - torch.rand(SEQ, HEAD, generator=g, dtype=F64)).clamp(max=-1e-3)
    adv = torch.randn(SEQ, generator=g, dtype=F64)
    mask = torch.tensor([True, True, False, True, True, False, True])
    trn = logp[:, 0].clone().requires_grad_()
    topk = logp.gather(-1, top_ids).requires_grad_()
    entropy = -(logp.exp() * logp).sum(-1).requires_grad_()
    padded_ids = top_ids.clone()
    padded_ids[:, -1] = -1
    nan_col = torch.where(padded_ids >= 0, topk, NAN)
    plan = _sc_plan(padded_ids, torch.where(padded_ids >= 0, sampler_lp, NAN), adv, mask)
    loss = compute_loss(plan, Outputs(logprobs=trn, topk_logprobs=nan_col, entropy=entropy)).loss
    g_trn, g_topk, g_ent = torch.autograd.grad(loss, (trn, topk, entropy), allow_unused=True)
    assert g_ent is None or torch.equal(g_ent, torch.zeros_like(g_ent))
    assert torch.equal(g_topk[:, -1], torch.zeros(SEQ, dtype=F64))
    assert (g_topk[~mask] == 0).all() and (g_trn[~mask] == 0).all()
    assert (g_topk[mask, :-1] != 0).all()
    short = _sc_plan(top_ids[:, :-1], sampler_lp[:, :-1], adv, mask)
    want = compute_loss(short, Outputs(logprobs=trn, topk_logprobs=topk[:, :-1], entropy=entropy)).loss
    torch.testing.assert_close(loss, want, rtol=1e-14, atol=1e-16)


# ---------------------------------------------------------------------------------------------------
# The fused head, syncs, op counts
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("obj", [DistributionalIPO(eps=0.15, kl_tau=0.3), ScoreCentering()], ids=["dipo", "sc"])
def test_fused_head_streams_equal_the_dense_logits(obj):
    """``linear_logprobs`` + ``logprobs_at`` on ``(hidden, weight)`` at temperature 0.7 → the objective:
    loss and gradients w.r.t. hidden and weight equal those through dense ``[N, V]`` logits."""
    g = torch.Generator().manual_seed(4)
    n, h, v, k, temperature = 13, 8, 37, 4, 0.7
    hidden = torch.randn(n, h, generator=g, dtype=F64)
    weight = torch.randn(v, h, generator=g, dtype=F64) * 0.5
    sampler = (hidden @ weight.T / temperature + 0.4 * torch.randn(n, v, generator=g, dtype=F64)).log_softmax(-1)
    top_lp, top_ids = sampler.topk(k, -1)
    top_ids[3, 1:] = -1
    top_ids[7, 2] = -1
    token = torch.multinomial(sampler.exp(), 1, generator=g).squeeze(-1)
    mask = torch.rand(n, generator=g) > 0.2
    comp = Component(obj, mask=mask, normalize="token")
    plan = Plan([5, 8], {"pg": comp}, rollout_logprobs=sampler.gather(-1, token[:, None]).squeeze(-1),
                advantages=torch.randn(n, generator=g, dtype=F64), rollout_topk_ids=top_ids,
                rollout_topk_logprobs=torch.where(top_ids >= 0, top_lp, NAN))  # fmt: skip

    def grads(fused):
        hd, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            lp, ent = linear_logprobs(hd, w, token, temperature=temperature, vocab_chunk_size=16)
            topk = logprobs_at(hd, w, top_ids, temperature=temperature, vocab_chunk_size=16)
        else:
            logp = (hd @ w.T / temperature).log_softmax(-1)
            lp, ent = logp.gather(-1, token[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1).detach()
            topk = logp.gather(-1, top_ids.clamp_min(0))
        loss = compute_loss(plan, Outputs(logprobs=lp, topk_logprobs=topk, entropy=ent)).loss
        return (loss, *torch.autograd.grad(loss, (hd, w)))

    for got, want in zip(grads(True), grads(False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert grads(False)[1].abs().sum() > 0


@pytest.mark.parametrize("obj", [DistributionalIPO(eps=0.1, kl_tau=0.3), ScoreCentering()], ids=["dipo", "sc"])
@pytest.mark.parametrize("per_sequence_metrics", [False, True])
def test_no_sync_and_an_op_count_flat_in_the_sequences(obj, per_sequence_metrics):
    counted = []
    for lens in ([48], [12] * 4, [3] * 16):
        b = _bin(lens, 4, 9, seed=8)
        plan = _plan(b, obj, normalize="sequence_mean")
        outputs = _outputs(b)
        with OpCounter() as ops:
            result = compute_loss(plan, outputs, per_sequence_metrics=per_sequence_metrics)
            result.loss.backward()
        assert ops.num_syncs == 0, ops.syncs
        counted.append(ops.ops)
    assert counted[0] == counted[1] == counted[2]
