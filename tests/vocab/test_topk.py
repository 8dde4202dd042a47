"""packloss.vocab.topk: the top-k + tail divergences from logits and from hidden states against a brute-force
float64 reference over the full ``[N, V]`` student logits (every vocabulary entry summed into its bucket),
values and gradients under hypothesis; ``tail=False`` against verl's installed ``forward_kl_topk``;
``TopKDistill`` through the engine; non-member rows, syncs, op counts and the fused path's allocations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from verl.trainer.distillation import losses as verl_losses
from verl.trainer.distillation.fsdp import losses as verl_fsdp
from verl.workers.config import DistillationConfig, DistillationLossConfig

from packloss.core.bin import Component, Plan
from packloss.core.engine import compute_loss
from packloss.core.outputs import Outputs
from packloss.core.step import count_denominators
from packloss.testing import OpCounter
from packloss.vocab.distill import divergence
from packloss.vocab.topk import TAIL_FLOOR, TOPK_KINDS, TopKDistill, linear_topk_divergence, topk_divergence
from tests.vocab.harness import MaxNumel

TOL = dict(rtol=1e-9, atol=1e-10)


# ---------------------------------------------------------------------------------------------------
# Inputs and the brute-force reference
# ---------------------------------------------------------------------------------------------------


def teacher_log_softmax(t: torch.Tensor) -> torch.Tensor:
    """Float64 ``log_softmax`` with ``log1p`` of the non-max mass, so the log-prob of a dominant id keeps
    its tiny distance from 0 (a teacher whose tail is near 0)."""
    m, top = t.max(dim=1, keepdim=True)
    d = t - m
    return d - torch.log1p(d.exp().scatter(1, top, 0.0).sum(dim=1, keepdim=True))


def bucket_reference(kind, z, teacher_logp, ids, *, beta, temperature, floor):
    """``(ℓ [N], q_tail [N], p_tail [N])`` in float64, differentiable w.r.t. ``z [N, V]``: every entry of the
    full softmaxes is summed into its bucket (its top-k position, else the tail), then the divergence over
    the buckets, the teacher's tail floored where it has an id, by ``xlogy`` (``0 log 0 = 0``); the tails
    as they are."""
    n, v = z.shape
    k = ids.shape[1]
    q = torch.softmax(z.double() / temperature, dim=-1)  # [N, V]
    p = teacher_logp.exp()  # [N, V]
    bucket = torch.full((n, v), k, dtype=torch.long)
    for i in range(n):
        for j in range(k):
            if 0 <= int(ids[i, j]) < v:
                bucket[i, int(ids[i, j])] = j
    big_q = torch.zeros(n, k + 1, dtype=torch.float64).scatter_add(1, bucket, q)
    big_p = torch.zeros(n, k + 1, dtype=torch.float64).scatter_add(1, bucket, p)
    has_tail = (bucket == k).any(dim=1)
    p_tail = big_p[:, k].clone()
    big_p = torch.cat([big_p[:, :k], torch.where(has_tail, p_tail.clamp_min(floor), 0.0)[:, None]], dim=1)
    if kind == "jsd" and beta in (0.0, 1.0):
        kind = "forward_kl" if beta == 0.0 else "reverse_kl"

    def kl(a, b):
        return (torch.xlogy(a, a) - torch.xlogy(a, b)).sum(dim=1)

    if kind == "forward_kl":
        loss = kl(big_p, big_q)
    elif kind == "reverse_kl":
        loss = kl(big_q, big_p)
    else:
        m = beta * big_p + (1 - beta) * big_q
        loss = beta * kl(big_p, m) + (1 - beta) * kl(big_q, m)
    return loss, big_q[:, k].detach(), p_tail


def teacher_topk(teacher_logp: torch.Tensor, k: int, absent: torch.Tensor):
    """``(ids [N, K], logprobs [N, K])``: the top-k, ``absent`` ones as ``-1`` with a NaN log-prob."""
    lp, ids = teacher_logp.topk(k, dim=1)
    return ids.masked_fill(absent, -1), lp.masked_fill(absent, math.nan)


@st.composite
def cases(draw):
    n, v = draw(st.integers(1, 5)), draw(st.integers(2, 9))
    k = draw(st.sampled_from([1, v - 1, v, draw(st.integers(1, v))]))
    kind = draw(st.sampled_from(TOPK_KINDS))
    return dict(
        n=n, v=v, k=max(k, 1), kind=kind,
        beta=draw(st.sampled_from([0.3, 0.8, 0.0, 1.0])) if kind == "jsd" else 0.5,
        temperature=draw(st.sampled_from([1.0, 0.6, 1.7])),
        teacher_scale=draw(st.sampled_from([1.0, 3.0, 40.0])),  # 40: the teacher's tail below any floor
        student_peak=draw(st.sampled_from([0.0, 5.0, 60.0])),  # 60: the student's tail near 0 (1e-26)
        absent=draw(st.sampled_from([0.0, 0.3, 0.7])),
        floor=draw(st.sampled_from([TAIL_FLOOR, 1e-3])),
        chunk=draw(st.integers(1, n)), vchunk=draw(st.integers(1, v)), seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def make_case(c):
    """The student head ``h [N, V]``, ``W [V, V]`` (near the identity, so ``z ≈ h`` and a peak on the
    teacher's ids empties the student's tail), the teacher's log-softmax, ids and log-probs, coefficients."""
    g = torch.Generator().manual_seed(c["seed"])
    n, v, k = c["n"], c["v"], c["k"]
    teacher_logp = teacher_log_softmax(torch.randn(n, v, generator=g, dtype=torch.float64) * c["teacher_scale"])
    absent = torch.rand(n, k, generator=g) < c["absent"]
    ids, lp = teacher_topk(teacher_logp, k, absent)
    peak = torch.zeros(n, v, dtype=torch.float64).scatter(1, ids.clamp(min=0), c["student_peak"]) * (~absent)[:, :1]
    hidden = (torch.randn(n, v, generator=g, dtype=torch.float64) + peak).requires_grad_()
    weight = torch.eye(v, dtype=torch.float64) + 0.05 * torch.randn(v, v, generator=g, dtype=torch.float64)
    coef = torch.randn(n, generator=g, dtype=torch.float64)
    return hidden, weight.requires_grad_(), teacher_logp, ids, lp, coef


@settings(max_examples=220, deadline=None)
@given(c=cases())
def test_both_paths_match_the_bucket_reference(c) -> None:
    hidden, weight, teacher_logp, ids, lp, coef = make_case(c)
    opts = dict(beta=c["beta"], temperature=c["temperature"], tail_floor=c["floor"])
    ref = dict(beta=c["beta"], temperature=c["temperature"], floor=c["floor"])
    logits = (hidden.detach() @ weight.detach().T).requires_grad_()
    want, q_tail, p_tail = bucket_reference(c["kind"], logits, teacher_logp, ids, **ref)
    (want_d_logits,) = torch.autograd.grad((coef * want).sum(), [logits])
    want_head, _, _ = bucket_reference(c["kind"], hidden @ weight.T, teacher_logp, ids, **ref)
    want_grads = torch.autograd.grad((coef * want_head).sum(), [hidden, weight])

    got = topk_divergence(c["kind"], logits, ids, lp, chunk_size=c["chunk"], **opts)
    (d_logits,) = torch.autograd.grad((coef * got.per_token).sum(), [logits])
    fused = linear_topk_divergence(
        c["kind"], hidden, weight, ids, lp, chunk_size=c["chunk"], vocab_chunk_size=c["vchunk"], **opts
    )
    fused_grads = torch.autograd.grad((coef * fused.per_token).sum(), [hidden, weight])

    for result in (got, fused):
        torch.testing.assert_close(result.per_token, want.detach(), **TOL)
        torch.testing.assert_close(result.student_tail, q_tail, rtol=1e-9, atol=0.0)
        torch.testing.assert_close(result.teacher_tail, p_tail.detach(), **TOL)
    torch.testing.assert_close(d_logits, want_d_logits, **TOL)
    for a, b in zip(fused_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, **TOL)


# ---------------------------------------------------------------------------------------------------
# Edges: an empty tail, tails near 0, dtypes, N = 0
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)])
def test_ids_covering_the_vocabulary_are_the_full_vocabulary_divergence(kind, beta) -> None:
    """K = V, every id present: no tail bucket, so the full vocabulary's divergence (another code path)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 7, generator=g, dtype=torch.float64)
    teacher_logp = torch.log_softmax(torch.randn(6, 7, generator=g, dtype=torch.float64) * 2, dim=-1)
    lp, ids = teacher_logp.topk(7, dim=1)
    got = topk_divergence(kind, logits, ids, lp, beta=beta, temperature=1.3)
    want = divergence(kind, logits, teacher_logp, beta=beta, temperature=1.3, teacher_format="logprobs")
    torch.testing.assert_close(got.per_token, want, **TOL)
    assert torch.equal(got.student_tail, torch.zeros(6, dtype=torch.float64))
    assert torch.equal(got.teacher_tail, torch.zeros(6, dtype=torch.float64))


def test_a_student_tail_of_1e_26_is_exact_in_float32() -> None:
    """The student's tail as a log-sum-exp difference: ``1 − Σ_k q_k`` is 0 in float32 here (log = −inf)."""
    g = torch.Generator().manual_seed(2)
    teacher_logp = torch.log_softmax(torch.randn(4, 10, generator=g, dtype=torch.float64), dim=-1)
    lp, ids = teacher_logp.topk(3, dim=1)
    logits = torch.randn(4, 10, generator=g, dtype=torch.float64).scatter_add(
        1, ids, torch.full((4, 3), 60.0, dtype=torch.float64)
    )
    q32 = torch.softmax(logits.float(), dim=-1)
    assert (1 - q32.gather(1, ids).sum(dim=1) <= 0).all()  # the cancelling form has nothing left
    want, q_tail, _ = bucket_reference("forward_kl", logits, teacher_logp, ids, beta=0.5, temperature=1.0,
                                       floor=TAIL_FLOOR)  # fmt: skip
    assert (q_tail < 1e-24).all()
    for got in (
        topk_divergence("forward_kl", logits.float(), ids, lp.float()),
        linear_topk_divergence("forward_kl", logits.float(), torch.eye(10), ids, lp.float()),
    ):
        assert got.per_token.dtype == torch.float32
        torch.testing.assert_close(got.per_token.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.student_tail.double(), q_tail, rtol=1e-4, atol=0.0)


def test_a_teacher_tail_of_1e_12_beside_a_dominant_id_is_exact() -> None:
    """``1 − p_1 − p_2`` with ``p_1 ≈ 1``: the naive float64 sum keeps ~4 digits of it; packloss keeps ~13."""
    lp = torch.tensor([[math.log1p(-(1e-9 + 1e-12)), math.log(1e-9)]], dtype=torch.float64)
    naive = 1 - lp.exp().sum()
    assert abs(float(naive) / 1e-12 - 1) > 1e-6  # what the cancelling form gives
    got = topk_divergence("reverse_kl", torch.zeros(1, 5, dtype=torch.float64), torch.tensor([[0, 1]]), lp,
                          tail_floor=1e-30)  # fmt: skip
    assert abs(float(got.teacher_tail[0]) / 1e-12 - 1) < 1e-9


def test_low_precision_logits_give_float32_losses_and_gradients_in_their_dtype() -> None:
    g = torch.Generator().manual_seed(3)
    teacher_logp = torch.log_softmax(torch.randn(8, 16, generator=g, dtype=torch.float64), dim=-1)
    lp, ids = teacher_logp.topk(4, dim=1)
    logits = torch.randn(8, 16, generator=g, dtype=torch.float64).requires_grad_()
    want, _, _ = bucket_reference("jsd", logits, teacher_logp, ids, beta=0.3, temperature=0.8, floor=TAIL_FLOOR)
    (want_grad,) = torch.autograd.grad(want.sum(), [logits])
    low = logits.detach().bfloat16().requires_grad_()
    got = topk_divergence("jsd", low, ids.int(), lp.bfloat16(), beta=0.3, temperature=0.8)
    (grad,) = torch.autograd.grad(got.per_token.sum(), [low])
    assert got.per_token.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(got.per_token.double(), want.detach(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(grad.double(), want_grad, rtol=3e-2, atol=3e-2)


def test_no_tokens() -> None:
    hidden, weight = torch.zeros(0, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    ids, lp = torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3)
    got = linear_topk_divergence("reverse_kl", hidden, weight, ids, lp)
    assert got.per_token.shape == (0,)
    got.per_token.sum().backward()
    assert torch.equal(weight.grad, torch.zeros(9, 4))
    assert topk_divergence("jsd", torch.zeros(0, 9), ids, lp).per_token.shape == (0,)


def test_the_gradient_is_first_order_only() -> None:
    hidden, weight = torch.randn(3, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    ids, lp = torch.tensor([[0, 2]] * 3), torch.log(torch.tensor([[0.5, 0.2]] * 3))
    for loss in (
        linear_topk_divergence("forward_kl", hidden, weight, ids, lp).per_token.sum(),
        topk_divergence("forward_kl", hidden @ weight.T, ids, lp).per_token.sum(),
    ):
        with pytest.raises(RuntimeError, match="first order only"):
            torch.autograd.grad(loss, [hidden], create_graph=True)


# ---------------------------------------------------------------------------------------------------
# tail=False: verl's forward_kl_topk, its own code
# ---------------------------------------------------------------------------------------------------


def verl_forward_kl_topk(logits: torch.Tensor, ids: torch.Tensor, lp: torch.Tensor, clamp: float | None):
    """verl 0.9.1's registered ``forward_kl_topk`` on one sequence: its FSDP logits processor, then its loss
    (which clamps at 0). ``(per_token [N], metrics)``."""
    n, k = ids.shape
    loss_config = DistillationLossConfig(
        loss_mode="forward_kl_topk", topk=k, use_policy_gradient=False, log_prob_min_clamp=clamp
    )
    config = DistillationConfig(distillation_loss=loss_config)

    def nested(x):
        return torch.nested.nested_tensor([x], layout=torch.jagged)

    out = verl_fsdp.compute_forward_kl_topk(logits[None], nested(lp), nested(ids), config, "thd")
    # verl reads a response's outputs one position early (the next-token shift): a one-token prompt
    # before the N response tokens, and one output past them
    model_output = {key: torch.cat([value[0], value[0, :1]]) for key, value in out.items()}
    data = TensorDict(
        {
            "prompts": torch.zeros(1, 1, dtype=torch.long),
            "responses": torch.zeros(1, n, dtype=torch.long),
            "attention_mask": torch.ones(1, n + 1, dtype=torch.long),
            "response_mask": torch.ones(1, n, dtype=torch.long),
        },
        batch_size=[1],
    )
    losses, metrics = verl_losses.compute_forward_kl_topk(None, config, model_output, data)
    return losses[0], metrics


@pytest.mark.parametrize("path", ["logits", "hidden"])
@pytest.mark.parametrize("temperature", [1.0, 1.6])
@pytest.mark.parametrize("clamp", [-10.0, None])
def test_tail_false_is_verls_forward_kl_topk(path, temperature, clamp) -> None:
    n, h, v, k = 12, 10, 10, 6
    g = torch.Generator().manual_seed(5)
    teacher_logp = torch.log_softmax(torch.randn(n, v, generator=g, dtype=torch.float64) * 6, dim=-1)
    lp, ids = teacher_logp.topk(k, dim=1)  # log-probs below -10 among them
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64) * 3
    # even rows: T × the teacher's log-probs, its top-k raised by 3: more top-k mass than the teacher's, KL < 0
    raised = teacher_logp[::2].scatter_add(1, ids[::2], torch.full((n // 2, k), 3.0, dtype=torch.float64))
    hidden[::2] = raised * temperature
    hidden.requires_grad_()
    weight = torch.eye(v, h, dtype=torch.float64).requires_grad_()
    coef = torch.randn(n, generator=g, dtype=torch.float64)

    scaled = hidden @ weight.T / temperature
    want, metrics = verl_forward_kl_topk(scaled, ids, lp, clamp)
    assert (want == 0).any() and (want > 0).any(), "both sides of verl's clamp at 0"
    if clamp is not None:
        assert (torch.log_softmax(scaled, -1).gather(1, ids) < clamp).any() and (lp < clamp).any()
    want_grads = torch.autograd.grad((coef * want).sum(), [hidden, weight])

    opts = dict(tail=False, log_prob_min_clamp=clamp, temperature=temperature)
    if path == "logits":
        got = topk_divergence("forward_kl", hidden @ weight.T, ids, lp, **opts)
    else:
        got = linear_topk_divergence("forward_kl", hidden, weight, ids, lp, vocab_chunk_size=3, **opts)
    grads = torch.autograd.grad((coef * got.per_token).sum(), [hidden, weight])
    # verl's kl_divergence runs in float32 whatever its inputs (``.float()``)
    torch.testing.assert_close(got.per_token.float(), want.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert math.isclose(1 - float(got.student_tail.mean()), metrics["distillation/student_mass"], rel_tol=1e-9)
    assert math.isclose(1 - float(got.teacher_tail.mean()), metrics["distillation/teacher_mass"], rel_tol=1e-9)


# ---------------------------------------------------------------------------------------------------
# Non-member rows, syncs, op counts, allocations
# ---------------------------------------------------------------------------------------------------


def _garbage_rows(x: torch.Tensor, rows: list[int], value: float) -> torch.Tensor:
    x = x.detach().clone()
    x[rows] = value
    return x.requires_grad_()


@pytest.mark.parametrize("kind, tail", [("forward_kl", True), ("reverse_kl", True), ("jsd", True),
                                        ("forward_kl", False)])  # fmt: skip
@pytest.mark.parametrize("garbage", [math.nan, math.inf])
def test_non_member_rows_may_hold_anything(kind, tail, garbage) -> None:
    n, h, v, k = 7, 5, 11, 4
    g = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g).requires_grad_()
    lp, ids = torch.log_softmax(torch.randn(n, v, generator=g), dim=-1).topk(k, dim=1)
    mask = torch.tensor([1, 0, 1, 0, 0, 1, 1], dtype=torch.bool)
    off = [1, 3, 4]
    bad_ids, bad_lp = ids.clone(), lp.clone()
    bad_ids[off] = torch.tensor([10**6, -7, 3, 3])  # out of range, and duplicated
    bad_lp[off] = garbage
    opts = dict(tail=tail, beta=0.3)

    results = []
    for h_in, i_in, lp_in in ((hidden.clone().requires_grad_(), ids, lp), (_garbage_rows(hidden, off, garbage),
                                                                            bad_ids, bad_lp)):  # fmt: skip
        fused = linear_topk_divergence(kind, h_in, weight, i_in, lp_in, mask, chunk_size=3, vocab_chunk_size=4, **opts)
        d_h, d_w = torch.autograd.grad(fused.per_token.sum(), [h_in, weight])
        logits = torch.where(mask[:, None], h_in.detach() @ weight.detach().T, garbage).requires_grad_()
        got = topk_divergence(kind, logits, i_in, lp_in, mask, chunk_size=2, **opts)
        (d_z,) = torch.autograd.grad(got.per_token.sum(), [logits])
        results.append([*fused, d_h, d_w, *got, d_z])
    for clean, dirty in zip(*results, strict=True):
        assert torch.isfinite(dirty).all()
        torch.testing.assert_close(dirty, clean, rtol=0.0, atol=0.0)
    d_h, d_z = results[1][3], results[1][-1]
    assert (d_h[off] == 0).all() and (d_z[off] == 0).all() and (d_h[mask] != 0).any()


def _engine_step(path: str, seq_lens: list[int], n=24, h=8, v=40, k=5):
    g = torch.Generator().manual_seed(7)
    hidden, weight = torch.randn(n, h, generator=g, requires_grad=True), torch.randn(v, h, generator=g)
    lp, ids = torch.log_softmax(torch.randn(n, v, generator=g), dim=-1).topk(k, dim=1)
    ids[::4, 0] = -1
    mask = torch.arange(n) % 3 != 0
    components = {"kd": Component(TopKDistill("jsd", beta=0.3, chunk_size=5, vocab_chunk_size=16), mask=mask,
                                  normalize="sequence_mean")}  # fmt: skip
    plan = Plan(seq_lens, components, teacher_topk_ids=ids, teacher_topk_logprobs=lp)
    outputs = Outputs(logits=hidden @ weight.T) if path == "logits" else Outputs(hidden=hidden, head_weight=weight)
    return plan, outputs, count_denominators([plan])


@pytest.mark.parametrize("path", ["logits", "hidden"])
def test_no_syncs_and_op_counts_independent_of_the_sequences(path) -> None:
    totals = []
    for seq_lens in ([12, 12], [3] * 8):
        plan, outputs, den = _engine_step(path, seq_lens)
        with OpCounter() as ops:
            compute_loss(plan, outputs, den).loss.backward()
        assert ops.num_syncs == 0, ops.syncs
        totals.append(ops.total)
    assert totals[0] == totals[1]


def test_the_fused_path_allocates_nothing_of_n_by_v() -> None:
    n, h, v, k = 64, 16, 96, 5
    g = torch.Generator().manual_seed(8)
    hidden, weight = (
        torch.randn(n, h, generator=g, requires_grad=True),
        torch.randn(v, h, generator=g, requires_grad=True),
    )
    lp, ids = torch.log_softmax(torch.randn(n, v, generator=g), dim=-1).topk(k, dim=1)
    with MaxNumel() as sizes:
        got = linear_topk_divergence("reverse_kl", hidden, weight, ids, lp, chunk_size=16, vocab_chunk_size=32)
        got.per_token.sum().backward()
    assert sizes.max_numel < n * v
    assert sizes.max_numel <= max(16 * 32, n * h, v * h, n * (k + 1))


# ---------------------------------------------------------------------------------------------------
# TopKDistill through the engine
# ---------------------------------------------------------------------------------------------------

SEQ_LENS = [4, 1, 6, 3]  # N = 14; the second sequence has no member


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("normalize", ["token", "sequence_mean"])
@pytest.mark.parametrize("path", ["logits", "hidden"])
@pytest.mark.parametrize("kind", TOPK_KINDS)
def test_engine_term_and_metrics_match_the_formula(dtype, normalize, path, kind) -> None:
    n, h, v, k = 14, 6, 19, 4
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    teacher_logp = torch.log_softmax(torch.randn(n, v, generator=g, dtype=torch.float64) * 2, dim=-1)
    ids, lp = teacher_topk(teacher_logp, k, torch.rand(n, k, generator=g) < 0.2)
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 1, 0], dtype=torch.bool)
    weights = torch.rand(n, generator=g, dtype=torch.float64).add(0.5).to(dtype)
    objective = TopKDistill(kind, beta=0.3, temperature=1.3, chunk_size=4, vocab_chunk_size=8)
    component = Component(objective, mask=mask, weights=weights, normalize=normalize)
    plan = Plan(SEQ_LENS, {"kd": component}, teacher_topk_ids=ids, teacher_topk_logprobs=lp.to(dtype))
    outputs = Outputs(logits=hidden @ weight.T) if path == "logits" else Outputs(hidden=hidden, head_weight=weight)
    result = compute_loss(plan, outputs)
    result.loss.backward()

    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    per_token, q_tail, p_tail = bucket_reference(kind, h64 @ w64.T, teacher_logp, ids, beta=0.3, temperature=1.3,
                                                 floor=TAIL_FLOOR)  # fmt: skip
    w = weights.double()
    if normalize == "token":
        want = sum(w[i] * per_token[i] for i in range(n) if mask[i]) / int(mask.sum())
    else:
        want, seqs, start = 0.0, 0, 0
        for length in SEQ_LENS:
            members = [i for i in range(start, start + length) if mask[i]]
            if members:
                want, seqs = want + sum(w[i] * per_token[i] for i in members) / len(members), seqs + 1
            start += length
        want = want / seqs
    want.backward()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else TOL
    assert result.loss.dtype == dtype
    torch.testing.assert_close(result.loss.double(), want.detach(), **tol)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, **tol)
    torch.testing.assert_close(weight.grad.double(), w64.grad, **tol)
    members = int(mask.sum())
    for key, values in ((kind, per_token.detach()), ("student_tail_mass", q_tail), ("teacher_tail_mass", p_tail)):
        torch.testing.assert_close(result.metrics[f"kd/{key}"].double(), values[mask].sum() / members, **tol)
        assert int(result.counts[f"kd/{key}"]) == members


def test_the_plan_needs_the_teachers_top_k() -> None:
    with pytest.raises(ValueError, match=r"'kd' \(TopKDistill\) needs the plan's teacher_topk_ids"):
        Plan([3], {"kd": Component(TopKDistill(), mask=torch.ones(3, dtype=torch.bool))})


def test_the_component_needs_logits_or_a_head() -> None:
    plan = Plan(
        [3],
        {"kd": Component(TopKDistill(), mask=torch.ones(3, dtype=torch.bool))},
        teacher_topk_ids=torch.zeros(3, 2, dtype=torch.long),
        teacher_topk_logprobs=torch.zeros(3, 2),
    )
    with pytest.raises(ValueError, match="needs outputs.logits, or outputs.hidden"):
        compute_loss(plan, Outputs(logprobs=torch.zeros(3)))


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(kind="soft_cross_entropy"), ValueError, "kind"),
        (dict(kind="reverse_kl", tail=False), ValueError, "tail=False is verl's forward_kl_topk"),
        (dict(log_prob_min_clamp=-10.0), ValueError, "log_prob_min_clamp applies to tail=False"),
        (dict(tail=False, log_prob_min_clamp=math.nan), ValueError, "log_prob_min_clamp"),
        (dict(beta=1.5), ValueError, "beta"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(tail_floor=1.0), ValueError, "tail_floor"),
        (dict(tail_floor=0.0), ValueError, "tail_floor"),
        (dict(tail=1), TypeError, "tail"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(vocab_chunk_size=0), ValueError, "vocab_chunk_size"),
    ],
)
def test_bad_options_are_refused_by_name(options, error, match) -> None:
    with pytest.raises(error, match=match):
        TopKDistill(**options)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda z, i, lp, m: topk_divergence("forward_kl", z, i.float(), lp), TypeError, "teacher_topk_ids"),
        (lambda z, i, lp, m: topk_divergence("forward_kl", z, i, lp.long()), TypeError, "teacher_topk_logprobs"),
        (lambda z, i, lp, m: topk_divergence("forward_kl", z, i[:, :2], lp), ValueError, r"\[N, K\]"),
        (lambda z, i, lp, m: topk_divergence("forward_kl", z, i[:2], lp[:2]), ValueError, r"\[N, K\]"),
        (lambda z, i, lp, m: topk_divergence("forward_kl", z, i[:, :0], lp[:, :0]), ValueError, "K >= 1"),
        (lambda z, i, lp, m: topk_divergence("forward_kl", z, i, lp, m.float()), TypeError, "loss_mask"),
        (lambda z, i, lp, m: topk_divergence("forward_kl", z, i, lp, m[:2]), ValueError, "loss_mask"),
        (lambda z, i, lp, m: topk_divergence("forward_kl", z[0], i, lp), ValueError, "student_logits"),
        (lambda z, i, lp, m: topk_divergence("forward_kl", z.long(), i, lp), TypeError, "student_logits"),
        (lambda z, i, lp, m: linear_topk_divergence("forward_kl", z, z[:, :2], i, lp), ValueError, "H"),
        (lambda z, i, lp, m: topk_divergence("kl", z, i, lp), ValueError, "kind"),
    ],
)
def test_bad_inputs_are_refused_by_name(call, error, match) -> None:
    z, ids, lp = torch.randn(4, 6), torch.tensor([[0, 1, 2]] * 4), torch.full((4, 3), -2.0)
    with pytest.raises(error, match=match):
        call(z, ids, lp, torch.ones(4, dtype=torch.bool))
