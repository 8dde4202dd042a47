"""packloss.vocab.head_distill: linear_distill, the fused distillation from hidden states, against
materialised float64 autograd references: values, gradients, teachers in every format and padded,
memory and syncs, non-finite rows, double backward, N = 0 / V = 0, vocab-parallel."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from packloss.testing import OpCounter
from packloss.vocab.distill import divergence
from packloss.vocab.head_distill import linear_distill
from tests.vocab.harness import (
    BETA,
    KINDS,
    NEG_INF,
    TOL,
    MaxNumel,
    ParallelRun,
    assert_all_close,
    assert_second_backward_raises,
    check_vocab_parallel,
    gen,
    head_inputs,
    teacher_as,
    xlogy_reference,
)


def test_distill_no_syncs_and_no_n_by_v_allocation():
    n, h, v = 64, 16, 96
    hidden, weight, _, _ = head_inputs(n, h, v)
    teacher_h, teacher_w, _, _ = head_inputs(n, h, v, seed=3)
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
    hidden, weight, _, _ = head_inputs(37, 16, 53)
    teacher_h, teacher_w, _, _ = head_inputs(37, 12, 53, seed=5)
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
    assert_all_close(got, want, 1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_distill_equals_divergence_on_materialised_logits(kind):
    """The fused head and the logits path share one core: same per-token values and gradients."""
    hidden, weight, _, _ = head_inputs(29, 16, 41)
    teacher = torch.randn(29, 41, generator=torch.Generator().manual_seed(2))
    mask = torch.arange(29) % 3 != 0
    c = _coefficients("random", mask)
    loss, per_token = linear_distill(hidden, weight, teacher, kind=kind, loss_mask=mask, coefficients=c, chunk_size=6)
    got = (loss, per_token, *torch.autograd.grad(loss, [hidden, weight]))
    ref_per_token = divergence(kind, hidden @ weight.T, teacher, mask, chunk_size=6)
    ref = _masked_sum(ref_per_token, c, mask)
    want = (ref, ref_per_token.detach(), *torch.autograd.grad(ref, [hidden, weight]))
    assert_all_close(got, want, 1e-5)


@pytest.mark.parametrize("teacher_format", ["logprobs", "probs"])
def test_distill_teacher_format(teacher_format):
    hidden, weight, _, _ = head_inputs(13, 8, 30)
    logits = torch.randn(13, 30, generator=torch.Generator().manual_seed(4))
    log_p = torch.log_softmax(logits, dim=-1)
    given = log_p if teacher_format == "logprobs" else log_p.exp()
    kw = dict(kind="forward_kl", teacher_temperature=0.7, chunk_size=4)
    loss, per_token = linear_distill(hidden, weight, given, teacher_format=teacher_format, **kw)
    ref_loss, ref_per_token = linear_distill(hidden, weight, logits, **kw)
    assert_all_close((loss, per_token), (ref_loss, ref_per_token), 1e-5)


def test_distill_float64_gradcheck():
    hidden, weight, _, _ = head_inputs(7, 5, 11, dtype=torch.float64)
    teacher = torch.randn(7, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([1, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
    c = torch.rand(7, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def fn(h, w):
        return linear_distill(h, w, teacher, kind="jsd", beta=0.4, temperature=1.3, loss_mask=mask, coefficients=c,
                              chunk_size=3)[0]  # fmt: skip

    assert torch.autograd.gradcheck(fn, (hidden, weight))


@pytest.mark.parametrize("garbage", [math.inf, math.nan])
def test_distill_non_member_rows_never_leak(garbage):
    hidden, weight, _, _ = head_inputs(12, 8, 30)
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
    hidden, weight, _, _ = head_inputs(19, 8, 33)
    teacher = torch.randn(19, 33, generator=torch.Generator().manual_seed(7))
    mask = torch.arange(19) % 4 != 2
    c = _coefficients("random", mask)
    outs = []
    for impl in ("compiled", "eager"):
        kw = dict(loss_mask=mask, coefficients=c, chunk_size=5, impl=impl)
        loss, per_token = linear_distill(hidden, weight, teacher, **kw)
        outs.append((loss, per_token, *torch.autograd.grad(loss, [hidden, weight])))
    assert_all_close(outs[0], outs[1], 1e-5)


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
    hidden, weight, _, _ = head_inputs(n, h, v)
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
    hidden, weight, labels, _ = head_inputs(20, 8, 30)
    with pytest.raises(error):
        call(hidden, weight, labels)


# ---------------------------------------------------------------------------------------------------
# Teachers with zeros (−inf) and padded vocabularies, double backward, N = 0 and V = 0
# ---------------------------------------------------------------------------------------------------


def _head(n: int = 9, h: int = 6, v: int = 13, pad: tuple[int, ...] = (2, 7, 12)):
    """A float64 student head whose rows ``pad`` give logits −1e5 (a bias feature of 1 in ``hidden``): their
    ``q`` is exactly 0, as a linear head cannot produce −inf."""
    g = gen(3)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    hidden[:, -1] = 1.0
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    weight[list(pad)] = 0.0
    weight[list(pad), -1] = -1e5
    real = torch.tensor([c for c in range(v) if c not in pad])
    return hidden, weight, real


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["logits", "logprobs", "probs"])
def test_linear_distill_padded_teacher(kind: str, fmt: str) -> None:
    hidden, weight, real = _head()
    t = torch.randn(hidden.shape[0], weight.shape[0], generator=gen(4), dtype=torch.float64)
    t[:, [c for c in range(weight.shape[0]) if c not in real.tolist()]] = NEG_INF
    coef = torch.rand(hidden.shape[0], generator=gen(5), dtype=torch.float64)
    hidden.requires_grad_(), weight.requires_grad_()
    loss, per_token = linear_distill(
        hidden, weight, teacher_as(t, fmt), kind=kind, beta=BETA, teacher_format=fmt, coefficients=coef, chunk_size=4,
        impl="eager",
    )  # fmt: skip
    loss.backward()
    h_ref, w_ref = hidden.detach().clone().requires_grad_(), weight.detach()[real].clone().requires_grad_()
    want = xlogy_reference(kind, h_ref @ w_ref.T, teacher_as(t[:, real], fmt), fmt)
    (coef * want).sum().backward()
    torch.testing.assert_close(per_token, want.detach(), **TOL)
    torch.testing.assert_close(hidden.grad, h_ref.grad, **TOL)
    torch.testing.assert_close(weight.grad[real], w_ref.grad, **TOL)
    pad = [c for c in range(weight.shape[0]) if c not in real.tolist()]
    assert torch.equal(weight.grad[pad], torch.zeros_like(weight.grad[pad]))


@pytest.mark.parametrize("kind", ["forward_kl", "soft_cross_entropy", "jsd"])
@pytest.mark.parametrize("fmt", ["logits", "logprobs"])
def test_linear_distill_teacher_minus_inf(kind: str, fmt: str) -> None:
    g = gen(6)
    hidden = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(7, 11, generator=g, dtype=torch.float64)
    t[:, [1, 4]] = NEG_INF
    loss, per_token = linear_distill(hidden, weight, teacher_as(t, fmt), kind=kind, beta=BETA, teacher_format=fmt)
    loss.backward()
    h_ref, w_ref = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    want = xlogy_reference(kind, h_ref @ w_ref.T, t, "logits")
    want.sum().backward()
    torch.testing.assert_close(per_token, want.detach(), **TOL)
    torch.testing.assert_close(hidden.grad, h_ref.grad, **TOL)
    torch.testing.assert_close(weight.grad, w_ref.grad, **TOL)


def test_linear_distill_double_backward_raises() -> None:
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    loss, _ = linear_distill(hidden, weight, torch.randn(5, 9, dtype=torch.float64), impl="eager")
    assert_second_backward_raises(loss**2, weight)


def test_linear_distill_empty_tokens() -> None:
    hidden, weight = torch.randn(0, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    loss, per_token = linear_distill(hidden, weight, torch.randn(0, 9), impl="eager")
    assert loss.item() == 0.0 and per_token.shape == (0,)
    loss.backward()
    assert torch.equal(weight.grad, torch.zeros(9, 4))


def test_empty_vocabulary_raises() -> None:
    with pytest.raises(ValueError, match="weight"):
        linear_distill(torch.randn(3, 4), torch.randn(0, 4), torch.randn(3, 0))


# ---------------------------------------------------------------------------------------------------
# Vocab-parallel over 2 gloo processes: the fused head's distillation
# ---------------------------------------------------------------------------------------------------


PARALLEL_RUNS = [
    ParallelRun("reverse_kl", 30, True, teacher="head"),
    ParallelRun("forward_kl", 31, False, teacher="logits"),
    ParallelRun("jsd", 30, False, beta=0.3, teacher="head"),
    ParallelRun("jsd", 31, True, beta=0.3, teacher="logits"),
    ParallelRun("jsd", 30, False, beta=0.0, teacher="logits"),
    ParallelRun("jsd", 31, True, beta=1.0, teacher="head"),
    ParallelRun("soft_cross_entropy", 30, True, teacher="logits"),
]


def test_vocab_parallel_matches_single_process():
    check_vocab_parallel(PARALLEL_RUNS)


@pytest.mark.parametrize("where", ["weight", "teacher_logits", "teacher_hidden", "loss_mask", "coefficients"])
def test_a_tensor_on_another_device_is_refused_by_name(where):
    """A deferred-init (meta) head or teacher used to give finite garbage or a torch-internal error."""
    args = {
        "weight": torch.randn(8, 3),
        "teacher_logits": torch.randn(4, 8),
        "teacher_hidden": torch.randn(4, 2),
        "loss_mask": torch.ones(4, dtype=torch.bool),
        "coefficients": torch.ones(4),
    }
    args[where] = torch.empty_like(args[where], device="meta")
    teacher = (
        {"teacher_hidden": args["teacher_hidden"], "teacher_weight": torch.randn(8, 2)}
        if where == "teacher_hidden"
        else {"teacher_logits": args["teacher_logits"]}
    )
    with pytest.raises(ValueError, match=f"{where} is on the meta device"):
        linear_distill(
            torch.randn(4, 3), args["weight"], **teacher, loss_mask=args["loss_mask"], coefficients=args["coefficients"]
        )


def test_a_fractional_float_mask_is_refused_not_binarised():
    with pytest.raises(TypeError, match="loss_mask must be a bool"):
        linear_distill(torch.randn(3, 2), torch.randn(5, 2), torch.randn(3, 5), loss_mask=torch.tensor([0.5, 0.0, 1.0]))
