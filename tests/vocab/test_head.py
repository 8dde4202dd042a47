"""packloss.head: fused log-probs / entropy / distillation against materialised autograd references."""

from __future__ import annotations

import socket
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from packloss import distill
from packloss.head import linear_distill, linear_logprobs
from packloss.testing import OpCounter

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
        loss = linear_distill(
            hidden,
            weight,
            teacher_hidden=teacher_h.detach(),
            teacher_weight=teacher_w.detach(),
            loss_mask=mask,
            kind="jsd",
            chunk_size=8,
        )
        loss.backward()
    assert counter.num_syncs == 0, counter.syncs
    assert sizes.max_numel < n * v


def _distill_reference(kind, hidden, weight, teacher_logits, mask, beta, t_s, t_t, normalize):
    extra = {"beta": beta} if kind == "jsd" else {}
    fn = getattr(distill, kind)
    return fn(
        hidden @ weight.T,
        teacher_logits,
        mask,
        student_temperature=t_s,
        teacher_temperature=t_t,
        normalize=normalize,
        **extra,
    )


@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl", "jsd", "soft_cross_entropy"])
@pytest.mark.parametrize("teacher", ["logits", "head"])
@pytest.mark.parametrize("normalize", ["token", "sum"])
def test_distill_matches_materialised(kind, teacher, normalize):
    hidden, weight, _, _ = _inputs(37, 16, 53)
    teacher_h, teacher_w, _, _ = _inputs(37, 12, 53, seed=5)
    teacher_h, teacher_w = teacher_h.detach(), teacher_w.detach()
    teacher_logits = teacher_h @ teacher_w.T  # [N, V]
    mask = torch.arange(37) % 4 != 1
    source = (
        {"teacher_logits": teacher_logits}
        if teacher == "logits"
        else {"teacher_hidden": teacher_h, "teacher_weight": teacher_w}
    )
    loss = linear_distill(
        hidden,
        weight,
        **source,
        loss_mask=mask,
        kind=kind,
        beta=0.3,
        student_temperature=1.3,
        teacher_temperature=0.8,
        normalize=normalize,
        chunk_size=8,
    )
    got = (loss, *torch.autograd.grad(loss * 2.0, [hidden, weight]))
    ref = _distill_reference(kind, hidden, weight, teacher_logits, mask, 0.3, 1.3, 0.8, normalize)
    want = (ref, *torch.autograd.grad(ref * 2.0, [hidden, weight]))
    _assert_close(got, want, 1e-5)


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
        (lambda h, w, y: linear_logprobs(h, w, y, chunk_size=0), ValueError),
        (lambda h, w, y: linear_logprobs(h, w, y, return_entropy=False, entropy_grad=True), ValueError),
        (lambda h, w, y: linear_distill(h, w), ValueError),
        (lambda h, w, y: linear_distill(h, w, torch.zeros(20, 29)), ValueError),
        (lambda h, w, y: linear_distill(h, w, torch.zeros(20, 30), kind="kl"), ValueError),
    ],
)
def test_bad_arguments_raise(call, error):
    hidden, weight, labels, _ = _inputs(20, 8, 30)
    with pytest.raises(error):
        call(hidden, weight, labels)


# ----------------------------------------------------------------------------------------------
# vocab-parallel over 2 gloo processes

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Run(NamedTuple):
    """One vocab-parallel case: ``case`` is ``"logprobs"`` or a distillation kind."""

    case: str
    v: int
    uneven: bool
    beta: float = 0.5
    teacher: str = "head"


_PARALLEL_RUNS = [
    _Run("logprobs", 30, False),
    _Run("logprobs", 31, True),
    _Run("reverse_kl", 30, True, teacher="head"),
    _Run("forward_kl", 31, False, teacher="logits"),
    _Run("jsd", 30, False, beta=0.3, teacher="head"),
    _Run("jsd", 31, True, beta=0.3, teacher="logits"),
    _Run("jsd", 30, False, beta=0.0, teacher="logits"),
    _Run("jsd", 31, True, beta=1.0, teacher="head"),
    _Run("soft_cross_entropy", 30, True, teacher="logits"),
]
_N, _H, _DISTILL_CHUNK = 23, 12, 6


def _parallel_inputs(v: int):
    """Detached ``hidden [N, H]``, ``weight [V, H]``, labels, temperatures, teacher head ``[·, 10]``."""
    hidden, weight, labels, temps = _inputs(_N, _H, v, seed=11)
    teacher_h, teacher_w, _, _ = _inputs(_N, 10, v, seed=12)
    return hidden.detach(), weight.detach(), labels, temps, teacher_h.detach(), teacher_w.detach()


def _distill_outputs(run: _Run, hidden, w, teacher_h, teacher_w, mask, start, stop, group):
    """``(loss,)`` of a distillation run on the vocabulary rows ``[start, stop)``; the teacher tensors
    require grad, and the loss must not reach them."""
    teacher_h, teacher_w = teacher_h.requires_grad_(), teacher_w.requires_grad_()
    if run.teacher == "logits":
        teacher_logits = (teacher_h.detach() @ teacher_w.detach().T).requires_grad_()  # [N, V]
        source, teacher_leaves = {"teacher_logits": teacher_logits[:, start:stop]}, [teacher_logits]
    else:
        source = {"teacher_hidden": teacher_h, "teacher_weight": teacher_w[start:stop]}
        teacher_leaves = [teacher_h, teacher_w]
    loss = linear_distill(
        hidden,
        w,
        **source,
        loss_mask=mask,
        kind=run.case,
        beta=run.beta,
        student_temperature=1.2,
        teacher_temperature=0.8,
        chunk_size=_DISTILL_CHUNK,
        group=group,
    )
    assert torch.autograd.grad(loss, teacher_leaves, retain_graph=True, allow_unused=True) == (None,) * len(
        teacher_leaves
    ), "the teacher received a gradient"
    return (loss,)


def _run_case(run: _Run, start: int, stop: int, group) -> list[torch.Tensor]:
    """Outputs, ``d_hidden`` and ``d_weight`` of one run computed with the vocabulary rows
    ``[start, stop)`` (all of them and ``group=None`` for the single-process result)."""
    hidden, weight, labels, temps, teacher_h, teacher_w = _parallel_inputs(run.v)
    hidden.requires_grad_()
    w = weight[start:stop].clone().requires_grad_()
    if run.case == "logprobs":
        outs = linear_logprobs(
            hidden,
            w,
            labels,
            temperature=temps,
            chunk_size=7,
            vocab_chunk_size=5,
            softcap=4.0,
            entropy_grad=True,
            group=group,
            vocab_start=None if group is None else start,
        )
    else:
        outs = _distill_outputs(run, hidden, w, teacher_h, teacher_w, labels != IGNORE, start, stop, group)
    g = torch.Generator().manual_seed(4)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    d_h, d_w = torch.autograd.grad(loss, [hidden, w])
    return [o.detach() for o in outs] + [d_h, d_w]


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
                raise AssertionError(f"vocab-parallel linear_distill must not call dist.{name}")

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
    ``[k, C]`` partial sums (k = 2 for JSD strictly inside (0, 1)); then SUM of ``d_hidden [N, H]``."""
    k = 2 if run.case == "jsd" and 0.0 < run.beta < 1.0 else 1
    calls = []
    for t0 in range(0, _N, _DISTILL_CHUNK):
        c = min(_DISTILL_CHUNK, _N - t0)
        calls += [("max", (2, c)), ("sum", (2, c)), ("sum", (k, c))]
    return calls + [("sum", (_N, _H))]


def _worker(rank: int, port: int, path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results, collectives = [], []  # aligned with _PARALLEL_RUNS
        for run in _PARALLEL_RUNS:
            start, stop = _shards(run.v, run.uneven)[rank]
            with _Collectives() as comm:
                results.append(_run_case(run, start, stop, dist.group.WORLD))
            collectives.append(comm.calls)
        torch.save({"results": results, "collectives": collectives}, f"{path}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_matches_single_process(tmp_path):
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * WORLD, "a vocab-parallel worker failed or hung"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for i, run in enumerate(_PARALLEL_RUNS):
        want = _run_case(run, 0, run.v, None)
        for rank, (start, stop) in enumerate(_shards(run.v, run.uneven)):
            got = ranks[rank]["results"][i]
            _assert_close(got[:-1], want[:-1], 1e-5)  # values and d_hidden: the full result on every rank
            _assert_close([got[-1]], [want[-1][start:stop]], 1e-5)  # d_weight: this rank's rows
            if run.case != "logprobs":  # per-token scalars only: nothing of size C × V is communicated
                assert ranks[rank]["collectives"][i] == _expected_distill_collectives(run), run
