"""packloss.vocab hardening: 0 · log 0 edges, non-finite ignored rows, double backward, labels out
of range, empty N / V and chunk sizes, on the logits path and the hidden-state path."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from packloss.testing import run_gloo
from packloss.vocab import VocabDistill
from packloss.vocab.core import VocabParallel
from packloss.vocab.distill import divergence, forward_kl, jsd, reverse_kl, soft_cross_entropy
from packloss.vocab.head import linear_logprobs
from packloss.vocab.head_distill import linear_distill

KINDS = ["reverse_kl", "forward_kl", "soft_cross_entropy", "jsd"]
BETA = 0.3
TOL = dict(rtol=1e-10, atol=1e-10)
NEG_INF = -math.inf


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ref_per_token(kind: str, s: torch.Tensor, t: torch.Tensor, fmt: str, temps=(1.0, 1.0)) -> torch.Tensor:
    """``[N]`` float64 reference, differentiable w.r.t. ``s``; ``0 · log 0`` written out as ``xlogy``."""
    log_q = F.log_softmax(s / temps[0], dim=-1)  # [N, V]
    u = t.log() if fmt == "probs" else t
    log_p = F.log_softmax(u / temps[1], dim=-1)  # [N, V]
    p, q = log_p.exp(), log_q.exp()
    if kind == "reverse_kl":
        return (q * (log_q - log_p)).sum(-1)
    if kind == "forward_kl":
        return (torch.xlogy(p, p) - p * log_q).sum(-1)
    if kind == "soft_cross_entropy":
        return -(p * log_q).sum(-1)
    log_m = torch.logaddexp(log_p + math.log(BETA), log_q + math.log1p(-BETA))  # [N, V]
    kl_p = (torch.xlogy(p, p) - p * log_m).sum(-1)
    return BETA * kl_p + (1 - BETA) * (q * (log_q - log_m)).sum(-1)


def _teacher(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """Teacher logits ``t`` (−inf allowed) given in ``fmt``."""
    if fmt == "logits":
        return t
    return F.log_softmax(t, dim=-1) if fmt == "logprobs" else F.softmax(t, dim=-1)


def _padded(n: int = 9, v: int = 13, pad: tuple[int, ...] = (2, 7, 12), seed: int = 0):
    """Float64 student / teacher logits ``[N, V]`` with −inf at the columns ``pad`` of both, and the index
    of the real columns."""
    g = _gen(seed)
    s, t = torch.randn(n, v, generator=g, dtype=torch.float64), torch.randn(n, v, generator=g, dtype=torch.float64)
    real = torch.tensor([c for c in range(v) if c not in pad])
    s[:, list(pad)] = NEG_INF
    t[:, list(pad)] = NEG_INF
    return s, t, real


# ---------------------------------------------------------------------------------------------------
# 1. 0 · log 0 = 0: teacher zeros in every format, padded vocabularies
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["forward_kl", "soft_cross_entropy", "jsd"])
@pytest.mark.parametrize("fmt", ["logits", "logprobs", "probs"])
def test_teacher_minus_inf_counts_zero(kind: str, fmt: str) -> None:
    g = _gen(1)
    s = torch.randn(9, 13, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(9, 13, generator=g, dtype=torch.float64)
    t[:, [0, 5]] = NEG_INF  # zero-probability tokens
    t[3, 1:9] = NEG_INF
    teacher, w = _teacher(t, fmt), torch.randn(9, generator=g, dtype=torch.float64)
    got = divergence(kind, s, teacher, beta=BETA, teacher_format=fmt, chunk_size=4, impl="eager")
    (got * w).sum().backward()
    s_ref = s.detach().clone().requires_grad_()
    want = _ref_per_token(kind, s_ref, t, "logits")
    (want * w).sum().backward()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want.detach(), **TOL)
    torch.testing.assert_close(s.grad, s_ref.grad, **TOL)


@pytest.mark.parametrize("fmt", ["logits", "logprobs", "probs"])
def test_reverse_kl_teacher_zero_where_student_is_not_is_inf(fmt: str) -> None:
    s = torch.randn(4, 6, dtype=torch.float64)
    t = torch.randn(4, 6, dtype=torch.float64)
    t[:, 2] = NEG_INF
    assert torch.equal(reverse_kl(s, _teacher(t, fmt), teacher_format=fmt), torch.full((4,), math.inf).double())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["logits", "logprobs", "probs"])
@pytest.mark.parametrize("temps", [(1.0, 1.0), (2.0, 0.5)])
def test_padded_vocabulary_equals_unpadded(kind: str, fmt: str, temps: tuple[float, float]) -> None:
    s, t, real = _padded()
    s.requires_grad_()
    w = torch.randn(s.shape[0], generator=_gen(2), dtype=torch.float64)
    got = divergence(
        kind, s, _teacher(t, fmt), beta=BETA, temperature=temps[0], teacher_temperature=temps[1],
        teacher_format=fmt, chunk_size=4, impl="eager",
    )  # fmt: skip
    (got * w).sum().backward()
    s_ref = s.detach()[:, real].clone().requires_grad_()
    want = _ref_per_token(kind, s_ref, _teacher(t[:, real], fmt), fmt, temps)
    (want * w).sum().backward()
    torch.testing.assert_close(got, want.detach(), **TOL)
    torch.testing.assert_close(s.grad[:, real], s_ref.grad, **TOL)
    pad = torch.ones(s.shape[1], dtype=torch.bool)
    pad[real] = False
    assert torch.equal(s.grad[:, pad], torch.zeros_like(s.grad[:, pad]))  # exactly 0, not NaN


def _head(n: int = 9, h: int = 6, v: int = 13, pad: tuple[int, ...] = (2, 7, 12)):
    """A float64 student head whose rows ``pad`` give logits −1e5 (a bias feature of 1 in ``hidden``): their
    ``q`` is exactly 0, as a linear head cannot produce −inf."""
    g = _gen(3)
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
    t = torch.randn(hidden.shape[0], weight.shape[0], generator=_gen(4), dtype=torch.float64)
    t[:, [c for c in range(weight.shape[0]) if c not in real.tolist()]] = NEG_INF
    coef = torch.rand(hidden.shape[0], generator=_gen(5), dtype=torch.float64)
    hidden.requires_grad_(), weight.requires_grad_()
    loss, per_token = linear_distill(
        hidden, weight, _teacher(t, fmt), kind=kind, beta=BETA, teacher_format=fmt, coefficients=coef, chunk_size=4,
        impl="eager",
    )  # fmt: skip
    loss.backward()
    h_ref, w_ref = hidden.detach().clone().requires_grad_(), weight.detach()[real].clone().requires_grad_()
    want = _ref_per_token(kind, h_ref @ w_ref.T, _teacher(t[:, real], fmt), fmt)
    (coef * want).sum().backward()
    torch.testing.assert_close(per_token, want.detach(), **TOL)
    torch.testing.assert_close(hidden.grad, h_ref.grad, **TOL)
    torch.testing.assert_close(weight.grad[real], w_ref.grad, **TOL)
    pad = [c for c in range(weight.shape[0]) if c not in real.tolist()]
    assert torch.equal(weight.grad[pad], torch.zeros_like(weight.grad[pad]))


@pytest.mark.parametrize("kind", ["forward_kl", "soft_cross_entropy", "jsd"])
@pytest.mark.parametrize("fmt", ["logits", "logprobs"])
def test_linear_distill_teacher_minus_inf(kind: str, fmt: str) -> None:
    g = _gen(6)
    hidden = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(7, 11, generator=g, dtype=torch.float64)
    t[:, [1, 4]] = NEG_INF
    loss, per_token = linear_distill(hidden, weight, _teacher(t, fmt), kind=kind, beta=BETA, teacher_format=fmt)
    loss.backward()
    h_ref, w_ref = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    want = _ref_per_token(kind, h_ref @ w_ref.T, t, "logits")
    want.sum().backward()
    torch.testing.assert_close(per_token, want.detach(), **TOL)
    torch.testing.assert_close(hidden.grad, h_ref.grad, **TOL)
    torch.testing.assert_close(weight.grad, w_ref.grad, **TOL)


# ---------------------------------------------------------------------------------------------------
# 2. NaN / inf hidden states in ignored rows of linear_logprobs
# ---------------------------------------------------------------------------------------------------


def _logprobs_grads(hidden, weight, labels, softcap, entropy_grad):
    hidden = hidden.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    lp, ent = linear_logprobs(
        hidden, weight, labels, temperature=0.7, chunk_size=3, vocab_chunk_size=5, softcap=softcap,
        entropy_grad=entropy_grad,
    )  # fmt: skip
    g = _gen(7)
    loss = (lp * torch.randn(lp.shape, generator=g)).sum()
    if entropy_grad:  # the entropy of the valid rows only, selected with where (NaN · 0 would be NaN)
        loss = loss + torch.where(labels != -100, ent, 0.0).mul(torch.randn(ent.shape, generator=g)).sum()
    loss.backward()
    return lp.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_logprobs_non_finite_ignored_rows_never_leak(garbage: float, softcap: float | None, entropy_grad: bool):
    g = _gen(8)
    hidden, weight = torch.randn(10, 6, generator=g), torch.randn(17, 6, generator=g)
    labels = torch.randint(0, 17, (10,), generator=g)
    ignored = torch.tensor([1, 4, 5, 9])
    labels[ignored] = -100
    dirty = hidden.clone()
    dirty[ignored] = garbage
    dirty[4, 0] = 1.0  # a partly finite row
    lp, d_h, d_w = _logprobs_grads(dirty, weight, labels, softcap, entropy_grad)
    lp_clean, d_h_clean, d_w_clean = _logprobs_grads(hidden, weight, labels, softcap, entropy_grad)
    assert torch.isfinite(d_w).all() and torch.isfinite(d_h).all()
    torch.testing.assert_close(lp, lp_clean, rtol=0, atol=0)
    torch.testing.assert_close(d_w, d_w_clean, rtol=0, atol=0)
    torch.testing.assert_close(d_h, d_h_clean, rtol=0, atol=0)
    assert torch.equal(d_h[ignored], torch.zeros(len(ignored), 6))


# ---------------------------------------------------------------------------------------------------
# 3. Double backward raises instead of returning a wrong second-order gradient
# ---------------------------------------------------------------------------------------------------


def _assert_second_backward_raises(objective: torch.Tensor, x: torch.Tensor) -> None:
    (grad,) = torch.autograd.grad(objective, x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (grad**2).sum().backward()


@pytest.mark.parametrize("kind", KINDS)
def test_divergence_double_backward_raises(kind: str) -> None:
    s = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    per_token = divergence(kind, s, torch.randn(5, 7, dtype=torch.float64), beta=BETA, impl="eager")
    _assert_second_backward_raises((per_token**2).sum(), s)  # grad_output depends on s


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_linear_logprobs_double_backward_raises(entropy_grad: bool) -> None:
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    lp, ent = linear_logprobs(hidden, weight, torch.tensor([0, 3, -100, 8, 1]), entropy_grad=entropy_grad)
    objective = (lp**2).sum() + ((ent**2).sum() if entropy_grad else 0.0)
    _assert_second_backward_raises(objective, hidden)


def test_linear_distill_double_backward_raises() -> None:
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    loss, _ = linear_distill(hidden, weight, torch.randn(5, 9, dtype=torch.float64), impl="eager")
    _assert_second_backward_raises(loss**2, weight)


# ---------------------------------------------------------------------------------------------------
# 4. Labels outside [0, V)
# ---------------------------------------------------------------------------------------------------


def test_out_of_range_labels_unchecked_by_default_and_checked_on_request() -> None:
    g = _gen(9)
    hidden, weight = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(10, 4, generator=g).double()
    labels = torch.tensor([0, 10, -100, 3, -1, 9])
    lp, _ = linear_logprobs(hidden, weight, labels)  # not checked (no host sync): −logZ
    log_z = torch.logsumexp(hidden @ weight.T, dim=-1)
    torch.testing.assert_close(lp[[1, 4]], -log_z[[1, 4]], **TOL)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\) .*2 are not, in \[-1, 10\]"):
        linear_logprobs(hidden, weight, labels, check_labels=True)
    good = torch.tensor([0, 9, -100, 3, 5, 9])
    checked, _ = linear_logprobs(hidden, weight, good, check_labels=True)
    assert torch.equal(checked, linear_logprobs(hidden, weight, good)[0])
    empty, _ = linear_logprobs(hidden[:0], weight, good[:0], check_labels=True)
    assert empty.shape == (0,)


def _check_labels_worker(rank: int, world_size: int) -> list[str]:
    weight = torch.randn(10, 4, generator=_gen(10))
    shard = weight[[slice(0, 3), slice(3, 10)][rank]]
    parallel = VocabParallel(dist.group.WORLD, vocab_start=[0, 3][rank])
    hidden = torch.randn(4, 4, generator=_gen(11))
    errors = []
    for labels in (torch.tensor([0, 9, -100, 3]), torch.tensor([0, 10, -100, -2])):
        try:
            linear_logprobs(hidden, shard, labels, parallel=parallel, check_labels=True)
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_check_labels_vocab_parallel() -> None:
    for errors in run_gloo(_check_labels_worker, world_size=2, timeout=120):
        assert errors[0] == ""
        assert "exactly one vocabulary shard" in errors[1] and "2 are not, in [-2, 10]" in errors[1]


# ---------------------------------------------------------------------------------------------------
# 5. N = 0 and V = 0
# ---------------------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_linear_logprobs_empty_tokens(entropy_grad: bool) -> None:
    hidden, weight = torch.randn(0, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    lp, ent = linear_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), entropy_grad=entropy_grad)
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + (ent.sum() if entropy_grad else 0.0)).backward()
    assert torch.equal(weight.grad, torch.zeros(9, 4)) and hidden.grad.shape == (0, 4)


def test_linear_distill_empty_tokens() -> None:
    hidden, weight = torch.randn(0, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    loss, per_token = linear_distill(hidden, weight, torch.randn(0, 9), impl="eager")
    assert loss.item() == 0.0 and per_token.shape == (0,)
    loss.backward()
    assert torch.equal(weight.grad, torch.zeros(9, 4))


@pytest.mark.parametrize(
    "call",
    [
        lambda: linear_logprobs(torch.randn(3, 4), torch.randn(0, 4), torch.zeros(3, dtype=torch.long)),
        lambda: linear_distill(torch.randn(3, 4), torch.randn(0, 4), torch.randn(3, 0)),
    ],
)
def test_head_empty_vocabulary_raises(call) -> None:
    with pytest.raises(ValueError, match="weight"):
        call()


# ---------------------------------------------------------------------------------------------------
# 6. chunk_size must be a positive int everywhere
# ---------------------------------------------------------------------------------------------------

_S, _T = torch.randn(3, 5), torch.randn(3, 5)
_H, _W, _Y = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 4, -100])


@pytest.mark.parametrize("bad", [0, -2])
@pytest.mark.parametrize(
    "call",
    [
        lambda c: divergence("jsd", _S, _T, chunk_size=c),
        lambda c: reverse_kl(_S, _T, chunk_size=c),
        lambda c: forward_kl(_S, _T, chunk_size=c),
        lambda c: jsd(_S, _T, chunk_size=c),
        lambda c: soft_cross_entropy(_S, _T, chunk_size=c),
        lambda c: linear_logprobs(_H, _W, _Y, chunk_size=c),
        lambda c: linear_distill(_H, _W, _T, chunk_size=c),
        lambda c: VocabDistill(chunk_size=c),
    ],
    ids=[
        "divergence",
        "reverse_kl",
        "forward_kl",
        "jsd",
        "soft_cross_entropy",
        "linear_logprobs",
        "linear_distill",
        "VocabDistill",
    ],  # fmt: skip
)
def test_non_positive_chunk_size_raises(call, bad: int) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        call(bad)


@pytest.mark.parametrize("bad", [0, -2])
def test_non_positive_vocab_chunk_size_raises(bad: int) -> None:
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        linear_logprobs(_H, _W, _Y, vocab_chunk_size=bad)
