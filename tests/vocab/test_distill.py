"""packloss.vocab.distill: per-token divergences from logits: values, gradients, masking, memory, syncs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from packloss.testing import OpCounter
from packloss.vocab.distill import divergence, forward_kl, jsd, reverse_kl, soft_cross_entropy
from tests.vocab.harness import (
    BETA,
    NEG_INF,
    TOL,
    LargeAllocations,
    ParallelRun,
    assert_close_to_scale,
    assert_second_backward_raises,
    check_vocab_parallel,
    gen,
    kl_div_per_token,
    kl_div_reference,
    logits_inputs,
    padded_logits,
    teacher_as,
    token_mean_weights,
    xlogy_reference,
)

LOSSES = {
    "reverse_kl": reverse_kl,
    "forward_kl": forward_kl,
    "soft_cross_entropy": soft_cross_entropy,
    "jsd": lambda *a, **k: jsd(*a, beta=0.3, **k),
}
KINDS = list(LOSSES)


def _run(kind: str, s, t, mask, weights: torch.Tensor | None = None, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token losses, d(Σ_members w_t L_t)/ds) of packloss; ``w`` defaults to the token-mean weights."""
    s.grad = None
    per_token = LOSSES[kind](s, t, mask, **kw)
    w = token_mean_weights(mask, s.shape[0]) if weights is None else weights
    m = torch.ones(s.shape[0], dtype=torch.bool) if mask is None else mask
    torch.where(m, per_token * w.to(per_token.dtype), 0.0).sum().backward()
    return per_token.detach(), s.grad


# ---------------------------------------------------------------------------------------------------
# Values and gradients
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temps", [(1.0, 1.0), (2.0, 0.5)])
@pytest.mark.parametrize("chunk_size", [None, 3, 4])  # 11 rows: chunks of 3 and 4 leave a remainder
def test_matches_reference_fp32(kind: str, temps: tuple[float, float], chunk_size: int | None) -> None:
    s, t, mask = logits_inputs(v=37)  # V = 37: no chunk divides it
    kw = dict(temperature=temps[0], teacher_temperature=temps[1])
    per_token, grad = _run(kind, s, t, mask, chunk_size=chunk_size, impl="eager", **kw)
    ref_per_token, ref_grad = kl_div_reference(kind, s, t, mask, **kw)
    assert per_token.dtype == torch.float32 and grad.dtype == torch.float32 and per_token.shape == (11,)
    assert_close_to_scale(per_token, ref_per_token, rtol=1e-5)
    assert_close_to_scale(grad, ref_grad, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_weighted_sum_matches_naive_autograd(kind: str, chunk_size: int | None) -> None:
    """A non-uniform grad_output (``Σ w_t L_t``, w of both signs): the row-scaled backward equals
    autograd through the materialised divergence."""
    s, t, mask = logits_inputs(seed=3)
    w = torch.randn(s.shape[0], generator=torch.Generator().manual_seed(9))
    per_token, grad = _run(kind, s, t, mask, weights=w, chunk_size=chunk_size, temperature=1.3)
    ref_per_token, ref_grad = kl_div_reference(kind, s, t, mask, weights=w, temperature=1.3)
    assert_close_to_scale(per_token, ref_per_token, rtol=1e-5)
    assert_close_to_scale(grad, ref_grad, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_weighted_sum_float64_is_exact(kind: str) -> None:
    s, t, mask = logits_inputs(n=9, v=13, dtype=torch.float64, seed=4)
    w = torch.randn(9, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    per_token, grad = _run(kind, s, t, mask, weights=w, chunk_size=2, teacher_temperature=0.7)
    ref_per_token, ref_grad = kl_div_reference(kind, s, t, mask, weights=w, teacher_temperature=0.7)
    assert per_token.dtype == torch.float64 and grad.dtype == torch.float64
    torch.testing.assert_close(per_token, ref_per_token, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_divergence_equals_the_named_wrappers(kind: str) -> None:
    s, t, mask = logits_inputs()
    beta = {"beta": 0.3} if kind == "jsd" else {}
    got = divergence(kind, s, t, mask, temperature=1.5, chunk_size=4, **beta)
    want = LOSSES[kind](s, t, mask, temperature=1.5, chunk_size=4)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("beta, other", [(0.0, forward_kl), (1.0, reverse_kl)])
def test_jsd_endpoints_are_forward_and_reverse_kl(beta: float, other) -> None:
    s, t, mask = logits_inputs()
    loss = jsd(s, t, mask, beta=beta)
    loss.sum().backward()
    grad = s.grad.clone()
    s.grad = None
    other_loss = other(s, t, mask)
    other_loss.sum().backward()
    torch.testing.assert_close(loss, other_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, s.grad, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "dtype, rtol",
    [
        # The reference upcasts the SAME rounded inputs to float64, so the only errors are float32
        # accumulation (~1e-6 relative) and rounding the gradient to the logits' dtype: half an ulp,
        # 2**-9 (bf16) / 2**-12 (fp16) relative, once in the forward and once when the backward
        # scales the rows. We allow one ulp, 2**-8 / 2**-11, with the same relative floor at
        # rtol · max|grad| for entries near zero.
        (torch.bfloat16, 2.0**-8),
        (torch.float16, 2.0**-11),
    ],
)
def test_matches_reference_low_precision(kind: str, dtype: torch.dtype, rtol: float) -> None:
    s, t, mask = logits_inputs(n=9, v=50, dtype=dtype)
    per_token, grad = _run(kind, s, t, mask, chunk_size=4, temperature=1.5)
    ref_per_token, ref_grad = kl_div_reference(kind, s, t, mask, temperature=1.5)
    assert per_token.dtype == torch.float32 and grad.dtype == dtype
    assert_close_to_scale(per_token, ref_per_token, rtol=1e-5)  # the losses themselves stay float32
    assert_close_to_scale(grad, ref_grad, rtol=rtol)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("teacher_format", ["logits", "probs"])
def test_gradcheck_float64(kind: str, teacher_format: str) -> None:
    """The full Jacobian of the per-token vector: every one-hot grad_output row by row."""
    s, t, mask = logits_inputs(n=5, v=7, dtype=torch.float64)
    if teacher_format == "probs":
        t = torch.softmax(t, dim=-1)
    s = s.detach().requires_grad_()
    fn = LOSSES[kind]
    kw = dict(temperature=1.7, teacher_temperature=0.6, teacher_format=teacher_format, chunk_size=2)
    assert torch.autograd.gradcheck(lambda x: fn(x, t, mask, **kw), (s,))


@pytest.mark.parametrize("kind", KINDS)
def test_all_tokens_masked_gives_zero(kind: str) -> None:
    s, t, _ = logits_inputs()
    mask = torch.zeros(s.shape[0], dtype=torch.bool)
    s.grad = None
    per_token = LOSSES[kind](s, t, mask, chunk_size=4)
    per_token.sum().backward()
    assert torch.equal(per_token, torch.zeros_like(per_token))
    assert torch.equal(s.grad, torch.zeros_like(s.grad))


@pytest.mark.parametrize("kind", KINDS)
def test_extreme_logits_are_finite_and_correct(kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    n, v = 6, 40
    s = (1e4 * torch.randint(-1, 2, (n, v), generator=g).float()).requires_grad_()  # entries in {±1e4, 0}
    t = 1e4 * torch.randint(-1, 2, (n, v), generator=g).float()
    mask = torch.ones(n, dtype=torch.bool)
    per_token, grad = _run(kind, s, t, mask, chunk_size=4)
    assert torch.isfinite(per_token).all() and torch.isfinite(grad).all()
    ref_per_token, ref_grad = kl_div_reference(kind, s, t, mask)
    assert_close_to_scale(per_token, ref_per_token, rtol=1e-5)
    assert_close_to_scale(grad, ref_grad, rtol=1e-5)


@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_identical_teacher_and_student_row_has_zero_divergence(kind: str, temperature: float) -> None:
    s, t, _ = logits_inputs()
    t[2] = s[2].detach()
    mask = torch.zeros(s.shape[0], dtype=torch.bool)
    mask[2] = True
    per_token, grad = _run(
        kind, s, t, mask, weights=torch.ones(s.shape[0]), temperature=temperature, teacher_temperature=temperature
    )
    assert per_token.abs().max().item() < 1e-6
    assert grad.abs().max().item() < 1e-6


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("teacher_format", ["logprobs", "probs"])
def test_teacher_given_as_probabilities(kind: str, teacher_format: str) -> None:
    s, t, mask = logits_inputs()
    log_p = torch.log_softmax(t, dim=-1)
    given = log_p if teacher_format == "logprobs" else log_p.exp()
    kw = dict(teacher_temperature=0.8)
    per_token, grad = _run(kind, s, given, mask, teacher_format=teacher_format, **kw)
    ref_per_token, ref_grad = _run(kind, s.detach().clone().requires_grad_(), t, mask, **kw)
    assert_close_to_scale(per_token, ref_per_token, rtol=1e-5)
    assert_close_to_scale(grad, ref_grad, rtol=1e-5)


@pytest.mark.parametrize("kind", ["forward_kl", "soft_cross_entropy", "jsd"])
def test_teacher_probabilities_with_exact_zeros(kind: str) -> None:
    s, t, mask = logits_inputs()
    p = torch.softmax(t, dim=-1)
    p[:, ::3] = 0.0
    p = p / p.sum(-1, keepdim=True)
    per_token, grad = _run(kind, s, p, mask, teacher_format="probs", chunk_size=4)
    ref_per_token, ref_grad = kl_div_reference(kind, s, p, mask, teacher_format="probs")
    assert torch.isfinite(per_token).all() and torch.isfinite(grad).all()
    assert_close_to_scale(per_token, ref_per_token, rtol=1e-5)
    assert_close_to_scale(grad, ref_grad, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("garbage", [math.inf, -math.inf, math.nan, 1e30])
def test_non_member_rows_never_leak(kind: str, garbage: float) -> None:
    """Garbage logits, teacher rows AND caller weights off the members: exactly the clean result."""
    s, t, mask = logits_inputs()
    w = torch.randn(s.shape[0], generator=torch.Generator().manual_seed(5))
    clean_per_token, clean_grad = _run(kind, s, t, mask, weights=w, chunk_size=4)
    dirty_s, dirty_t, dirty_w = s.detach().clone(), t.clone(), w.clone()
    dirty_s[~mask] = garbage
    dirty_t[~mask] = garbage
    dirty_w[~mask] = math.nan  # reaches the backward as a NaN grad_output on non-member rows
    dirty_s.requires_grad_()
    per_token, grad = _run(kind, dirty_s, dirty_t, mask, weights=dirty_w, chunk_size=4)
    torch.testing.assert_close(per_token, clean_per_token, rtol=0, atol=0)
    torch.testing.assert_close(grad, clean_grad, rtol=0, atol=0)
    assert torch.equal(per_token[~mask], torch.zeros_like(per_token[~mask]))
    assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))


@given(
    n=st.integers(1, 9),
    v=st.integers(2, 30),
    chunk=st.integers(1, 5),
    t_s=st.floats(0.25, 4.0),
    t_t=st.floats(0.25, 4.0),
    beta=st.floats(0.05, 0.95),
)
@settings(max_examples=15, deadline=None)
def test_jsd_matches_reference_property(n: int, v: int, chunk: int, t_s: float, t_t: float, beta: float) -> None:
    s, t, mask = logits_inputs(n=n, v=v, seed=n * 31 + v)
    s.grad = None
    per_token = jsd(s, t, mask, beta=beta, temperature=t_s, teacher_temperature=t_t, chunk_size=chunk)
    (per_token.sum() / mask.sum()).backward()
    s64 = s.detach().double().requires_grad_()
    log_q = F.log_softmax(s64 / t_s, dim=-1)
    log_p = F.log_softmax(t.double() / t_t, dim=-1)
    ref = torch.where(mask, kl_div_per_token("jsd", log_q, log_p, beta=beta), 0.0)
    (ref.sum() / mask.sum()).backward()
    # Random shapes include near-degenerate rows (V = 2, T = 0.25) whose gradient q (log q − log m
    # − KL) is a float32 cancellation of O(1) terms: an absolute floor of 1e-6 covers that rounding.
    assert_close_to_scale(per_token.detach(), ref.detach(), rtol=1e-5, floor=1e-6)
    assert_close_to_scale(s.grad, s64.grad, rtol=1e-5, floor=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_no_mask_means_every_token(kind: str) -> None:
    s, t, _ = logits_inputs()
    per_token, grad = _run(kind, s, t, None)
    ref_per_token, ref_grad = kl_div_reference(kind, s, t, None)
    assert_close_to_scale(per_token, ref_per_token, rtol=1e-5)
    assert_close_to_scale(grad, ref_grad, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_split_in_halves_equals_whole(kind: str) -> None:
    """Per-token losses are local to their rows: two micro-batches with a shared denominator give the
    whole batch's losses and gradient."""
    s, t, mask = logits_inputs(n=12)
    denominator = mask.sum().float()  # the global member count, shared by both halves
    whole = LOSSES[kind](s, t, mask, chunk_size=5)
    (whole.sum() / denominator).backward()
    whole_grad = s.grad.clone()
    s.grad = None
    halves = [slice(0, 7), slice(7, 12)]
    parts = [LOSSES[kind](s[h], t[h], mask[h], chunk_size=5) for h in halves]
    sum(p.sum() / denominator for p in parts).backward()
    assert_close_to_scale(torch.cat(parts).detach(), whole.detach(), rtol=1e-6)
    assert_close_to_scale(s.grad, whole_grad, rtol=1e-6)


def test_grad_output_scales_the_gradient_and_retain_graph_is_safe() -> None:
    s, t, mask = logits_inputs()
    w = torch.randn(s.shape[0], generator=torch.Generator().manual_seed(3))
    _, grad = _run("reverse_kl", s, t, mask, weights=w)
    grad = grad.clone()
    s.grad = None
    per_token = reverse_kl(s, t, mask)
    loss = torch.where(mask, per_token * w, 0.0).sum()
    (3.0 * loss).backward(retain_graph=True)  # graph kept: the saved gradient must stay intact
    first = s.grad.clone()
    s.grad = None
    (-0.5 * loss).backward()  # last backward: scaled in place
    torch.testing.assert_close(first, 3.0 * grad)
    torch.testing.assert_close(s.grad, -0.5 * grad)


def test_teacher_gets_no_gradient() -> None:
    s, t, mask = logits_inputs()
    t.requires_grad_()
    reverse_kl(s, t, mask).sum().backward()
    assert t.grad is None and s.grad is not None


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda s, t, m: reverse_kl(s, t[:, :-1], m), ValueError),
        (lambda s, t, m: reverse_kl(s, t, m[:-1]), ValueError),
        (lambda s, t, m: reverse_kl(s[0], t[0], None), ValueError),
        (lambda s, t, m: reverse_kl(s, t.long(), m), TypeError),
        (lambda s, t, m: reverse_kl(s, t, m, teacher_format="softmax"), ValueError),
        (lambda s, t, m: reverse_kl(s, t, m, temperature=0.0), ValueError),
        (lambda s, t, m: reverse_kl(s, t, m, temperature=math.nan), ValueError),
        (lambda s, t, m: reverse_kl(s, t, m, teacher_temperature=math.inf), ValueError),
        (lambda s, t, m: reverse_kl(s, t, m, temperature="1"), TypeError),
        (lambda s, t, m: reverse_kl(s, t, m, impl="triton"), ValueError),
        (lambda s, t, m: reverse_kl(s, t, m, chunk_size=0), ValueError),
        (lambda s, t, m: reverse_kl(s, t, m, chunk_size=2.5), TypeError),
        (lambda s, t, m: reverse_kl(s, t, m, parallel="world"), TypeError),
        (lambda s, t, m: jsd(s, t, m, beta=1.5), ValueError),
        (lambda s, t, m: jsd(s, t, m, beta=math.nan), ValueError),
        (lambda s, t, m: divergence("kl", s, t, m), ValueError),
    ],
)
def test_invalid_arguments_raise(call, error) -> None:
    s, t, mask = logits_inputs()
    with pytest.raises(error):
        call(s, t, mask)


def test_errors_name_the_argument() -> None:
    s, t, mask = logits_inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        reverse_kl(s, t, mask, chunk_size=0)
    with pytest.raises(ValueError, match="teacher_temperature"):
        reverse_kl(s, t, mask, teacher_temperature=math.nan)
    with pytest.raises(ValueError, match="reverse_kl"):  # the choices are listed
        divergence("kl", s, t, mask)
    with pytest.raises(TypeError, match="VocabParallel"):
        reverse_kl(s, t, mask, parallel="world")


# ---------------------------------------------------------------------------------------------------
# Memory structure and syncs
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_saves_only_the_gradient(kind: str, dtype: torch.dtype) -> None:
    n, v = 64, 50
    s, t, mask = logits_inputs(n=n, v=v, dtype=dtype)
    w = torch.randn(n, generator=torch.Generator().manual_seed(1))
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(x.shape), x.dtype))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        LOSSES[kind](s, t, mask, chunk_size=8)
    large = [entry for entry in saved if math.prod(entry[0]) >= n * v]
    assert large == [((n, v), dtype)]  # the gradient, in the logits' dtype
    assert saved == [((n, v), dtype), ((n,), torch.bool)]  # and only the [N] mask besides
    with LargeAllocations(n * v, [s, t]) as allocations:
        per_token = LOSSES[kind](s, t, mask, chunk_size=8)
        (per_token * w).sum().backward()
    # one [N, V] buffer in forward+backward: the gradient (rows scaled in place in backward and handed
    # to .grad as is); chunks of 8 rows stay far below the threshold
    assert len(allocations.fresh) == 1, allocations.fresh
    assert s.grad.untyped_storage().data_ptr() in allocations.seen


@pytest.mark.parametrize("kind", KINDS)
def test_no_syncs_in_forward_and_backward(kind: str) -> None:
    s, t, mask = logits_inputs(n=12)
    w = torch.rand(12)
    with OpCounter() as counter:
        per_token = LOSSES[kind](s, t, mask, chunk_size=5)
        (torch.where(mask, per_token * w, 0.0).sum() / mask.sum().clamp(min=1)).backward()
    assert counter.num_syncs == 0, counter.syncs
    with OpCounter() as counter:
        LOSSES[kind](s, t, None, chunk_size=5).sum().backward()
    assert counter.num_syncs == 0, counter.syncs


# ---------------------------------------------------------------------------------------------------
# Compiled path (kept to one small test: the first compile takes tens of seconds on a small CPU)
# ---------------------------------------------------------------------------------------------------


def test_compiled_matches_eager_without_recompiling_per_n() -> None:
    from torch._dynamo.utils import counters

    graphs = []
    for n in (12, 19):  # chunks of 5: heights 5 and 2, then 5 and 4
        s, t, mask = logits_inputs(n=n, v=33, seed=n)
        w = torch.randn(n, generator=torch.Generator().manual_seed(n))
        per_token, grad = _run("reverse_kl", s, t, mask, weights=w, chunk_size=5, impl="compiled")
        grad = grad.clone()
        eager_per_token, eager_grad = _run("reverse_kl", s, t, mask, weights=w, chunk_size=5, impl="eager")
        assert_close_to_scale(per_token, eager_per_token, rtol=1e-5)
        assert_close_to_scale(grad, eager_grad, rtol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0]  # the second batch size reused the first compilation


# ---------------------------------------------------------------------------------------------------
# Edges (0 · log 0 = 0: teacher zeros, padded vocabularies; double backward; N = 0, V = 0); vocab-parallel
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["forward_kl", "soft_cross_entropy", "jsd"])
@pytest.mark.parametrize("fmt", ["logits", "logprobs", "probs"])
def test_teacher_minus_inf_counts_zero(kind: str, fmt: str) -> None:
    g = gen(1)
    s = torch.randn(9, 13, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(9, 13, generator=g, dtype=torch.float64)
    t[:, [0, 5]] = NEG_INF  # zero-probability tokens
    t[3, 1:9] = NEG_INF
    teacher, w = teacher_as(t, fmt), torch.randn(9, generator=g, dtype=torch.float64)
    got = divergence(kind, s, teacher, beta=BETA, teacher_format=fmt, chunk_size=4, impl="eager")
    (got * w).sum().backward()
    s_ref = s.detach().clone().requires_grad_()
    want = xlogy_reference(kind, s_ref, t, "logits")
    (want * w).sum().backward()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want.detach(), **TOL)
    torch.testing.assert_close(s.grad, s_ref.grad, **TOL)


@pytest.mark.parametrize("fmt", ["logits", "logprobs", "probs"])
def test_reverse_kl_teacher_zero_where_student_is_not_is_inf(fmt: str) -> None:
    s = torch.randn(4, 6, dtype=torch.float64)
    t = torch.randn(4, 6, dtype=torch.float64)
    t[:, 2] = NEG_INF
    assert torch.equal(reverse_kl(s, teacher_as(t, fmt), teacher_format=fmt), torch.full((4,), math.inf).double())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["logits", "logprobs", "probs"])
@pytest.mark.parametrize("temps", [(1.0, 1.0), (2.0, 0.5)])
def test_padded_vocabulary_equals_unpadded(kind: str, fmt: str, temps: tuple[float, float]) -> None:
    s, t, real = padded_logits()
    s.requires_grad_()
    w = torch.randn(s.shape[0], generator=gen(2), dtype=torch.float64)
    got = divergence(
        kind, s, teacher_as(t, fmt), beta=BETA, temperature=temps[0], teacher_temperature=temps[1],
        teacher_format=fmt, chunk_size=4, impl="eager",
    )  # fmt: skip
    (got * w).sum().backward()
    s_ref = s.detach()[:, real].clone().requires_grad_()
    want = xlogy_reference(kind, s_ref, teacher_as(t[:, real], fmt), fmt, temps)
    (want * w).sum().backward()
    torch.testing.assert_close(got, want.detach(), **TOL)
    torch.testing.assert_close(s.grad[:, real], s_ref.grad, **TOL)
    pad = torch.ones(s.shape[1], dtype=torch.bool)
    pad[real] = False
    assert torch.equal(s.grad[:, pad], torch.zeros_like(s.grad[:, pad]))  # exactly 0, not NaN


@pytest.mark.parametrize("kind", KINDS)
def test_divergence_double_backward_raises(kind: str) -> None:
    s = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    per_token = divergence(kind, s, torch.randn(5, 7, dtype=torch.float64), beta=BETA, impl="eager")
    assert_second_backward_raises((per_token**2).sum(), s)  # grad_output depends on s


@pytest.mark.parametrize("kind", KINDS)
def test_divergence_empty_tokens(kind: str) -> None:
    s = torch.randn(0, 7, requires_grad=True)
    per_token = divergence(kind, s, torch.randn(0, 7), impl="eager")
    assert per_token.shape == (0,)
    per_token.sum().backward()
    assert torch.equal(s.grad, torch.zeros(0, 7))


def test_divergence_empty_vocabulary_raises() -> None:
    with pytest.raises(ValueError, match="student_logits"):
        divergence("reverse_kl", torch.randn(3, 0), torch.randn(3, 0))


PARALLEL_RUNS = [
    ParallelRun("logits:reverse_kl", 31, True),
    ParallelRun("logits:jsd", 30, False, beta=0.3),
]


def test_vocab_parallel_matches_single_process():
    check_vocab_parallel(PARALLEL_RUNS)


@pytest.mark.parametrize("where", ["teacher_logits", "loss_mask"])
def test_a_tensor_on_another_device_is_refused_by_name(where):
    s, t, m = torch.randn(4, 8), torch.randn(4, 8), torch.ones(4, dtype=torch.bool)
    args = {"teacher_logits": t, "loss_mask": m}
    args[where] = torch.empty_like(args[where], device="meta")
    with pytest.raises(ValueError, match=f"{where} is on the meta device"):
        reverse_kl(s, args["teacher_logits"], args["loss_mask"])


def test_a_fractional_float_mask_is_refused_not_binarised():
    with pytest.raises(TypeError, match="loss_mask must be a bool"):
        reverse_kl(torch.randn(3, 5), torch.randn(3, 5), torch.tensor([0.5, 0.0, 1.0]))
    ints = reverse_kl(torch.randn(3, 5), torch.randn(3, 5), torch.tensor([1, 0, 1]))  # integers: as bool
    assert ints[1] == 0
