"""packloss.vocab.core: the chunk policy, the divergence registry, the per-chunk kernel, the options."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from packloss.vocab import VocabDistill
from packloss.vocab.core import (
    DIVERGENCES,
    ELEMENTWISE,
    MATMUL,
    ChunkBudget,
    Divergence,
    DivergenceSpec,
    VocabParallel,
    chunk_divergence,
    chunk_rows,
    masked_chunk,
)
from packloss.vocab.distill import divergence, forward_kl, jsd, reverse_kl, soft_cross_entropy
from packloss.vocab.head import linear_logprobs
from packloss.vocab.head_distill import linear_distill

CPU = torch.device("cpu")

# ---------------------------------------------------------------------------------------------------
# The chunk policy
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 7, 10**6])
def test_chunk_rows_explicit(chunk_size: int) -> None:
    assert chunk_rows(50, CPU, chunk_size) == chunk_size
    assert chunk_rows(50, torch.device("cuda"), chunk_size, budget=MATMUL) == chunk_size


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError),
                                        ("8", TypeError), (4.0, TypeError)])  # fmt: skip
def test_chunk_rows_invalid(bad, error) -> None:
    with pytest.raises(error, match="chunk_size"):
        chunk_rows(50, CPU, bad)


@pytest.mark.parametrize("threads", [1, 3])
def test_chunk_rows_default_cpu_scales_with_threads(threads: int, monkeypatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert chunk_rows(1000, CPU) == 2**18 * threads // 1000
    assert chunk_rows(1000, "cpu", budget=MATMUL) == 2**22 * threads // 1000
    assert chunk_rows(2**40, CPU) == 1  # a row wider than the budget: one row per chunk
    assert chunk_rows(0, CPU) == 2**18 * threads  # degenerate width


def test_chunk_rows_default_accelerator() -> None:
    cuda = torch.device("cuda")  # a device object only: nothing is allocated
    assert chunk_rows(1000, cuda) == 2**26 // 1000
    assert chunk_rows(8192, cuda, budget=MATMUL) == 2**26 // 8192
    assert chunk_rows(7, cuda, budget=ChunkBudget(cpu_per_thread=1, accelerator=100)) == 14
    assert (ELEMENTWISE.cpu_per_thread, ELEMENTWISE.accelerator) == (2**18, 2**26)


# ---------------------------------------------------------------------------------------------------
# The divergence registry
# ---------------------------------------------------------------------------------------------------


def _reverse_ce_sums(log_q, log_p, beta, teacher_format):
    """Toy divergence, reverse cross-entropy ``L = −Σ_v q log p``: sums ``[L]``, state ``(q, log p)``."""
    q = log_q.exp_()  # [c, V]
    return (q * log_p).sum(-1).neg_()[None], (q, log_p)


def _reverse_ce_grad(state, sums, beta, temperature):
    """``∂L/∂s_j = −q_j (log p_j + L) / T``."""
    q, log_p = state
    loss = sums[0]  # [c]
    return loss, log_p.add_(loss[:, None]).mul_(q).neg_().div_(temperature)


def _naive_reverse_ce(s: torch.Tensor, t: torch.Tensor, temperature: float) -> torch.Tensor:
    q = F.softmax(s / temperature, dim=-1)
    return -(q * F.log_softmax(t, dim=-1)).sum(-1)


def test_a_new_divergence_is_one_registry_entry() -> None:
    """Register the toy divergence and use it end to end: from logits (eager and through the engine
    component's validation) and from the fused head; removed afterwards."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(9, 13, dtype=torch.float64, generator=g).requires_grad_()
    t = torch.randn(9, 13, dtype=torch.float64, generator=g)
    mask = torch.rand(9, generator=g) > 0.3
    w = torch.randn(9, dtype=torch.float64, generator=g)
    DIVERGENCES["reverse_ce"] = Divergence(sums=_reverse_ce_sums, grad=_reverse_ce_grad)
    try:
        per_token = divergence("reverse_ce", s, t, mask, temperature=1.4, chunk_size=4)
        (per_token * w).sum().backward()
        s64 = s.detach().clone().requires_grad_()
        ref = torch.where(mask, _naive_reverse_ce(s64, t, 1.4), 0.0)
        (ref * w).sum().backward()
        torch.testing.assert_close(per_token.detach(), ref.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s.grad, s64.grad, rtol=1e-12, atol=1e-12)
        assert torch.autograd.gradcheck(lambda x: divergence("reverse_ce", x, t, mask, chunk_size=2), (s64,))

        hidden = torch.randn(9, 5, dtype=torch.float64, generator=g).requires_grad_()
        weight = torch.randn(13, 5, dtype=torch.float64, generator=g)
        loss, fused = linear_distill(hidden, weight, t, kind="reverse_ce", loss_mask=mask, coefficients=w, chunk_size=4)
        ref = (torch.where(mask, _naive_reverse_ce(hidden @ weight.T, t, 1.0), 0.0) * w).sum()
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(
            torch.autograd.grad(loss, hidden)[0], torch.autograd.grad(ref, hidden)[0], rtol=1e-12, atol=1e-12
        )
        assert VocabDistill(kind="reverse_ce").kind == "reverse_ce"
    finally:
        del DIVERGENCES["reverse_ce"]
    with pytest.raises(ValueError, match="reverse_ce"):
        divergence("reverse_ce", s, t, mask)
    with pytest.raises(ValueError, match="kind"):
        VocabDistill(kind="reverse_ce")


def test_unknown_kind_lists_the_choices() -> None:
    s = torch.zeros(2, 3)
    with pytest.raises(ValueError) as info:
        divergence("kl", s, s)
    for kind in ("reverse_kl", "forward_kl", "soft_cross_entropy", "jsd"):
        assert kind in str(info.value)
    assert set(DIVERGENCES) == {"reverse_kl", "forward_kl", "soft_cross_entropy", "jsd"}


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(kind="kl"), ValueError, "kind"),
        (dict(kind="jsd", beta=1.01), ValueError, "beta"),
        (dict(kind="jsd", beta=math.nan), ValueError, "beta"),
        (dict(kind="jsd", beta="0.5"), TypeError, "beta"),
        (dict(kind="reverse_kl", temperature=0.0), ValueError, "temperature"),
        (dict(kind="reverse_kl", temperature=-1.0), ValueError, "temperature"),
        (dict(kind="reverse_kl", temperature=math.nan), ValueError, "temperature"),
        (dict(kind="reverse_kl", teacher_temperature=math.inf), ValueError, "teacher_temperature"),
        (dict(kind="reverse_kl", teacher_temperature=True), TypeError, "teacher_temperature"),
        (dict(kind="reverse_kl", teacher_format="softmax"), ValueError, "teacher_format"),
    ],
)
def test_divergence_spec_validation(kwargs: dict, error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        DivergenceSpec(**kwargs)


def test_divergence_spec_normalises_numbers() -> None:
    spec = DivergenceSpec("jsd", beta=1, temperature=2, teacher_temperature=1)
    assert (spec.beta, spec.temperature, spec.teacher_temperature) == (1.0, 2.0, 1.0)
    assert all(isinstance(x, float) for x in (spec.beta, spec.temperature, spec.teacher_temperature))


# ---------------------------------------------------------------------------------------------------
# The per-chunk kernel
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl", "soft_cross_entropy", "jsd"])
def test_chunk_divergence_is_loss_and_its_gradient(kind: str) -> None:
    """One block: per-token losses and ``∂L_t/∂s_t`` (every row its own token), inputs unmodified."""
    g = torch.Generator().manual_seed(1)
    s = torch.randn(4, 9, dtype=torch.float64, generator=g)
    t = torch.randn(4, 9, dtype=torch.float64, generator=g)
    s_in, t_in = s.clone(), t.clone()
    loss, grad = chunk_divergence(kind, s, t, beta=0.3, temperature=1.5, teacher_temperature=0.7)
    assert torch.equal(s, s_in) and torch.equal(t, t_in)
    for i in range(4):
        row = s[i].clone().requires_grad_()
        value = divergence(kind, row[None], t[i][None], beta=0.3, temperature=1.5, teacher_temperature=0.7)[0]
        (row_grad,) = torch.autograd.grad(value, row)
        torch.testing.assert_close(loss[i], value.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad[i], row_grad, rtol=1e-12, atol=1e-12)


def test_masked_chunk_scales_rows_and_zeroes_non_members() -> None:
    g = torch.Generator().manual_seed(2)
    s = torch.randn(5, 8, generator=g)
    t = torch.randn(5, 8, generator=g)
    mask = torch.tensor([True, False, True, True, False])
    coef = torch.tensor([2.0, math.nan, -1.0, 0.5, math.inf])  # anything off the members
    s[1], t[4] = math.nan, math.inf
    loss, grad = chunk_divergence("reverse_kl", s, t)
    m_loss, m_grad = masked_chunk(s, t, mask, coef, "reverse_kl", 0.5, 1.0, 1.0, "logits")
    assert torch.equal(m_loss, torch.where(mask, loss, 0.0))
    assert torch.equal(m_grad[~mask], torch.zeros(2, 8))
    torch.testing.assert_close(m_grad[mask], grad[mask] * coef[mask][:, None], rtol=0, atol=0)
    out = torch.empty(5, 8, dtype=torch.bfloat16)
    o_loss, none = masked_chunk(s, t, mask, coef, "reverse_kl", 0.5, 1.0, 1.0, "logits", out=out)
    assert none is None and torch.equal(o_loss, m_loss) and torch.equal(out, m_grad.to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------------


def test_vocab_parallel_options() -> None:
    with pytest.raises(TypeError, match="group"):
        VocabParallel(None)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="vocab_start"):
            VocabParallel(object(), vocab_start=bad)
    assert VocabParallel(object(), vocab_start=7).start(5, torch.device("cpu")) == 7
    with pytest.raises(AttributeError):
        VocabParallel(object()).vocab_start = 3  # frozen


# ---------------------------------------------------------------------------------------------------
# chunk_size must be a positive int everywhere (the one chunk policy)
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
