"""packloss.vocab.support: log-probs renormalised over the sampler's support (CSR and top-k forms) and
full-vocabulary log-probs at K ids, against float64 [N, V] references written here; labels outside the
support, ignored NaN rows, dtypes, syncs, the largest tensor, bad arguments."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packloss.testing import OpCounter
from packloss.vocab.head import linear_logprobs
from packloss.vocab.support import logprobs_at, support_logprobs
from tests.vocab.harness import IGNORE, MaxNumel, assert_second_backward_raises

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------------
# float64 references over the materialised [N, V] logits
# ---------------------------------------------------------------------------------------------------


def _logits(hidden, weight, temperature, softcap):
    z = hidden @ weight.T  # [N, V]
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature[:, None]


def support_reference(hidden, weight, labels, mask, temperature, softcap):
    """``log_softmax`` of the logits with −inf outside ``mask [N, V]``; log-prob and entropy 0 at ignored
    positions, entropy 0 for an empty support, log-prob −inf for a label outside its support."""
    x = _logits(hidden, weight, temperature, softcap)
    nonempty = mask.any(dim=1, keepdim=True)  # [N, 1]
    x = torch.where(mask, x, -math.inf).where(nonempty, 0.0)  # an empty row: no NaN in the reference graph
    log_p = torch.log_softmax(x, dim=-1)  # [N, V]
    valid = labels != IGNORE
    lp = log_p.gather(1, torch.where(valid, labels, 0)[:, None]).squeeze(1)
    entropy = -(log_p.exp() * torch.where(mask, log_p, 0.0)).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, entropy, 0.0)


def at_reference(hidden, weight, token_ids, temperature, softcap):
    log_p = torch.log_softmax(_logits(hidden, weight, temperature, softcap), dim=-1)  # [N, V]
    present = (token_ids >= 0) & (token_ids < weight.shape[0])
    return torch.where(present, log_p.gather(1, torch.where(present, token_ids, 0)), 0.0)


def _grads(outputs, hidden, weight, seed=1):
    """Values and ``∂/∂(hidden, weight)`` of ``Σ g · outputs`` with random upstream ``g`` per output."""
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=F64).to(o.dtype)).sum() for o in outputs)
    return [o.detach() for o in outputs] + list(torch.autograd.grad(loss, [hidden, weight]))


# ---------------------------------------------------------------------------------------------------
# supports
# ---------------------------------------------------------------------------------------------------


def random_case(n, h, v, seed, size, ignore_every=4, dtype=F64):
    """``hidden, weight, labels, mask [N, V], temperature``: ``size`` is ``"one"``, ``"k"`` (a random size
    per position), ``"full"`` or an int; the label is a member of its support, ignored positions (every
    ``ignore_every``-th) may have an empty one."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=F64).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=F64).to(dtype).requires_grad_()
    mask = torch.zeros(n, v, dtype=torch.bool)
    labels = torch.empty(n, dtype=torch.long)
    ignored = torch.arange(n) % ignore_every == ignore_every - 1
    for t in range(n):
        k = {"one": 1, "full": v, "k": int(torch.randint(1, v + 1, (1,), generator=g))}.get(size, size)
        k = 0 if ignored[t] and torch.rand(1, generator=g) < 0.5 else k
        members = torch.randperm(v, generator=g)[:k]
        mask[t, members] = True
        labels[t] = IGNORE if ignored[t] else members[int(torch.randint(0, k, (1,), generator=g))]
    temperature = torch.rand(n, generator=g, dtype=F64).add(0.5)
    return hidden, weight, labels, mask, temperature


def as_csr(mask, seed=0):
    """``(token_ids [nnz], offsets [N+1])`` of ``mask``, each position's ids in a random order."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.nonzero(m).squeeze(1) for m in mask]
    rows = [r[torch.randperm(len(r), generator=g)] for r in rows]
    counts = torch.tensor([len(r) for r in rows], dtype=torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long), offsets


def as_topk(mask, pad=1, seed=0):
    """``token_ids [N, K]`` of ``mask`` with ``K = max support + pad``, −1 pads shuffled among the ids."""
    g = torch.Generator().manual_seed(seed)
    k = int(mask.sum(1).max()) + pad
    out = torch.full((mask.shape[0], k), -1, dtype=torch.long)
    for t, m in enumerate(mask):
        row = torch.cat([torch.nonzero(m).squeeze(1), torch.full((k - int(m.sum()),), -1)])
        out[t] = row[torch.randperm(k, generator=g)]
    return out


def support_args(mask, form, seed=0):
    return as_csr(mask, seed) if form == "csr" else (as_topk(mask, seed=seed), None)


# ---------------------------------------------------------------------------------------------------
# values and gradients against the reference
# ---------------------------------------------------------------------------------------------------


@settings(max_examples=240, deadline=None)
@given(
    n=st.integers(1, 10),
    h=st.integers(1, 6),
    v=st.integers(1, 20),
    size=st.sampled_from(["one", "k", "full", 3]),
    form=st.sampled_from(["csr", "topk"]),
    per_token=st.booleans(),
    softcap=st.sampled_from([None, 1.5]),
    chunk=st.sampled_from([None, 1, 5]),
    seed=st.integers(0, 2**16),
)
def test_support_matches_float64_reference(n, h, v, size, form, per_token, softcap, chunk, seed):
    size = min(size, v) if isinstance(size, int) else size
    hidden, weight, labels, mask, temps = random_case(n, h, v, seed, size)
    temperature = temps if per_token else 0.8
    t_vec = temps if per_token else torch.full((n,), 0.8, dtype=F64)
    token_ids, offsets = support_args(mask, form, seed)
    got = support_logprobs(
        hidden, weight, labels, token_ids, offsets, temperature=temperature, softcap=softcap, chunk_size=chunk
    )
    assert got[0].dtype == F64 and got[1].dtype == F64
    got = _grads(got, hidden, weight)
    want = _grads(support_reference(hidden, weight, labels, mask, t_vec, softcap), hidden, weight)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("form", ["csr", "topk"])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_full_vocabulary_support_equals_linear_logprobs(form, softcap):
    """Float32: the support being the whole vocabulary gives the fused head's log-probs and, at the
    labelled positions, its entropy and gradients."""
    hidden, weight, labels, mask, temps = random_case(24, 16, 40, seed=3, size="full", dtype=torch.float32)
    mask[:] = True  # ignored positions too, so the entropy of every row is comparable
    token_ids, offsets = support_args(mask, form)
    valid = labels != IGNORE
    g = torch.Generator().manual_seed(5)
    g1, g2 = torch.randn(24, generator=g), torch.randn(24, generator=g) * valid

    def grads(lp, ent):
        loss = (lp * g1).sum() + (ent * g2).sum()
        return [lp.detach(), torch.where(valid, ent, 0.0).detach(), *torch.autograd.grad(loss, [hidden, weight])]

    got = grads(*support_logprobs(hidden, weight, labels, token_ids, offsets, temperature=temps, softcap=softcap))
    want = grads(
        *linear_logprobs(
            hidden, weight, labels, temperature=temps, softcap=softcap, entropy_grad=True, vocab_chunk_size=16
        )
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["csr", "topk"])
def test_label_outside_support_is_minus_inf_without_gradient(form):
    hidden, weight, labels, mask, temps = random_case(6, 4, 12, seed=2, size=3)
    outside = (~mask[0]).nonzero()[0, 0]
    labels[0] = outside
    token_ids, offsets = support_args(mask, form)
    lp, ent = support_logprobs(hidden, weight, labels, token_ids, offsets, temperature=temps)
    assert lp[0] == -math.inf and torch.isfinite(lp[1:]).all()
    ref_lp, ref_ent = support_reference(hidden, weight, labels, mask, temps, None)
    torch.testing.assert_close(ent, ref_ent, **TOL)
    # the −inf row gets no gradient from its log-prob: the gradient equals the one with that row ignored
    (d_h,) = torch.autograd.grad(torch.where(torch.isfinite(lp), lp, 0.0).sum() + ent.sum(), [hidden])
    labels[0] = IGNORE
    ref_lp, _ = support_reference(hidden, weight, labels, mask, temps, None)
    (want,) = torch.autograd.grad(ref_lp.sum() + ref_ent.sum(), [hidden])
    torch.testing.assert_close(d_h, want, **TOL)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        ("label", "labels must be in their position's support"),
        ("duplicate", "distinct within a position"),
        ("id", "token_ids must be in \\[-1, V\\)"),
        ("offsets", "offsets must start at 0"),
    ],
)
def test_check_support_raises_naming_the_problem(corrupt, message):
    hidden, weight, labels, mask, temps = random_case(6, 4, 12, seed=2, size=3)
    token_ids, offsets = as_csr(mask)
    support_logprobs(hidden, weight, labels, token_ids, offsets, check_support=True)  # the clean input passes
    if corrupt == "label":
        labels[1] = (~mask[1]).nonzero()[0, 0]
    elif corrupt == "duplicate":
        token_ids[offsets[1] + 1] = token_ids[offsets[1]]
    elif corrupt == "id":
        token_ids[0] = 12
    else:
        offsets[3] = offsets[4] + 1
    with pytest.raises(ValueError, match=message):
        support_logprobs(hidden, weight, labels, token_ids, offsets, check_support=True)


def test_check_support_accepts_topk_padding():
    hidden, weight, labels, mask, _ = random_case(6, 4, 12, seed=2, size=3)
    support_logprobs(hidden, weight, labels, as_topk(mask, pad=3), check_support=True)
    labels[0] = (~mask[0]).nonzero()[0, 0]
    with pytest.raises(ValueError, match="labels must be in their position's support"):
        support_logprobs(hidden, weight, labels, as_topk(mask, pad=3), check_support=True)


@pytest.mark.parametrize("form", ["csr", "topk"])
def test_ignored_positions_may_hold_nan(form):
    hidden, weight, labels, mask, temps = random_case(12, 6, 15, seed=4, size="k")
    token_ids, offsets = support_args(mask, form)
    ignored = labels == IGNORE
    clean = _grads(support_logprobs(hidden, weight, labels, token_ids, offsets, temperature=temps), hidden, weight)
    poisoned = hidden.detach().clone()
    poisoned[ignored] = math.nan
    poisoned.requires_grad_()
    got = _grads(support_logprobs(poisoned, weight, labels, token_ids, offsets, temperature=temps), poisoned, weight)
    assert ignored.any() and torch.equal(got[0][ignored], torch.zeros(int(ignored.sum()), dtype=F64))
    for a, b in zip(got, clean, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **TOL)
    assert torch.equal(got[2][ignored], torch.zeros_like(got[2][ignored]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_inputs_give_float32(dtype):
    hidden, weight, labels, mask, temps = random_case(16, 8, 20, seed=6, size="k", dtype=dtype)
    lp, ent = support_logprobs(hidden, weight, labels, as_topk(mask), temperature=temps)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    d_h, d_w = torch.autograd.grad(lp.sum() + ent.sum(), [hidden, weight])
    assert d_h.dtype == dtype and d_w.dtype == dtype
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = support_reference(h64, w64, labels, mask, temps.double(), None)
    for a, b in zip((lp, ent), ref, strict=True):
        torch.testing.assert_close(a.double(), b.detach(), rtol=1e-5, atol=1e-5)


def test_return_entropy_false_and_one_gradient():
    hidden, weight, labels, mask, temps = random_case(9, 5, 13, seed=7, size="k")
    token_ids, offsets = as_csr(mask)
    lp, ent = support_logprobs(hidden, weight, labels, token_ids, offsets, return_entropy=False)
    assert ent is None
    want, _ = support_reference(hidden, weight, labels, mask, torch.ones(9, dtype=F64), None)
    (d_w,) = torch.autograd.grad(lp.sum(), [weight])
    (ref,) = torch.autograd.grad(want.sum(), [weight])
    torch.testing.assert_close(d_w, ref, **TOL)


def test_int32_ids_and_empty_n():
    hidden, weight, labels, mask, temps = random_case(7, 4, 9, seed=8, size="k")
    token_ids, offsets = as_csr(mask)
    got = support_logprobs(hidden, weight, labels.int(), token_ids.int(), offsets.int(), temperature=temps)
    want = support_logprobs(hidden, weight, labels, token_ids, offsets, temperature=temps)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    empty = hidden[:0].detach().requires_grad_()
    lp, ent = support_logprobs(empty, weight, labels[:0], token_ids[:0], offsets[:1])
    assert lp.shape == (0,) and ent.shape == (0,)
    lp.sum().backward()


def test_second_backward_raises():
    hidden, weight, labels, mask, _ = random_case(5, 3, 7, seed=9, size="k")
    lp, ent = support_logprobs(hidden, weight, labels, as_topk(mask))
    assert_second_backward_raises(lp.sum() + ent.sum(), hidden)


# ---------------------------------------------------------------------------------------------------
# syncs and the largest tensor
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["csr", "topk"])
def test_no_syncs_and_no_tensor_beyond_the_inputs_scale(form):
    """Forward + backward read no device value, and no tensor exceeds ``max(N·H, V·H, E·H, nnz)``
    elements (``E`` the entry chunk), far below ``N · V``."""
    n, h, v, k, chunk = 256, 8, 512, 8, 64
    hidden, weight, labels, mask, temps = random_case(n, h, v, seed=10, size=k, dtype=torch.float32)
    token_ids, offsets = support_args(mask, form)
    nnz = int(mask.sum()) if form == "csr" else token_ids.numel()
    with OpCounter() as counter, MaxNumel() as sizes:
        lp, ent = support_logprobs(
            hidden, weight, labels, token_ids, offsets, temperature=temps, softcap=5.0, chunk_size=chunk
        )
        (lp.sum() + ent.sum()).backward()
    assert counter.num_syncs == 0, counter.syncs
    assert sizes.max_numel <= max(n * h, v * h, chunk * h, nnz) <= n * v // 16


def test_logprobs_at_no_syncs_and_blocks_only():
    n, h, v, k = 64, 16, 96, 5
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    token_ids = torch.randint(-1, v, (n, k), generator=g)
    with OpCounter() as counter, MaxNumel() as sizes:
        out = logprobs_at(hidden, weight, token_ids, softcap=5.0, chunk_size=16, vocab_chunk_size=32)
        out.sum().backward()
    assert counter.num_syncs == 0, counter.syncs
    assert sizes.max_numel <= max(16 * 32, n * h, v * h, n * k) < n * v


# ---------------------------------------------------------------------------------------------------
# logprobs_at
# ---------------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 9),
    h=st.integers(1, 5),
    v=st.integers(1, 20),
    k=st.integers(0, 6),
    per_token=st.booleans(),
    softcap=st.sampled_from([None, 2.0]),
    chunk=st.sampled_from([None, 1, 4]),
    vchunk=st.sampled_from([None, 1, 7]),
    seed=st.integers(0, 2**16),
)
def test_logprobs_at_matches_float64_reference(n, h, v, k, per_token, softcap, chunk, vchunk, seed):
    """Ids drawn from ``[−2, V + 1]``: −1 / −2 and ``V``, ``V + 1`` are absent, repeats allowed."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=F64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=F64, requires_grad=True)
    token_ids = torch.randint(-2, v + 2, (n, k), generator=g)
    temps = torch.rand(n, generator=g, dtype=F64).add(0.5)
    temperature = temps if per_token else 1.3
    t_vec = temps if per_token else torch.full((n,), 1.3, dtype=F64)
    out = logprobs_at(
        hidden, weight, token_ids, temperature=temperature, softcap=softcap, chunk_size=chunk, vocab_chunk_size=vchunk
    )
    assert out.shape == (n, k) and out.dtype == F64
    got = _grads([out], hidden, weight)
    want = _grads([at_reference(hidden, weight, token_ids, t_vec, softcap)], hidden, weight)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_logprobs_at_bf16_and_second_backward():
    g = torch.Generator().manual_seed(12)
    hidden = torch.randn(10, 8, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(30, 8, generator=g).bfloat16().requires_grad_()
    token_ids = torch.randint(0, 30, (10, 4), generator=g)
    out = logprobs_at(hidden, weight, token_ids, vocab_chunk_size=7)
    assert out.dtype == torch.float32
    ref = at_reference(hidden.detach().double(), weight.detach().double(), token_ids, torch.ones(10, dtype=F64), None)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert_second_backward_raises(out.sum(), hidden)


# ---------------------------------------------------------------------------------------------------
# bad arguments
# ---------------------------------------------------------------------------------------------------


def _args():
    hidden, weight, labels, mask, _ = random_case(6, 4, 10, seed=13, size=3, ignore_every=100)
    return hidden, weight, labels, *as_csr(mask)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda h, w, y, ids, off: support_logprobs(h, w, y, ids.float(), off), TypeError, "token_ids"),
        (lambda h, w, y, ids, off: support_logprobs(h, w, y, ids[:, None], off), ValueError, "token_ids"),
        (lambda h, w, y, ids, off: support_logprobs(h, w, y, ids, off[:-1]), ValueError, "offsets"),
        (lambda h, w, y, ids, off: support_logprobs(h, w, y, ids, off.bool()), TypeError, "offsets"),
        (lambda h, w, y, ids, off: support_logprobs(h, w, y, ids.view(6, 3)[:5]), ValueError, "token_ids"),
        (lambda h, w, y, ids, off: support_logprobs(h, w, y, ids), ValueError, "token_ids"),
        (lambda h, w, y, ids, off: support_logprobs(h, w, y[:-1], ids, off), ValueError, "labels"),
        (lambda h, w, y, ids, off: support_logprobs(h, w, y, ids, off, softcap=0.0), ValueError, "softcap"),
        (lambda h, w, y, ids, off: support_logprobs(h, w, y, ids, off, chunk_size=0), ValueError, "chunk_size"),
        (lambda h, w, y, ids, off: support_logprobs(h, w, y, ids, off, temperature=-1.0), ValueError, "temperature"),
        (lambda h, w, y, ids, off: support_logprobs(h[:0], w, y[:0], ids, off[:1]), ValueError, "N = 0"),
        (lambda h, w, y, ids, off: support_logprobs(h, w, y, ids, off, check_support=1), TypeError, "check_support"),
        (lambda h, w, y, ids, off: logprobs_at(h, w, ids), ValueError, "token_ids"),
        (lambda h, w, y, ids, off: logprobs_at(h, w, ids.view(6, 3)[:5]), ValueError, "token_ids"),
        (lambda h, w, y, ids, off: logprobs_at(h, w, ids.view(6, 3), vocab_chunk_size=0), ValueError, "vocab_chunk"),
        (lambda h, w, y, ids, off: logprobs_at(h, w[:, :3], ids.view(6, 3)), ValueError, "disagree on H"),
    ],
)
def test_bad_arguments_raise(call, error, match):
    with pytest.raises(error, match=match):
        call(*_args())
