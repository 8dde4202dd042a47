"""packloss.vocab.head: fused log-probs / entropy / distillation against materialised autograd references."""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from packloss.testing import OpCounter, run_gloo
from packloss.vocab.core import VocabParallel
from packloss.vocab.distill import divergence
from packloss.vocab.head import linear_logprobs
from packloss.vocab.head_distill import linear_distill

IGNORE = -100


class MaxNumel(TorchDispatchMode):
    """Records the largest number of elements of any tensor produced by an aten op."""

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def _inputs(n: int, h: int, v: int, seed: int = 0, dtype=torch.float32):
    """``hidden [N, H]``, ``weight [V, H]``, labels with every 5th ignored, temperatures in [0.5, 1.5]."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = IGNORE
    temperature = torch.rand(n, generator=g, dtype=torch.float64).add(0.5).to(dtype)
    return hidden, weight, labels, temperature


def _reference(hidden, weight, labels, temperature, softcap, entropy_grad):
    """Materialised ``[N, V]`` autograd reference in the inputs' dtype."""
    z = hidden @ weight.T  # [N, V]
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = temperature if isinstance(temperature, torch.Tensor) else torch.full_like(z[:, 0], temperature)
    logp = torch.log_softmax(z / t[:, None], dim=-1)  # [N, V]
    valid = labels != IGNORE
    lp = logp.gather(1, torch.where(valid, labels, 0)[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, lp, 0.0), entropy if entropy_grad else entropy.detach()


def _grads(fn, hidden, weight, seed: int = 1):
    """``(logprobs, entropy, d_hidden, d_weight)`` of ``Σ g1·logprobs + Σ g2·entropy``."""
    lp, ent = fn()
    g = torch.Generator().manual_seed(seed)
    g1, g2 = torch.randn(lp.shape, generator=g), torch.randn(lp.shape, generator=g)
    loss = (lp * g1.to(lp.dtype)).sum() + (ent * g2.to(ent.dtype)).sum()
    d_h, d_w = torch.autograd.grad(loss, [hidden, weight])
    return lp.detach(), ent.detach(), d_h, d_w


def _assert_close(got, want, tol):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.to(torch.float32), b.to(torch.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("n,v,chunk,vchunk", [(37, 53, 8, 16), (64, 100, 64, 33), (5, 17, 2, 4)])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("per_token_temperature", [False, True])
def test_logprobs_match_reference(n, v, chunk, vchunk, softcap, entropy_grad, per_token_temperature):
    hidden, weight, labels, temps = _inputs(n, 24, v)
    temperature = temps if per_token_temperature else 0.7
    got = _grads(
        lambda: linear_logprobs(
            hidden,
            weight,
            labels,
            temperature=temperature,
            chunk_size=chunk,
            vocab_chunk_size=vchunk,
            softcap=softcap,
            entropy_grad=entropy_grad,
        ),
        hidden,
        weight,
    )
    want = _grads(lambda: _reference(hidden, weight, labels, temperature, softcap, entropy_grad), hidden, weight)
    _assert_close(got, want, 1e-5)


def test_entropy_stable_for_large_logits():
    hidden, weight, labels, _ = _inputs(16, 8, 40)
    big = hidden.detach() * 200.0  # logits of order 1e3: a peaked distribution, entropy ≈ 0
    lp, ent = linear_logprobs(big, weight.detach(), labels, vocab_chunk_size=7)
    ref_lp, ref_ent = _reference(big.double(), weight.detach().double(), labels, 1.0, None, False)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize("need", ["hidden", "weight"])
def test_only_needed_gradient(need):
    hidden, weight, labels, temps = _inputs(20, 8, 30)
    hidden.requires_grad_(need == "hidden")
    weight.requires_grad_(need == "weight")
    target = hidden if need == "hidden" else weight
    lp, _ = linear_logprobs(hidden, weight, labels, temperature=temps, chunk_size=6, vocab_chunk_size=7)
    (got,) = torch.autograd.grad(lp.sum(), [target])
    ref, _ = _reference(hidden, weight, labels, temps, None, False)
    (want,) = torch.autograd.grad(ref.sum(), [target])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_return_entropy_false():
    hidden, weight, labels, _ = _inputs(20, 8, 30)
    lp, ent = linear_logprobs(hidden, weight, labels, return_entropy=False, vocab_chunk_size=7)
    assert ent is None
    torch.testing.assert_close(lp, linear_logprobs(hidden, weight, labels)[0])


def test_ignored_labels_give_zero_and_no_gradient():
    hidden, weight, _, _ = _inputs(12, 8, 30)
    labels = torch.full((12,), IGNORE)
    lp, ent = linear_logprobs(hidden, weight, labels, chunk_size=5, vocab_chunk_size=7)
    assert torch.equal(lp, torch.zeros(12))
    assert bool((ent > 0).all())  # entropy is still computed at ignored positions
    d_h, d_w = torch.autograd.grad(lp.sum() + ent.sum(), [hidden, weight], allow_unused=True)
    assert torch.equal(d_h, torch.zeros_like(hidden)) and torch.equal(d_w, torch.zeros_like(weight))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    """Computed in float32 from the low-precision values: log-probs and entropy match a float32
    reference on the upcast inputs to 1e-5; gradients are rounded once to ``dtype`` (8 / 11 bits of
    mantissa), hence 1e-2 / 2e-3 relative."""
    hidden, weight, labels, temps = _inputs(37, 24, 53, dtype=dtype)
    got = _grads(
        lambda: linear_logprobs(
            hidden, weight, labels, temperature=temps, chunk_size=8, vocab_chunk_size=16, entropy_grad=True
        ),
        hidden,
        weight,
    )
    assert got[0].dtype == torch.float32 and got[2].dtype == dtype and got[3].dtype == dtype
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    want = _grads(lambda: _reference(h32, w32, labels, temps.float(), None, True), h32, w32)
    _assert_close(got[:2], want[:2], 1e-5)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    _assert_close(got[2:], want[2:], tol)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_gradcheck_float64(softcap):
    hidden, weight, labels, temps = _inputs(7, 5, 11, dtype=torch.float64)

    def fn(h, w):
        return linear_logprobs(
            h, w, labels, temperature=temps, chunk_size=3, vocab_chunk_size=4, softcap=softcap, entropy_grad=True
        )

    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_no_syncs_and_no_n_by_v_allocation():
    n, h, v = 64, 16, 96
    hidden, weight, labels, temps = _inputs(n, h, v)
    with OpCounter() as counter, MaxNumel() as sizes:
        lp, ent = linear_logprobs(
            hidden,
            weight,
            labels,
            temperature=temps,
            chunk_size=16,
            vocab_chunk_size=32,
            softcap=5.0,
            entropy_grad=True,
        )
        (lp.sum() + ent.sum()).backward()
    assert counter.num_syncs == 0, counter.syncs
    assert sizes.max_numel < n * v
    assert sizes.max_numel <= max(16 * 32, n * h, v * h)


def test_distill_no_syncs_and_no_n_by_v_allocation():
    n, h, v = 64, 16, 96
    hidden, weight, _, _ = _inputs(n, h, v)
    teacher_h, teacher_w, _, _ = _inputs(n, h, v, seed=3)
    mask = torch.arange(n) % 3 > 0
    with OpCounter() as counter, MaxNumel() as sizes:
        loss, _ = linear_distill(
            hidden,
            weight,
            teacher_hidden=teacher_h.detach(),
            teacher_weight=teacher_w.detach(),
            loss_mask=mask,
            coefficients=torch.rand(n),
            kind="jsd",
            chunk_size=8,
        )
        loss.backward()
    assert counter.num_syncs == 0, counter.syncs
    assert sizes.max_numel < n * v


KINDS = ["reverse_kl", "forward_kl", "jsd", "soft_cross_entropy"]


def _naive_per_token(kind, s, t, beta, temperature, teacher_temperature):
    """``[N]`` divergences by autograd-able float64 formulas on materialised ``[N, V]`` logits."""
    log_q = F.log_softmax(s.double() / temperature, dim=-1)
    log_p = F.log_softmax(t.double() / teacher_temperature, dim=-1)
    q, p = log_q.exp(), log_p.exp()
    if kind == "reverse_kl":
        return (q * (log_q - log_p)).sum(-1)
    if kind == "forward_kl":
        return (p * (log_p - log_q)).sum(-1)
    if kind == "soft_cross_entropy":
        return -(p * log_q).sum(-1)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    return beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)


def _coefficients(which: str, mask: torch.Tensor) -> torch.Tensor | None:
    """``"ones"``: None (1 on the members); ``"token"``: a token mean; ``"random"``: both signs, NaN off
    the members (they must contribute exactly 0)."""
    if which == "ones":
        return None
    if which == "token":
        return mask.float() / mask.sum()
    c = torch.randn(mask.shape[0], generator=torch.Generator().manual_seed(8))
    return torch.where(mask, c, math.nan)


def _masked_sum(per_token, coefficients, mask):
    """``Σ_{mask} c_t L_t`` by autograd (the coefficients zeroed off the mask first: no 0 · NaN)."""
    c = torch.ones_like(per_token) if coefficients is None else coefficients.to(per_token.dtype)
    return (per_token * torch.where(mask, c, 0.0)).sum()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("teacher", ["logits", "head"])
@pytest.mark.parametrize("coefficients", ["ones", "token", "random"])
def test_distill_matches_naive_autograd(kind, teacher, coefficients):
    """``Σ_t c_t L_t`` and its gradients w.r.t. hidden and weight against autograd through the
    materialised float64 logits, and the per-token output against the naive per-token values."""
    hidden, weight, _, _ = _inputs(37, 16, 53)
    teacher_h, teacher_w, _, _ = _inputs(37, 12, 53, seed=5)
    teacher_h, teacher_w = teacher_h.detach(), teacher_w.detach()
    teacher_logits = teacher_h @ teacher_w.T  # [N, V]
    mask = torch.arange(37) % 4 != 1
    c = _coefficients(coefficients, mask)
    source = (
        {"teacher_logits": teacher_logits}
        if teacher == "logits"
        else {"teacher_hidden": teacher_h, "teacher_weight": teacher_w}
    )
    loss, per_token = linear_distill(
        hidden, weight, **source, loss_mask=mask, coefficients=c, kind=kind, beta=0.3, temperature=1.3,
        teacher_temperature=0.8, chunk_size=8,
    )  # fmt: skip
    assert not per_token.requires_grad and per_token.shape == (37,)
    assert torch.equal(per_token[~mask], torch.zeros(int((~mask).sum())))
    got = (loss, per_token, *torch.autograd.grad(loss * 2.0, [hidden, weight]))
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref_per_token = _naive_per_token(kind, h64 @ w64.T, teacher_logits, 0.3, 1.3, 0.8)
    ref = _masked_sum(ref_per_token, c, mask)
    want = (ref, torch.where(mask, ref_per_token, 0.0), *torch.autograd.grad(ref * 2.0, [h64, w64]))
    _assert_close(got, want, 1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_distill_equals_divergence_on_materialised_logits(kind):
    """The fused head and the logits path share one core: same per-token values and gradients."""
    hidden, weight, _, _ = _inputs(29, 16, 41)
    teacher = torch.randn(29, 41, generator=torch.Generator().manual_seed(2))
    mask = torch.arange(29) % 3 != 0
    c = _coefficients("random", mask)
    loss, per_token = linear_distill(hidden, weight, teacher, kind=kind, loss_mask=mask, coefficients=c, chunk_size=6)
    got = (loss, per_token, *torch.autograd.grad(loss, [hidden, weight]))
    ref_per_token = divergence(kind, hidden @ weight.T, teacher, mask, chunk_size=6)
    ref = _masked_sum(ref_per_token, c, mask)
    want = (ref, ref_per_token.detach(), *torch.autograd.grad(ref, [hidden, weight]))
    _assert_close(got, want, 1e-5)


@pytest.mark.parametrize("teacher_format", ["logprobs", "probs"])
def test_distill_teacher_format(teacher_format):
    hidden, weight, _, _ = _inputs(13, 8, 30)
    logits = torch.randn(13, 30, generator=torch.Generator().manual_seed(4))
    log_p = torch.log_softmax(logits, dim=-1)
    given = log_p if teacher_format == "logprobs" else log_p.exp()
    kw = dict(kind="forward_kl", teacher_temperature=0.7, chunk_size=4)
    loss, per_token = linear_distill(hidden, weight, given, teacher_format=teacher_format, **kw)
    ref_loss, ref_per_token = linear_distill(hidden, weight, logits, **kw)
    _assert_close((loss, per_token), (ref_loss, ref_per_token), 1e-5)


def test_distill_float64_gradcheck():
    hidden, weight, _, _ = _inputs(7, 5, 11, dtype=torch.float64)
    teacher = torch.randn(7, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([1, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
    c = torch.rand(7, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def fn(h, w):
        return linear_distill(h, w, teacher, kind="jsd", beta=0.4, temperature=1.3, loss_mask=mask, coefficients=c,
                              chunk_size=3)[0]  # fmt: skip

    assert torch.autograd.gradcheck(fn, (hidden, weight))


@pytest.mark.parametrize("garbage", [math.inf, math.nan])
def test_distill_non_member_rows_never_leak(garbage):
    hidden, weight, _, _ = _inputs(12, 8, 30)
    teacher = torch.randn(12, 30, generator=torch.Generator().manual_seed(6))
    mask = torch.arange(12) % 3 != 0
    c = _coefficients("random", mask)
    clean_c = torch.where(mask, c, 0.0)
    clean = linear_distill(hidden, weight, teacher, loss_mask=mask, coefficients=clean_c, chunk_size=5)
    clean = (*clean, *torch.autograd.grad(clean[0], [hidden, weight]))
    dirty_h, dirty_t = hidden.detach().clone(), teacher.clone()
    dirty_h[~mask], dirty_t[~mask] = garbage, garbage
    dirty_h.requires_grad_()
    dirty = linear_distill(dirty_h, weight, dirty_t, loss_mask=mask, coefficients=c, chunk_size=5)  # NaN c off mask
    dirty = (*dirty, *torch.autograd.grad(dirty[0], [dirty_h, weight]))
    for a, b in zip(dirty, clean, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_distill_compiled_matches_eager():
    """``impl="compiled"`` runs the same chunk core under ``torch.compile`` (one compile: a few seconds)."""
    hidden, weight, _, _ = _inputs(19, 8, 33)
    teacher = torch.randn(19, 33, generator=torch.Generator().manual_seed(7))
    mask = torch.arange(19) % 4 != 2
    c = _coefficients("random", mask)
    outs = []
    for impl in ("compiled", "eager"):
        kw = dict(loss_mask=mask, coefficients=c, chunk_size=5, impl=impl)
        loss, per_token = linear_distill(hidden, weight, teacher, **kw)
        outs.append((loss, per_token, *torch.autograd.grad(loss, [hidden, weight])))
    _assert_close(outs[0], outs[1], 1e-5)


class _FreshAllocations(TorchDispatchMode):
    """Op outputs of at least ``threshold`` elements on storage not seen before."""

    def __init__(self, threshold: int, known_ptrs: set[int]) -> None:
        super().__init__()
        self.threshold, self.fresh, self.seen = threshold, [], set(known_ptrs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor) and x.numel() >= self.threshold:
                if x.untyped_storage().data_ptr() not in self.seen:
                    self.seen.add(x.untyped_storage().data_ptr())
                    self.fresh.append(str(func))
        return out


def test_distill_backward_scales_the_saved_gradients_in_place():
    """The gradients handed to hidden and weight are the buffers saved by the forward (scaled in place),
    and the backward allocates nothing gradient-sized; a retained graph keeps them intact."""
    n, h, v = 40, 24, 30
    hidden, weight, _, _ = _inputs(n, h, v)
    teacher = torch.randn(n, v, generator=torch.Generator().manual_seed(3))
    saved_ptrs, reference = [], []  # no reference to the saved tensors themselves is kept here

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved_ptrs.append(x.untyped_storage().data_ptr())
        reference.append(x.clone())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss, _ = linear_distill(hidden, weight, teacher, chunk_size=8)
    assert [r.shape for r in reference] == [(n, h), (v, h)]  # d_hidden and d_weight, nothing else
    arrived = []
    hidden.register_hook(lambda g: arrived.append(g.untyped_storage().data_ptr()))
    weight.register_hook(lambda g: arrived.append(g.untyped_storage().data_ptr()))
    (3.0 * loss).backward(retain_graph=True)  # kept graph: out of place, the saved gradients survive
    assert not set(saved_ptrs) & set(arrived)
    torch.testing.assert_close(hidden.grad, 3.0 * reference[0])
    torch.testing.assert_close(weight.grad, 3.0 * reference[1])
    hidden.grad = weight.grad = None
    arrived.clear()
    known = {x.untyped_storage().data_ptr() for x in (hidden, weight, teacher)} | set(saved_ptrs)
    with _FreshAllocations(min(n, v) * h, known) as allocations:
        (-0.5 * loss).backward()
    assert sorted(arrived) == sorted(saved_ptrs)  # the saved buffers themselves, scaled in place
    assert allocations.fresh == [], allocations.fresh  # no second gradient-sized buffer
    torch.testing.assert_close(hidden.grad, -0.5 * reference[0])
    torch.testing.assert_close(weight.grad, -0.5 * reference[1])


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda h, w, y: linear_logprobs(h, torch.nn.Linear(8, 30), y), TypeError),
        (lambda h, w, y: linear_logprobs(h, w[:, :7], y), ValueError),
        (lambda h, w, y: linear_logprobs(h, w, y[:-1]), ValueError),
        (lambda h, w, y: linear_logprobs(h, w, y.float()), TypeError),
        (lambda h, w, y: linear_logprobs(h[0], w, y), ValueError),
        (lambda h, w, y: linear_logprobs(h, w, y, temperature=torch.ones(3)), ValueError),
        (lambda h, w, y: linear_logprobs(h, w, y, temperature=0.0), ValueError),
        (lambda h, w, y: linear_logprobs(h, w, y, temperature=math.nan), ValueError),
        (lambda h, w, y: linear_logprobs(h, w, y, chunk_size=0), ValueError),
        (lambda h, w, y: linear_logprobs(h, w, y, vocab_chunk_size=0), ValueError),
        (lambda h, w, y: linear_logprobs(h, w, y, return_entropy=False, entropy_grad=True), ValueError),
        (lambda h, w, y: linear_logprobs(h, w, y, parallel=object()), TypeError),
        (lambda h, w, y: linear_distill(h, w), ValueError),
        (lambda h, w, y: linear_distill(h, w, torch.zeros(20, 29)), ValueError),
        (lambda h, w, y: linear_distill(h, w, torch.zeros(20, 30), kind="kl"), ValueError),
        (lambda h, w, y: linear_distill(h, w, torch.zeros(20, 30), temperature=math.nan), ValueError),
        (lambda h, w, y: linear_distill(h, w, torch.zeros(20, 30), beta=-0.1), ValueError),
        (lambda h, w, y: linear_distill(h, w, torch.zeros(20, 30), chunk_size=0), ValueError),
        (lambda h, w, y: linear_distill(h, w, torch.zeros(20, 30), impl="triton"), ValueError),
        (lambda h, w, y: linear_distill(h, w, torch.zeros(20, 30), coefficients=torch.ones(19)), ValueError),
        (lambda h, w, y: linear_distill(h, w, torch.zeros(20, 30), coefficients=y), TypeError),
        (lambda h, w, y: linear_distill(h, w, teacher_hidden=h, teacher_weight=w, teacher_format="probs"), ValueError),
        (lambda h, w, y: linear_distill(h, w, torch.zeros(20, 30), teacher_hidden=h, teacher_weight=w), ValueError),
    ],
)
def test_bad_arguments_raise(call, error):
    hidden, weight, labels, _ = _inputs(20, 8, 30)
    with pytest.raises(error):
        call(hidden, weight, labels)


# ----------------------------------------------------------------------------------------------
# vocab-parallel over 2 gloo processes


class _Run(NamedTuple):
    """One vocab-parallel case: ``case`` is ``"logprobs"``, a distillation kind (fused head) or
    ``"logits:<kind>"`` (per-token divergence of sharded logits)."""

    case: str
    v: int
    uneven: bool
    beta: float = 0.5
    teacher: str = "head"


_PARALLEL_RUNS = [
    _Run("logprobs", 30, False),
    _Run("logprobs", 31, True),
    _Run("logprobs:auto", 31, True),  # uneven shards without vocab_start
    _Run("logprobs:auto", 30, False),
    _Run("reverse_kl", 30, True, teacher="head"),
    _Run("forward_kl", 31, False, teacher="logits"),
    _Run("jsd", 30, False, beta=0.3, teacher="head"),
    _Run("jsd", 31, True, beta=0.3, teacher="logits"),
    _Run("jsd", 30, False, beta=0.0, teacher="logits"),
    _Run("jsd", 31, True, beta=1.0, teacher="head"),
    _Run("soft_cross_entropy", 30, True, teacher="logits"),
    _Run("logits:reverse_kl", 31, True),
    _Run("logits:jsd", 30, False, beta=0.3),
]
_N, _H, _DISTILL_CHUNK = 23, 12, 6


def _parallel_inputs(v: int):
    """Detached ``hidden [N, H]``, ``weight [V, H]``, labels, temperatures, teacher head ``[·, 10]``."""
    hidden, weight, labels, temps = _inputs(_N, _H, v, seed=11)
    teacher_h, teacher_w, _, _ = _inputs(_N, 10, v, seed=12)
    return hidden.detach(), weight.detach(), labels, temps, teacher_h.detach(), teacher_w.detach()


def _distill_outputs(run: _Run, hidden, w, teacher_h, teacher_w, mask, start, stop, parallel):
    """``(loss, per_token)`` of a distillation run on the vocabulary rows ``[start, stop)``; the teacher
    tensors require grad, and the loss must not reach them."""
    teacher_h, teacher_w = teacher_h.requires_grad_(), teacher_w.requires_grad_()
    if run.teacher == "logits":
        teacher_logits = (teacher_h.detach() @ teacher_w.detach().T).requires_grad_()  # [N, V]
        source, teacher_leaves = {"teacher_logits": teacher_logits[:, start:stop]}, [teacher_logits]
    else:
        source = {"teacher_hidden": teacher_h, "teacher_weight": teacher_w[start:stop]}
        teacher_leaves = [teacher_h, teacher_w]
    coefficients = torch.linspace(-1.0, 2.0, _N)
    loss, per_token = linear_distill(
        hidden, w, **source, loss_mask=mask, coefficients=coefficients, kind=run.case, beta=run.beta,
        temperature=1.2, teacher_temperature=0.8, chunk_size=_DISTILL_CHUNK, parallel=parallel,
    )  # fmt: skip
    assert torch.autograd.grad(loss, teacher_leaves, retain_graph=True, allow_unused=True) == (None,) * len(
        teacher_leaves
    ), "the teacher received a gradient"
    return (loss,), [per_token]


def _run_case(run: _Run, start: int, stop: int, parallel) -> list[torch.Tensor]:
    """Outputs and gradients of one run computed with the vocabulary rows ``[start, stop)`` (all of
    them and ``parallel=None`` for the single-process result)."""
    hidden, weight, labels, temps, teacher_h, teacher_w = _parallel_inputs(run.v)
    hidden.requires_grad_()
    w = weight[start:stop].clone().requires_grad_()
    g = torch.Generator().manual_seed(4)
    if run.case.startswith("logits:"):  # gradient w.r.t. this shard's logits columns
        logits = (hidden.detach() @ w.detach().T).requires_grad_()  # [N, V_local]
        teacher = (teacher_h @ teacher_w.T)[:, start:stop]
        per_token = divergence(
            run.case.split(":")[1], logits, teacher, labels != IGNORE, beta=run.beta, temperature=1.2,
            teacher_temperature=0.8, chunk_size=_DISTILL_CHUNK, parallel=parallel,
        )  # fmt: skip
        (d_logits,) = torch.autograd.grad((per_token * torch.randn(_N, generator=g)).sum(), [logits])
        return [per_token.detach(), d_logits]
    extra = []
    if run.case.startswith("logprobs"):
        # "logprobs" states vocab_start; "logprobs:auto" lets the shard sizes place the labels
        given = VocabParallel(parallel.group, vocab_start=start) if parallel is not None else None
        outs = linear_logprobs(
            hidden, w, labels, temperature=temps, chunk_size=7, vocab_chunk_size=5, softcap=4.0, entropy_grad=True,
            parallel=parallel if run.case == "logprobs:auto" else given,
        )  # fmt: skip
    else:
        outs, extra = _distill_outputs(run, hidden, w, teacher_h, teacher_w, labels != IGNORE, start, stop, parallel)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    d_h, d_w = torch.autograd.grad(loss, [hidden, w])
    return [o.detach() for o in (*outs, *extra)] + [d_h, d_w]


def _shards(v: int, uneven: bool) -> list[tuple[int, int]]:
    cut = v // 2 + (3 if uneven else 0)
    return [(0, cut), (cut, v)]


_FORBIDDEN_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "gather",
    "scatter",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "send",
    "recv",
    "isend",
    "irecv",
)


class _Collectives:
    """Inside the ``with`` block: ``torch.distributed.all_reduce`` calls are recorded as
    ``(op, shape)`` in ``calls``; any other collective or point-to-point call raises."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self._saved: dict[str, object] = {}

    def __enter__(self) -> _Collectives:
        all_reduce = dist.all_reduce

        def recording_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            self.calls.append(("max" if op == dist.ReduceOp.MAX else "sum", tuple(tensor.shape)))
            return all_reduce(tensor, op=op, group=group, async_op=async_op)

        def forbidden(name: str):
            def call(*args, **kwargs):
                raise AssertionError(f"vocab-parallel losses must not call dist.{name}")

            return call

        patches = {"all_reduce": recording_all_reduce, **{n: forbidden(n) for n in _FORBIDDEN_COLLECTIVES}}
        for name, fn in patches.items():
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, fn)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _expected_distill_collectives(run: _Run) -> list[tuple[str, tuple[int, ...]]]:
    """Per token chunk of height C: MAX and SUM of the ``[2, C]`` log-normalisers, SUM of the
    ``[k, C]`` partial sums (k = 2 for JSD strictly inside (0, 1)); then, for the fused head, SUM of
    ``d_hidden [N, H]``."""
    kind = run.case.removeprefix("logits:")
    k = 2 if kind == "jsd" and 0.0 < run.beta < 1.0 else 1
    calls = []
    for t0 in range(0, _N, _DISTILL_CHUNK):
        c = min(_DISTILL_CHUNK, _N - t0)
        calls += [("max", (2, c)), ("sum", (2, c)), ("sum", (k, c))]
    return calls if run.case.startswith("logits:") else calls + [("sum", (_N, _H))]


def _worker(rank: int, world_size: int) -> dict:
    results, collectives = [], []  # aligned with _PARALLEL_RUNS
    for run in _PARALLEL_RUNS:
        start, stop = _shards(run.v, run.uneven)[rank]
        with _Collectives() as comm:
            results.append(_run_case(run, start, stop, VocabParallel(dist.group.WORLD)))
        collectives.append(comm.calls)
    return {"results": results, "collectives": collectives}


def test_vocab_parallel_matches_single_process():
    ranks = run_gloo(_worker, world_size=2, timeout=120)
    for i, run in enumerate(_PARALLEL_RUNS):
        want = _run_case(run, 0, run.v, None)
        for rank, (start, stop) in enumerate(_shards(run.v, run.uneven)):
            got = ranks[rank]["results"][i]
            # values and d_hidden: the full result on every rank; the last gradient: this rank's
            # rows of d_weight (columns of d_logits)
            _assert_close(got[:-1], want[:-1], 1e-5)
            last = want[-1][:, start:stop] if run.case.startswith("logits:") else want[-1][start:stop]
            _assert_close([got[-1]], [last], 1e-5)
            if not run.case.startswith("logprobs"):  # per-token scalars only: nothing of size C × V is communicated
                assert ranks[rank]["collectives"][i] == _expected_distill_collectives(run), run


def test_cpu_default_blocks_are_1024_wide_and_reuse_one_buffer():
    """On CPU the default vocabulary block is ``DEFAULT_VOCAB_CHUNK_SIZE["cpu"]`` = 1024 rows: V = 4096 in
    one token chunk takes 4 forward matmuls, all written into one reused buffer (``mm`` with ``out=``),
    and the backward writes each gradient block by its first matmul (no zero-filled gradient)."""
    from packloss.vocab.head import DEFAULT_VOCAB_CHUNK_SIZE

    assert DEFAULT_VOCAB_CHUNK_SIZE["cpu"] == 1024
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(16, 8, generator=g, requires_grad=True)
    weight = torch.randn(4096, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 4096, (16,), generator=g)
    with OpCounter() as fwd:
        lp, _ = linear_logprobs(hidden, weight, labels, return_entropy=False)
    assert fwd.ops["aten.mm"] == 4, dict(fwd.ops)
    with OpCounter() as bwd:
        lp.sum().backward()
    # 4 recomputed blocks; d_hidden: 1 mm then 3 addmm_; d_weight: 4 mm (one token chunk: each block's first)
    assert bwd.ops["aten.mm"] == 4 + 1 + 4 and bwd.ops["aten.addmm_"] == 3, dict(bwd.ops)
    # the one ``zeros`` left is autograd's [0]-element gradient of the unused entropy output (the
    # zero-filled d_hidden and d_weight made it 3)
    assert bwd.ops["aten.zeros"] == 1 and bwd.ops["aten.zero_"] == 0, dict(bwd.ops)
    wide, _ = linear_logprobs(hidden, weight, labels, return_entropy=False, vocab_chunk_size=8192)
    torch.testing.assert_close(lp, wide, rtol=1e-6, atol=1e-6)
