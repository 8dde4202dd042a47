"""packloss.vocab.head: linear_logprobs, the fused log-probs and entropy from hidden states, against
materialised autograd references; non-finite ignored rows, labels out of range, empty N / V, vocab-parallel."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from packloss.testing import OpCounter, run_gloo
from packloss.vocab.core import VocabParallel
from packloss.vocab.head import linear_logprobs
from tests.vocab.harness import (
    IGNORE,
    TOL,
    MaxNumel,
    ParallelRun,
    assert_all_close,
    assert_second_backward_raises,
    check_vocab_parallel,
    gen,
    head_inputs,
)


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


@pytest.mark.parametrize("n,v,chunk,vchunk", [(37, 53, 8, 16), (64, 100, 64, 33), (5, 17, 2, 4)])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("per_token_temperature", [False, True])
def test_logprobs_match_reference(n, v, chunk, vchunk, softcap, entropy_grad, per_token_temperature):
    hidden, weight, labels, temps = head_inputs(n, 24, v)
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
    assert_all_close(got, want, 1e-5)


def test_entropy_stable_for_large_logits():
    hidden, weight, labels, _ = head_inputs(16, 8, 40)
    big = hidden.detach() * 200.0  # logits of order 1e3: a peaked distribution, entropy ≈ 0
    lp, ent = linear_logprobs(big, weight.detach(), labels, vocab_chunk_size=7)
    ref_lp, ref_ent = _reference(big.double(), weight.detach().double(), labels, 1.0, None, False)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize("need", ["hidden", "weight"])
def test_only_needed_gradient(need):
    hidden, weight, labels, temps = head_inputs(20, 8, 30)
    hidden.requires_grad_(need == "hidden")
    weight.requires_grad_(need == "weight")
    target = hidden if need == "hidden" else weight
    lp, _ = linear_logprobs(hidden, weight, labels, temperature=temps, chunk_size=6, vocab_chunk_size=7)
    (got,) = torch.autograd.grad(lp.sum(), [target])
    ref, _ = _reference(hidden, weight, labels, temps, None, False)
    (want,) = torch.autograd.grad(ref.sum(), [target])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_return_entropy_false():
    hidden, weight, labels, _ = head_inputs(20, 8, 30)
    lp, ent = linear_logprobs(hidden, weight, labels, return_entropy=False, vocab_chunk_size=7)
    assert ent is None
    torch.testing.assert_close(lp, linear_logprobs(hidden, weight, labels)[0])


def test_ignored_labels_give_zero_and_no_gradient():
    hidden, weight, _, _ = head_inputs(12, 8, 30)
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
    hidden, weight, labels, temps = head_inputs(37, 24, 53, dtype=dtype)
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
    assert_all_close(got[:2], want[:2], 1e-5)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert_all_close(got[2:], want[2:], tol)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_gradcheck_float64(softcap):
    hidden, weight, labels, temps = head_inputs(7, 5, 11, dtype=torch.float64)

    def fn(h, w):
        return linear_logprobs(
            h, w, labels, temperature=temps, chunk_size=3, vocab_chunk_size=4, softcap=softcap, entropy_grad=True
        )

    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_no_syncs_and_no_n_by_v_allocation():
    n, h, v = 64, 16, 96
    hidden, weight, labels, temps = head_inputs(n, h, v)
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
    ],
)
def test_bad_arguments_raise(call, error):
    hidden, weight, labels, _ = head_inputs(20, 8, 30)
    with pytest.raises(error):
        call(hidden, weight, labels)


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


# ---------------------------------------------------------------------------------------------------
# Non-finite ignored rows, double backward, labels outside [0, V), N = 0 and V = 0, chunk sizes
# ---------------------------------------------------------------------------------------------------


def _logprobs_grads(hidden, weight, labels, softcap, entropy_grad):
    hidden = hidden.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    lp, ent = linear_logprobs(
        hidden, weight, labels, temperature=0.7, chunk_size=3, vocab_chunk_size=5, softcap=softcap,
        entropy_grad=entropy_grad,
    )  # fmt: skip
    g = gen(7)
    loss = (lp * torch.randn(lp.shape, generator=g)).sum()
    if entropy_grad:  # the entropy of the valid rows only, selected with where (NaN · 0 would be NaN)
        loss = loss + torch.where(labels != -100, ent, 0.0).mul(torch.randn(ent.shape, generator=g)).sum()
    loss.backward()
    return lp.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_logprobs_non_finite_ignored_rows_never_leak(garbage: float, softcap: float | None, entropy_grad: bool):
    g = gen(8)
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


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_linear_logprobs_double_backward_raises(entropy_grad: bool) -> None:
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    lp, ent = linear_logprobs(hidden, weight, torch.tensor([0, 3, -100, 8, 1]), entropy_grad=entropy_grad)
    objective = (lp**2).sum() + ((ent**2).sum() if entropy_grad else 0.0)
    assert_second_backward_raises(objective, hidden)


def test_out_of_range_labels_unchecked_by_default_and_checked_on_request() -> None:
    g = gen(9)
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
    weight = torch.randn(10, 4, generator=gen(10))
    shard = weight[[slice(0, 3), slice(3, 10)][rank]]
    parallel = VocabParallel(dist.group.WORLD, vocab_start=[0, 3][rank])
    hidden = torch.randn(4, 4, generator=gen(11))
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


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_linear_logprobs_empty_tokens(entropy_grad: bool) -> None:
    hidden, weight = torch.randn(0, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    lp, ent = linear_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), entropy_grad=entropy_grad)
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + (ent.sum() if entropy_grad else 0.0)).backward()
    assert torch.equal(weight.grad, torch.zeros(9, 4)) and hidden.grad.shape == (0, 4)


def test_empty_vocabulary_raises() -> None:
    with pytest.raises(ValueError, match="weight"):
        linear_logprobs(torch.randn(3, 4), torch.randn(0, 4), torch.zeros(3, dtype=torch.long))


_H, _W, _Y = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 4, -100])


@pytest.mark.parametrize("bad", [0, -2])
def test_non_positive_vocab_chunk_size_raises(bad: int) -> None:
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        linear_logprobs(_H, _W, _Y, vocab_chunk_size=bad)


# ---------------------------------------------------------------------------------------------------
# Vocab-parallel over 2 gloo processes: log-probs of a sharded head
# ---------------------------------------------------------------------------------------------------


PARALLEL_RUNS = [
    ParallelRun("logprobs", 30, False),
    ParallelRun("logprobs", 31, True),
    ParallelRun("logprobs:auto", 31, True),  # uneven shards without vocab_start
    ParallelRun("logprobs:auto", 30, False),
]


def test_vocab_parallel_matches_single_process():
    check_vocab_parallel(PARALLEL_RUNS)


@pytest.mark.parametrize("where", ["weight", "hidden", "labels"])
def test_a_meta_tensor_is_refused_by_name(where):
    """A deferred-init (meta) LM head used to give finite garbage."""
    args = {"hidden": torch.randn(4, 3), "weight": torch.randn(8, 3), "labels": torch.zeros(4, dtype=torch.long)}
    args[where] = torch.empty_like(args[where], device="meta")
    with pytest.raises(ValueError, match=f"{where} is on the meta device"):
        linear_logprobs(args["hidden"], args["weight"], args["labels"])


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.int32])
def test_narrow_integer_labels_give_the_int64_result(dtype):
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(4, 3, generator=g), torch.randn(9, 3, generator=g)
    labels = torch.tensor([0, 3, 8, 5])
    want, _ = linear_logprobs(hidden, weight, labels)
    got, _ = linear_logprobs(hidden, weight, labels.to(dtype))
    assert torch.equal(got, want)


@pytest.mark.parametrize("softcap", [math.inf, math.nan, 0.0, -1.0])
def test_a_softcap_that_is_not_positive_and_finite_is_refused(softcap):
    with pytest.raises(ValueError, match="softcap must be a positive finite float"):
        linear_logprobs(torch.randn(2, 3), torch.randn(5, 3), torch.tensor([0, 1]), softcap=softcap)
