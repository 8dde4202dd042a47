"""The vocab tests' shared helpers: float64 references (written with ``xlogy``, 0 · log 0 = 0, and with
``kl_div``), inputs and teachers in every format, dispatch modes that record large tensors, and the
vocab-parallel runner (two gloo ranks against one process) that test_head, test_head_distill and
test_distill each give their own cases."""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from packloss.testing import run_gloo
from packloss.vocab.core import VocabParallel
from packloss.vocab.distill import divergence
from packloss.vocab.head import linear_logprobs
from packloss.vocab.head_distill import linear_distill

KINDS = ["reverse_kl", "forward_kl", "soft_cross_entropy", "jsd"]
BETA = 0.3
TOL = dict(rtol=1e-10, atol=1e-10)
NEG_INF = -math.inf
IGNORE = -100


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def xlogy_reference(kind: str, s: torch.Tensor, t: torch.Tensor, fmt: str, temps=(1.0, 1.0)) -> torch.Tensor:
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


def teacher_as(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """Teacher logits ``t`` (−inf allowed) given in ``fmt``."""
    if fmt == "logits":
        return t
    return F.log_softmax(t, dim=-1) if fmt == "logprobs" else F.softmax(t, dim=-1)


def padded_logits(n: int = 9, v: int = 13, pad: tuple[int, ...] = (2, 7, 12), seed: int = 0):
    """Float64 student / teacher logits ``[N, V]`` with −inf at the columns ``pad`` of both, and the index
    of the real columns."""
    g = gen(seed)
    s, t = torch.randn(n, v, generator=g, dtype=torch.float64), torch.randn(n, v, generator=g, dtype=torch.float64)
    real = torch.tensor([c for c in range(v) if c not in pad])
    s[:, list(pad)] = NEG_INF
    t[:, list(pad)] = NEG_INF
    return s, t, real


def assert_second_backward_raises(objective: torch.Tensor, x: torch.Tensor) -> None:
    """Asking for the gradient's graph raises; the first-order gradient itself still works."""
    with pytest.raises(RuntimeError, match="first order only"):
        torch.autograd.grad(objective, x, create_graph=True, retain_graph=True)
    (grad,) = torch.autograd.grad(objective, x)
    assert torch.isfinite(grad).all() and not grad.requires_grad


# ---------------------------------------------------------------------------------------------------
# The fused head: inputs, closeness, the largest tensor an op makes
# ---------------------------------------------------------------------------------------------------


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


def head_inputs(n: int, h: int, v: int, seed: int = 0, dtype=torch.float32):
    """``hidden [N, H]``, ``weight [V, H]``, labels with every 5th ignored, temperatures in [0.5, 1.5]."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = IGNORE
    temperature = torch.rand(n, generator=g, dtype=torch.float64).add(0.5).to(dtype)
    return hidden, weight, labels, temperature


def assert_all_close(got, want, tol):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.to(torch.float32), b.to(torch.float32), atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------------
# Vocab-parallel over 2 gloo processes
# ---------------------------------------------------------------------------------------------------


class ParallelRun(NamedTuple):
    """One vocab-parallel case: ``case`` is ``"logprobs"``, a distillation kind (fused head) or
    ``"logits:<kind>"`` (per-token divergence of sharded logits)."""

    case: str
    v: int
    uneven: bool
    beta: float = 0.5
    teacher: str = "head"


PAR_N, PAR_H, PAR_CHUNK = 23, 12, 6


def _parallel_inputs(v: int):
    """Detached ``hidden [N, H]``, ``weight [V, H]``, labels, temperatures, teacher head ``[·, 10]``."""
    hidden, weight, labels, temps = head_inputs(PAR_N, PAR_H, v, seed=11)
    teacher_h, teacher_w, _, _ = head_inputs(PAR_N, 10, v, seed=12)
    return hidden.detach(), weight.detach(), labels, temps, teacher_h.detach(), teacher_w.detach()


def _distill_outputs(run: ParallelRun, hidden, w, teacher_h, teacher_w, mask, start, stop, parallel):
    """``(loss, per_token)`` of a distillation run on the vocabulary rows ``[start, stop)``; the teacher
    tensors require grad, and the loss must not reach them."""
    teacher_h, teacher_w = teacher_h.requires_grad_(), teacher_w.requires_grad_()
    if run.teacher == "logits":
        teacher_logits = (teacher_h.detach() @ teacher_w.detach().T).requires_grad_()  # [N, V]
        source, teacher_leaves = {"teacher_logits": teacher_logits[:, start:stop]}, [teacher_logits]
    else:
        source = {"teacher_hidden": teacher_h, "teacher_weight": teacher_w[start:stop]}
        teacher_leaves = [teacher_h, teacher_w]
    coefficients = torch.linspace(-1.0, 2.0, PAR_N)
    loss, per_token = linear_distill(
        hidden, w, **source, loss_mask=mask, coefficients=coefficients, kind=run.case, beta=run.beta,
        temperature=1.2, teacher_temperature=0.8, chunk_size=PAR_CHUNK, parallel=parallel,
    )  # fmt: skip
    assert torch.autograd.grad(loss, teacher_leaves, retain_graph=True, allow_unused=True) == (None,) * len(
        teacher_leaves
    ), "the teacher received a gradient"
    return (loss,), [per_token]


def _run_case(run: ParallelRun, start: int, stop: int, parallel) -> list[torch.Tensor]:
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
            teacher_temperature=0.8, chunk_size=PAR_CHUNK, parallel=parallel,
        )  # fmt: skip
        (d_logits,) = torch.autograd.grad((per_token * torch.randn(PAR_N, generator=g)).sum(), [logits])
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


def _expected_distill_collectives(run: ParallelRun) -> list[tuple[str, tuple[int, ...]]]:
    """Per token chunk of height C: MAX and SUM of the ``[2, C]`` log-normalisers, SUM of the
    ``[k, C]`` partial sums (k = 2 for JSD strictly inside (0, 1)); then, for the fused head, SUM of
    ``d_hidden [N, H]``."""
    kind = run.case.removeprefix("logits:")
    k = 2 if kind == "jsd" and 0.0 < run.beta < 1.0 else 1
    calls = []
    for t0 in range(0, PAR_N, PAR_CHUNK):
        c = min(PAR_CHUNK, PAR_N - t0)
        calls += [("max", (2, c)), ("sum", (2, c)), ("sum", (k, c))]
    return calls if run.case.startswith("logits:") else calls + [("sum", (PAR_N, PAR_H))]


def _worker(rank: int, world_size: int, runs: list[ParallelRun]) -> dict:
    results, collectives = [], []  # aligned with runs
    for run in runs:
        start, stop = _shards(run.v, run.uneven)[rank]
        with _Collectives() as comm:
            results.append(_run_case(run, start, stop, VocabParallel(dist.group.WORLD)))
        collectives.append(comm.calls)
    return {"results": results, "collectives": collectives}


def check_vocab_parallel(runs: list[ParallelRun]) -> None:
    """Each run over two gloo ranks (the vocabulary split in two shards) equals one process; a
    distillation communicates per-token scalars only."""
    ranks = run_gloo(_worker, world_size=2, args=(runs,), timeout=120)
    for i, run in enumerate(runs):
        want = _run_case(run, 0, run.v, None)
        for rank, (start, stop) in enumerate(_shards(run.v, run.uneven)):
            got = ranks[rank]["results"][i]
            # values and d_hidden: the full result on every rank; the last gradient: this rank's
            # rows of d_weight (columns of d_logits)
            assert_all_close(got[:-1], want[:-1], 1e-5)
            last = want[-1][:, start:stop] if run.case.startswith("logits:") else want[-1][start:stop]
            assert_all_close([got[-1]], [last], 1e-5)
            if not run.case.startswith("logprobs"):  # per-token scalars only: nothing of size C × V is communicated
                assert ranks[rank]["collectives"][i] == _expected_distill_collectives(run), run


# ---------------------------------------------------------------------------------------------------
# Divergences from logits: the materialised float64 reference (log_softmax + kl_div under autograd)
# ---------------------------------------------------------------------------------------------------


def logits_inputs(n: int = 11, v: int = 37, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    s = (scale * torch.randn(n, v, generator=g)).to(dtype).requires_grad_()
    t = (scale * torch.randn(n, v, generator=g)).to(dtype)
    mask = torch.rand(n, generator=g) > 0.3
    mask[0] = True
    return s, t, mask


def kl_div_teacher_log_probs(t: torch.Tensor, temperature: float, teacher_format: str) -> torch.Tensor:
    u = t.double().log() if teacher_format == "probs" else t.double()
    return F.log_softmax(u / temperature, dim=-1)


def kl_div_per_token(kind: str, log_q: torch.Tensor, log_p: torch.Tensor, beta: float = 0.3) -> torch.Tensor:
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


def token_mean_weights(mask: torch.Tensor | None, n: int) -> torch.Tensor:
    """``mask / max(count, 1)``: the weights of a token mean (float64)."""
    mask = torch.ones(n, dtype=torch.bool) if mask is None else mask
    return mask.double() / max(int(mask.sum()), 1)


def kl_div_reference(
    kind: str,
    s: torch.Tensor,
    t: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    weights: torch.Tensor | None = None,
    temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    teacher_format: str = "logits",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token losses [N], d(Σ_members w_t L_t)/ds) in float64 by autograd; ``w`` defaults to the
    token-mean weights."""
    s64 = s.detach().double().requires_grad_()
    w = token_mean_weights(mask, s.shape[0]) if weights is None else weights.double()
    mask = torch.ones(s.shape[0], dtype=torch.bool) if mask is None else mask
    safe_s = torch.where(mask[:, None], s64, 0.0)
    safe_t = torch.where(mask[:, None], t.double(), 1.0 if teacher_format == "probs" else 0.0)
    log_q = F.log_softmax(safe_s / temperature, dim=-1)
    log_p = kl_div_teacher_log_probs(safe_t, teacher_temperature, teacher_format)
    per_token = torch.where(mask, kl_div_per_token(kind, log_q, log_p), 0.0)
    torch.where(mask, per_token * w, 0.0).sum().backward()
    return per_token.detach(), s64.grad


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, rtol: float, floor: float = 0.0) -> None:
    """Relative to the tensor's scale: elementwise rtol plus an absolute floor of rtol · max|expected|
    (or ``floor`` if larger)."""
    expected = expected.to(torch.float64)
    atol = max(rtol * float(expected.abs().max()), floor) + 1e-30
    torch.testing.assert_close(actual.to(torch.float64), expected, rtol=rtol, atol=atol)


class LargeAllocations(TorchDispatchMode):
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
