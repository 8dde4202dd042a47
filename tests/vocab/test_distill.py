"""Full-vocabulary distillation (issue 4): values, gradients, normalisation, memory structure, syncs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from packloss.distill import forward_kl, jsd, reverse_kl, soft_cross_entropy
from packloss.testing import OpCounter

LOSSES = {
    "reverse_kl": reverse_kl,
    "forward_kl": forward_kl,
    "soft_cross_entropy": soft_cross_entropy,
    "jsd": lambda *a, **k: jsd(*a, beta=0.3, **k),
}
KINDS = list(LOSSES)


# ---------------------------------------------------------------------------------------------------
# Naive reference: materialised log_softmax + kl_div under autograd, in float64.
# ---------------------------------------------------------------------------------------------------


def _ref_teacher_log_probs(t: torch.Tensor, temperature: float, teacher_format: str) -> torch.Tensor:
    u = t.double().log() if teacher_format == "probs" else t.double()
    return F.log_softmax(u / temperature, dim=-1)


def _ref_per_token(kind: str, log_q: torch.Tensor, log_p: torch.Tensor, beta: float = 0.3) -> torch.Tensor:
    """``[N]`` per-token losses from ``[N, V]`` student / teacher log-probabilities."""
    if kind == "reverse_kl":
        return F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    if kind == "forward_kl":  # probability target: kl_div's xlogy counts p = 0 terms as 0
        return F.kl_div(log_q, log_p.exp(), reduction="none").sum(-1)
    if kind == "soft_cross_entropy":
        return -(log_p.exp() * log_q).sum(-1)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log1p(-beta)]), dim=0)
    kl_p = F.kl_div(log_m, log_p.exp(), reduction="none").sum(-1)
    kl_q = F.kl_div(log_m, log_q, reduction="none", log_target=True).sum(-1)
    return beta * kl_p + (1 - beta) * kl_q


def _reference(
    kind: str,
    s: torch.Tensor,
    t: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    teacher_format: str = "logits",
    normalize: str = "token",
    denominator: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, d loss / d s) in float64 by autograd."""
    s64 = s.detach().double().requires_grad_()
    mask = torch.ones(s.shape[0], dtype=torch.bool) if mask is None else mask
    safe_s = torch.where(mask[:, None], s64, 0.0)
    safe_t = torch.where(mask[:, None], t.double(), 1.0 if teacher_format == "probs" else 0.0)
    log_q = F.log_softmax(safe_s / student_temperature, dim=-1)
    log_p = _ref_teacher_log_probs(safe_t, teacher_temperature, teacher_format)
    total = torch.where(mask, _ref_per_token(kind, log_q, log_p), 0.0).sum()
    if denominator is None:
        denominator = {"token": max(int(mask.sum()), 1), "position": s.shape[0], "sum": 1}[normalize]
    loss = total / denominator
    loss.backward()
    return loss.detach(), s64.grad


def _inputs(n: int = 11, v: int = 37, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    s = (scale * torch.randn(n, v, generator=g)).to(dtype).requires_grad_()
    t = (scale * torch.randn(n, v, generator=g)).to(dtype)
    mask = torch.rand(n, generator=g) > 0.3
    mask[0] = True
    return s, t, mask


def _run(kind: str, s: torch.Tensor, t: torch.Tensor, mask, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    s.grad = None
    loss = LOSSES[kind](s, t, mask, **kw)
    loss.backward()
    return loss.detach(), s.grad


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, floor: float = 0.0) -> None:
    """Relative to the tensor's scale: elementwise rtol plus an absolute floor of rtol · max|expected|
    (or ``floor`` if larger)."""
    expected = expected.to(torch.float64)
    atol = max(rtol * float(expected.abs().max()), floor) + 1e-30
    torch.testing.assert_close(actual.to(torch.float64), expected, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------------
# Values and gradients
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temps", [(1.0, 1.0), (2.0, 0.5)])
@pytest.mark.parametrize("chunk_size", [None, 3, 4])  # 11 rows: chunks of 3 and 4 leave a remainder
def test_matches_reference_fp32(kind: str, temps: tuple[float, float], chunk_size: int | None) -> None:
    s, t, mask = _inputs(v=37)  # V = 37: no chunk divides it
    kw = dict(student_temperature=temps[0], teacher_temperature=temps[1])
    loss, grad = _run(kind, s, t, mask, chunk_size=chunk_size, impl="eager", **kw)
    ref_loss, ref_grad = _reference(kind, s, t, mask, **kw)
    assert loss.dtype == torch.float32 and grad.dtype == torch.float32
    _assert_close(loss, ref_loss, rtol=1e-5)
    _assert_close(grad, ref_grad, rtol=1e-5)


@pytest.mark.parametrize("beta, other", [(0.0, forward_kl), (1.0, reverse_kl)])
def test_jsd_endpoints_are_forward_and_reverse_kl(beta: float, other) -> None:
    s, t, mask = _inputs()
    loss = jsd(s, t, mask, beta=beta)
    loss.backward()
    grad = s.grad.clone()
    s.grad = None
    other_loss = other(s, t, mask)
    other_loss.backward()
    torch.testing.assert_close(loss, other_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, s.grad, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "dtype, rtol",
    [
        # The reference upcasts the SAME rounded inputs to float64, so the only errors are float32
        # accumulation (~1e-6 relative) and rounding the gradient to the logits' dtype: half an ulp,
        # 2**-9 (bf16) / 2**-12 (fp16) relative. We allow one ulp, 2**-8 / 2**-11, with the same
        # relative floor at rtol · max|grad| for entries near zero.
        (torch.bfloat16, 2.0**-8),
        (torch.float16, 2.0**-11),
    ],
)
def test_matches_reference_low_precision(kind: str, dtype: torch.dtype, rtol: float) -> None:
    s, t, mask = _inputs(n=9, v=50, dtype=dtype)
    loss, grad = _run(kind, s, t, mask, chunk_size=4, student_temperature=1.5)
    ref_loss, ref_grad = _reference(kind, s, t, mask, student_temperature=1.5)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    _assert_close(loss, ref_loss, rtol=1e-5)  # the loss itself stays float32
    _assert_close(grad, ref_grad, rtol=rtol)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("teacher_format", ["logits", "probs"])
def test_gradcheck_float64(kind: str, teacher_format: str) -> None:
    s, t, mask = _inputs(n=5, v=7, dtype=torch.float64)
    if teacher_format == "probs":
        t = torch.softmax(t, dim=-1)
    s = s.detach().requires_grad_()
    fn = LOSSES[kind]
    kw = dict(student_temperature=1.7, teacher_temperature=0.6, teacher_format=teacher_format, chunk_size=2)
    assert torch.autograd.gradcheck(lambda x: fn(x, t, mask, **kw), (s,))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("normalize", ["token", "position", "sum"])
def test_all_tokens_masked_gives_zero(kind: str, normalize: str) -> None:
    s, t, _ = _inputs()
    mask = torch.zeros(s.shape[0], dtype=torch.bool)
    loss, grad = _run(kind, s, t, mask, normalize=normalize, chunk_size=4)
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("kind", KINDS)
def test_extreme_logits_are_finite_and_correct(kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    n, v = 6, 40
    s = (1e4 * torch.randint(-1, 2, (n, v), generator=g).float()).requires_grad_()  # entries in {±1e4, 0}
    t = 1e4 * torch.randint(-1, 2, (n, v), generator=g).float()
    mask = torch.ones(n, dtype=torch.bool)
    loss, grad = _run(kind, s, t, mask, chunk_size=4)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    ref_loss, ref_grad = _reference(kind, s, t, mask)
    _assert_close(loss, ref_loss, rtol=1e-5)
    _assert_close(grad, ref_grad, rtol=1e-5)


@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_identical_teacher_and_student_row_has_zero_divergence(kind: str, temperature: float) -> None:
    s, t, _ = _inputs()
    t[2] = s[2].detach()
    mask = torch.zeros(s.shape[0], dtype=torch.bool)
    mask[2] = True
    loss, grad = _run(
        kind, s, t, mask, normalize="sum", student_temperature=temperature, teacher_temperature=temperature
    )
    assert abs(loss.item()) < 1e-6
    assert grad.abs().max().item() < 1e-6


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("teacher_format", ["logprobs", "probs"])
def test_teacher_given_as_probabilities(kind: str, teacher_format: str) -> None:
    s, t, mask = _inputs()
    log_p = torch.log_softmax(t, dim=-1)
    given = log_p if teacher_format == "logprobs" else log_p.exp()
    kw = dict(teacher_temperature=0.8)
    loss, grad = _run(kind, s, given, mask, teacher_format=teacher_format, **kw)
    ref_loss, ref_grad = _run(kind, s.detach().clone().requires_grad_(), t, mask, **kw)
    _assert_close(loss, ref_loss, rtol=1e-5)
    _assert_close(grad, ref_grad, rtol=1e-5)


@pytest.mark.parametrize("kind", ["forward_kl", "soft_cross_entropy", "jsd"])
def test_teacher_probabilities_with_exact_zeros(kind: str) -> None:
    s, t, mask = _inputs()
    p = torch.softmax(t, dim=-1)
    p[:, ::3] = 0.0
    p = p / p.sum(-1, keepdim=True)
    loss, grad = _run(kind, s, p, mask, teacher_format="probs", chunk_size=4)
    ref_loss, ref_grad = _reference(kind, s, p, mask, teacher_format="probs")
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    _assert_close(loss, ref_loss, rtol=1e-5)
    _assert_close(grad, ref_grad, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("garbage", [math.inf, -math.inf, math.nan, 1e30])
def test_non_member_rows_never_leak(kind: str, garbage: float) -> None:
    s, t, mask = _inputs()
    clean_loss, clean_grad = _run(kind, s, t, mask, chunk_size=4)
    dirty_s = s.detach().clone()
    dirty_t = t.clone()
    dirty_s[~mask] = garbage
    dirty_t[~mask] = garbage
    dirty_s.requires_grad_()
    loss, grad = _run(kind, dirty_s, dirty_t, mask, chunk_size=4)
    torch.testing.assert_close(loss, clean_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, clean_grad, rtol=0, atol=0)
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
    s, t, mask = _inputs(n=n, v=v, seed=n * 31 + v)
    s.grad = None
    loss = jsd(s, t, mask, beta=beta, student_temperature=t_s, teacher_temperature=t_t, chunk_size=chunk)
    loss.backward()
    s64 = s.detach().double().requires_grad_()
    log_q = F.log_softmax(s64 / t_s, dim=-1)
    log_p = F.log_softmax(t.double() / t_t, dim=-1)
    ref = torch.where(mask, _ref_per_token("jsd", log_q, log_p, beta=beta), 0.0).sum() / mask.sum()
    ref.backward()
    # Random shapes include near-degenerate rows (V = 2, T_s = 0.25) whose gradient q (log q − log m
    # − KL) is a float32 cancellation of O(1) terms: an absolute floor of 1e-6 covers that rounding.
    _assert_close(loss, ref.detach(), rtol=1e-5, floor=1e-6)
    _assert_close(s.grad, s64.grad, rtol=1e-5, floor=1e-6)


# ---------------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "normalize, denominator, expected",
    [
        ("token", None, "members"),
        ("token", 17.0, 17.0),
        ("token", torch.tensor(23.0), 23.0),
        ("position", None, 11.0),
        ("position", 40, 40.0),
        ("sum", None, 1.0),
    ],
)
def test_normalisation(kind: str, normalize: str, denominator, expected) -> None:
    s, t, mask = _inputs(n=11)
    loss, grad = _run(kind, s, t, mask, normalize=normalize, denominator=denominator)
    summed_loss, summed_grad = _reference(kind, s, t, mask, normalize="sum")
    divisor = float(mask.sum()) if expected == "members" else expected
    _assert_close(loss, summed_loss / divisor, rtol=1e-5)
    _assert_close(grad, summed_grad / divisor, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_no_mask_means_every_token(kind: str) -> None:
    s, t, _ = _inputs()
    loss, grad = _run(kind, s, t, None)
    ref_loss, ref_grad = _reference(kind, s, t, None)
    _assert_close(loss, ref_loss, rtol=1e-5)
    _assert_close(grad, ref_grad, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_global_denominator_split_in_halves(kind: str) -> None:
    s, t, mask = _inputs(n=12)
    denominator = mask.sum().float()  # the global member count, shared by both halves
    whole_loss, whole_grad = _run(kind, s, t, mask, denominator=denominator, chunk_size=5)
    whole_grad = whole_grad.clone()
    s.grad = None
    halves = [slice(0, 7), slice(7, 12)]
    total = sum(LOSSES[kind](s[h], t[h], mask[h], denominator=denominator, chunk_size=5) for h in halves)
    total.backward()
    _assert_close(total.detach(), whole_loss, rtol=1e-6)
    _assert_close(s.grad, whole_grad, rtol=1e-6)


def test_grad_output_scales_the_gradient_and_retain_graph_is_safe() -> None:
    s, t, mask = _inputs()
    _, grad = _run("reverse_kl", s, t, mask)
    grad = grad.clone()
    s.grad = None
    loss = reverse_kl(s, t, mask)
    (3.0 * loss).backward(retain_graph=True)  # graph kept: the saved gradient must stay intact
    first = s.grad.clone()
    s.grad = None
    (-0.5 * loss).backward()  # last backward: multiplied in place
    torch.testing.assert_close(first, 3.0 * grad)
    torch.testing.assert_close(s.grad, -0.5 * grad)


def test_teacher_gets_no_gradient() -> None:
    s, t, mask = _inputs()
    t.requires_grad_()
    reverse_kl(s, t, mask).backward()
    assert t.grad is None and s.grad is not None


@pytest.mark.parametrize(
    "call",
    [
        lambda s, t, m: reverse_kl(s, t[:, :-1], m),
        lambda s, t, m: reverse_kl(s, t, m[:-1]),
        lambda s, t, m: reverse_kl(s, t, m, normalize="sum", denominator=3.0),
        lambda s, t, m: reverse_kl(s, t, m, normalize="mean"),
        lambda s, t, m: reverse_kl(s, t, m, teacher_format="softmax"),
        lambda s, t, m: reverse_kl(s, t, m, student_temperature=0.0),
        lambda s, t, m: reverse_kl(s, t, m, impl="triton"),
        lambda s, t, m: jsd(s, t, m, beta=1.5),
    ],
)
def test_invalid_arguments_raise(call) -> None:
    s, t, mask = _inputs()
    with pytest.raises(ValueError):
        call(s, t, mask)


# ---------------------------------------------------------------------------------------------------
# Memory structure and syncs
# ---------------------------------------------------------------------------------------------------


class _LargeAllocations(TorchDispatchMode):
    """Counts op outputs of at least ``threshold`` elements backed by storage not seen before."""

    def __init__(self, threshold: int, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.threshold = threshold
        self.seen = {x.untyped_storage().data_ptr() for x in known}
        self.fresh: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor) and x.numel() >= self.threshold:
                ptr = x.untyped_storage().data_ptr()
                if ptr not in self.seen:
                    self.seen.add(ptr)
                    self.fresh.append(str(func))
        return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_saves_only_the_gradient(kind: str, dtype: torch.dtype) -> None:
    n, v = 64, 50
    s, t, mask = _inputs(n=n, v=v, dtype=dtype)
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(x.shape), x.dtype))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = LOSSES[kind](s, t, mask, chunk_size=8)
    large = [entry for entry in saved if math.prod(entry[0]) >= n * v]
    assert large == [((n, v), dtype)]  # the gradient, in the logits' dtype, and nothing else
    with _LargeAllocations(n * v, [s, t]) as allocations:
        loss = LOSSES[kind](s, t, mask, chunk_size=8)
        loss.backward()
    # one [N, V] buffer in forward+backward: the gradient (multiplied in place in backward and
    # handed to .grad as is); chunks of 8 rows stay far below the threshold
    assert len(allocations.fresh) == 1, allocations.fresh
    assert s.grad.untyped_storage().data_ptr() in allocations.seen


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("normalize", ["token", "position", "sum"])
def test_no_syncs_in_forward_and_backward(kind: str, normalize: str) -> None:
    s, t, mask = _inputs(n=12)
    with OpCounter() as counter:
        loss = LOSSES[kind](s, t, mask, normalize=normalize, chunk_size=5)
        loss.backward()
    assert counter.num_syncs == 0, counter.syncs
    with OpCounter() as counter:
        loss = LOSSES[kind](s, t, mask, denominator=mask.sum(), chunk_size=5)
        loss.backward()
    assert counter.num_syncs == 0, counter.syncs


# ---------------------------------------------------------------------------------------------------
# Compiled path (kept to one small test: the first compile takes tens of seconds on a small CPU)
# ---------------------------------------------------------------------------------------------------


def test_compiled_matches_eager_without_recompiling_per_n() -> None:
    from torch._dynamo.utils import counters

    graphs = []
    for n in (12, 19):  # chunks of 5: heights 5 and 2, then 5 and 4
        s, t, mask = _inputs(n=n, v=33, seed=n)
        loss, grad = _run("reverse_kl", s, t, mask, chunk_size=5, impl="compiled")
        grad = grad.clone()
        eager_loss, eager_grad = _run("reverse_kl", s, t, mask, chunk_size=5, impl="eager")
        _assert_close(loss, eager_loss, rtol=1e-5)
        _assert_close(grad, eager_grad, rtol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0]  # the second batch size reused the first compilation


# ---------------------------------------------------------------------------------------------------
# Benchmark suite plumbing (tiny, in-process; figures come from `packloss bench distill`)
# ---------------------------------------------------------------------------------------------------


def test_bench_measure_variant_reports_figures() -> None:
    from packloss.bench.distill import _measure_variant

    rows = [
        _measure_variant(variant, n=32, v=64, device="cpu", dtype="float32", warmup=0, repeat=1)
        for variant in ("naive_eager", "packloss_eager")
    ]
    for row in rows:
        assert row["shape"] == "32x64" and row["time_ms"] > 0 and row["peak_bytes"] >= 0
        assert {"peak_ratio_vs_inputs", "logits_bytes", "loss"} <= row.keys()
    assert math.isclose(rows[0]["loss"], rows[1]["loss"], rel_tol=1e-5)
