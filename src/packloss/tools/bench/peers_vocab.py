"""The vocabulary rows of ``packloss bench peers``: fused LM heads (cut-cross-entropy, TRL) and
distillation from hidden states (Liger) beside packloss's and a naive materialised loss (eager and
compiled), at several shapes, each variant in a fresh process per round, values checked against naive
autograd before timing, and the head's matmuls alone as its floor.
``docs/benchmarks.md``, "How the suites measure"."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch
from torch import Tensor

from packloss.tools.bench._measure import (
    check,
    import_peer,
    peak_bytes,
    release_freed_memory,
    reset_peak,
    run_fresh,
    time_ms,
)
from packloss.tools.bench.peers_head_rl import RL_HEAD_VARIANTS, rl_head_fn, rl_head_inputs
from packloss.vocab.core import HEAD_BLOCK, chunk_ranges, chunk_rows, mm_into
from packloss.vocab.head import DEFAULT_VOCAB_CHUNK_SIZE

__all__ = ["HEAD_RTOL", "JSD_BETA", "HEAD_FLOORS", "head_fn", "distill_fn", "check_fused", "measure_fused", "run_fused",
           "head_matmuls", "measure_floor", "run_head_floors"]  # fmt: skip

HEAD_RTOL = 1e-5
JSD_BETA = 0.5


HEAD_VARIANTS = {
    "naive_eager": None,
    "naive_compiled": None,
    "packloss_fused": None,
    "cce_torch_compile": "cut_cross_entropy",
    "trl_chunked": "trl.kernels",
}
DISTILL_VARIANTS = {
    "naive_eager": None,
    "naive_compiled": None,
    "packloss_fused": None,
    "packloss_fused_compiled": None,
    "liger_compiled": "liger_kernel.chunked_loss",
}
_COMPILED_VARIANTS = {"naive_compiled", "packloss_fused_compiled"}  # left out without compiled columns


def _head_inputs(n: int, h: int, v: int, device: str, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(device).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.05).to(device).requires_grad_()
    return hidden, weight, torch.randint(0, v, (n,), generator=g).to(device)


def _naive_logprobs(hd: Tensor, w: Tensor, y: Tensor) -> Tensor:
    """``log_softmax(h Wᵀ)[label]`` with the ``[N, V]`` logits materialised."""
    return torch.log_softmax((hd @ w.T).float(), -1).gather(1, y[:, None]).squeeze(1)


def head_fn(variant: str) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``(hidden, weight, labels) -> log p(label) [N]`` of one head variant."""
    if variant == "naive_eager":
        return _naive_logprobs
    if variant == "naive_compiled":
        return torch.compile(_naive_logprobs)
    if variant == "packloss_fused":
        from packloss.vocab import linear_logprobs

        return lambda hd, w, y: linear_logprobs(hd, w, y, return_entropy=False)[0]
    if variant == "cce_torch_compile":
        from cut_cross_entropy import linear_cross_entropy

        return lambda hd, w, y: -linear_cross_entropy(hd, w, y, impl="torch_compile", reduction="none")
    if variant == "trl_chunked":  # TRL's fused LM head (its torch tiles off Triton), at TRL's own tile width
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        def trl_chunked(hd: Tensor, w: Tensor, y: Tensor) -> Tensor:
            return ChunkedLogProbFunction.apply(hd, w, None, y, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ())[0]

        return trl_chunked
    raise ValueError(f"head_fn: unknown variant {variant!r}")


def _distill_inputs(n: int, h: int, v: int, device: str, seed: int) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(device).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.05).to(device).requires_grad_()
    t_hidden = (torch.randn(n, h, generator=g) * 0.5).to(device)
    t_weight = (torch.randn(v, h, generator=g) * 0.05).to(device)
    labels = torch.randint(0, v, (n,), generator=g)
    labels = torch.where(torch.rand(n, generator=g) < 0.1, -100, labels).to(device)  # ~10% not members
    return hidden, weight, t_hidden, t_weight, labels


def _naive_jsd(hd: Tensor, w: Tensor, th: Tensor, tw: Tensor, y: Tensor) -> Tensor:
    """``Σ_members JSD_β / #members`` with ``M = β P + (1 − β) Q`` (P teacher, Q student), materialised."""
    log_q = torch.log_softmax((hd @ w.T).float(), -1)  # [N, V]
    log_p = torch.log_softmax((th @ tw.T).float(), -1)  # [N, V]
    log_m = torch.logaddexp(log_p + math.log(JSD_BETA), log_q + math.log(1 - JSD_BETA))
    per_token = JSD_BETA * (log_p.exp() * (log_p - log_m)).sum(-1) + (1 - JSD_BETA) * (
        log_q.exp() * (log_q - log_m)
    ).sum(-1)  # [N]
    members = y != -100
    return torch.where(members, per_token, 0.0).sum() / members.sum().clamp(min=1)


def distill_fn(variant: str) -> Callable[..., Tensor]:
    """``(hidden, weight, teacher_hidden, teacher_weight, labels) -> loss`` (0-d) of one distill variant."""
    if variant == "naive_eager":
        return _naive_jsd
    if variant == "naive_compiled":
        return torch.compile(_naive_jsd)
    if variant in ("packloss_fused", "packloss_fused_compiled"):
        from packloss.vocab import linear_distill

        impl = "compiled" if variant == "packloss_fused_compiled" else None  # None: the CPU default, eager

        def fused(hd: Tensor, w: Tensor, th: Tensor, tw: Tensor, y: Tensor) -> Tensor:
            members = y != -100
            coef = members.float() / members.sum().clamp(min=1)
            return linear_distill(
                hd, w, teacher_hidden=th, teacher_weight=tw, kind="jsd", beta=JSD_BETA, loss_mask=members,
                coefficients=coef, impl=impl,
            )[0]  # fmt: skip

        return fused
    if variant == "liger_compiled":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        liger = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=JSD_BETA, compiled=True)
        return lambda hd, w, th, tw, y: liger(hd, w, th, tw, y)
    raise ValueError(f"distill_fn: unknown variant {variant!r}")


def _kind(kind: str) -> tuple[dict[str, str | None], Callable[[str], Callable[..., Tensor]], Callable[..., tuple]]:
    """``(variants, variant -> fn, inputs)`` of a comparison: ``head``, ``distill`` or ``rl head``."""
    kinds = {
        "head": (HEAD_VARIANTS, head_fn, _head_inputs),
        "distill": (DISTILL_VARIANTS, distill_fn, _distill_inputs),
        "rl head": (RL_HEAD_VARIANTS, rl_head_fn, rl_head_inputs),
    }
    if kind not in kinds:
        raise ValueError(f"unknown comparison {kind!r}; choose from {tuple(kinds)}")
    return kinds[kind]


def _values(kind: str, variant: str, n: int, h: int, v: int, device: str, seed: int) -> dict[str, Tensor]:
    """One variant's output and gradients w.r.t. the student's hidden and weight."""
    _, fn, make = _kind(kind)
    inputs = make(n, h, v, device, seed)
    out = fn(variant)(*inputs)
    g_h, g_w = torch.autograd.grad(out.sum(), [inputs[0], inputs[1]])
    return {"value": out.detach(), "d hidden": g_h, "d weight": g_w}


def check_fused(kind: str, variants: list[str], n: int, h: int, v: int, device: str, seed: int = 0) -> dict[str, float]:
    """Every variant's values against ``naive_eager``'s (:class:`ValuesDisagree`); the max relative errors."""
    expected = _values(kind, "naive_eager", n, h, v, device, seed)
    errors = {}
    for variant in variants:
        if variant == "naive_eager":
            continue
        actual = _values(kind, variant, n, h, v, device, seed)
        errors[variant] = max(check(f"{kind} {variant} {k}", actual[k], expected[k], HEAD_RTOL) for k in expected)
    return errors


def _peak_and_times(step: Callable[[], None], device: str, repeat: int) -> dict:
    """Peak memory of one ``step()`` after a warm-up call (compilation and first-touch pages stay outside
    the measured peak), and the times of that call and ``repeat − 1`` more."""
    step()
    release_freed_memory(device)
    base = reset_peak(device)
    first = time_ms(step, device, warmup=0, repeat=1)
    peak = peak_bytes(device) - base
    return {"times_ms": [first, *(time_ms(step, device, warmup=0, repeat=1) for _ in range(repeat - 1))],
            "peak_bytes": peak}  # fmt: skip


def measure_fused(kind: str, variant: str, n: int, h: int, v: int, device: str, repeat: int, threads: int) -> dict:
    """In a fresh process: :func:`_peak_and_times` of one forward+backward; ``value``: the summed output."""
    torch.set_num_threads(threads)
    _, fn_of, make = _kind(kind)
    inputs = make(n, h, v, device, 0)
    fn = fn_of(variant)
    hidden, weight = inputs[0], inputs[1]
    value: list[float] = []

    def step() -> None:
        out = fn(*inputs).sum()
        torch.autograd.grad(out, [hidden, weight])
        value[:] = [float(out.detach())]

    return _peak_and_times(step, device, repeat) | {"value": value[0]}


def _rounds(target: str, variants: list[str], kwargs: dict, rounds: int, progress, label: str) -> dict[str, dict]:
    """Each variant measured in ``rounds`` fresh processes, round-robin (so that a slow spell of the
    machine hits every variant alike): ``time_ms`` the median over every timed call, ``time_min_ms`` /
    ``time_max_ms`` the fastest and slowest process's median, ``peak_bytes`` the largest process's."""
    runs: dict[str, list[dict]] = {variant: [] for variant in variants}
    for r in range(rounds):
        for variant in variants:
            progress(f"peers {label} {variant} ({r + 1}/{rounds})")
            runs[variant].append(run_fresh(target, kwargs | {"variant": variant}))
    out = {}
    for variant, results in runs.items():
        medians = [statistics.median(x["times_ms"]) for x in results]
        out[variant] = {
            "time_ms": statistics.median(t for x in results for t in x["times_ms"]),
            "time_min_ms": min(medians),
            "time_max_ms": max(medians),
            "peak_bytes": max(x["peak_bytes"] for x in results),
            **{k: v for k, v in results[0].items() if k not in ("times_ms", "peak_bytes")},
        }
    return out


def _shape(shape: tuple[int, int, int]) -> str:
    n, h, v = shape
    return f"N={n},H={h},V={v}"


def run_fused(kind: str, shapes: list[tuple[int, int, int]], check_shape: tuple[int, int, int], repeat: int,
              rounds: int, device: str, progress, notes: list[str], compiled: bool = True) -> list[dict]:  # fmt: skip
    """``head``, ``distill`` or ``rl head``: the variants whose modules import (the compiled ones only with
    ``compiled``), checked, then measured at each shape (:func:`_rounds`); every packloss row gets its
    ratios to each peer and to the compiled naive loss, every row its ratios to the eager naive one."""
    table = _kind(kind)[0]
    variants = []
    for variant, module in table.items():
        if variant in _COMPILED_VARIANTS and not compiled:
            continue
        why = None if module is None else import_peer(module)[1]
        if why is None:
            variants.append(variant)
        else:
            notes.append(f"{kind}/{variant}: {why}")
    progress(f"peers {kind} check")
    errors = check_fused(kind, variants, *check_shape, device)
    rows = []
    for shape in shapes:
        n, h, v = shape
        kwargs = dict(kind=kind, n=n, h=h, v=v, device=device, repeat=repeat, threads=torch.get_num_threads())
        target = "packloss.tools.bench.peers_vocab:measure_fused"
        measured = _rounds(target, variants, kwargs, rounds, progress, f"{kind} {_shape(shape)}")
        shape_rows = [{"comparison": kind, "shape": _shape(shape), "variant": k, **out} for k, out in measured.items()]
        naive = shape_rows[0]  # naive_eager: always available
        for row in shape_rows[1:]:
            row["time_vs_naive"] = row["time_ms"] / naive["time_ms"]
            row["peak_vs_naive"] = row["peak_bytes"] / max(naive["peak_bytes"], 1)
            row["max_rel_err"] = errors[row["variant"]]
        baselines = [r for r in shape_rows[1:] if not r["variant"].startswith("packloss_")]
        for ours in (r for r in shape_rows if r["variant"].startswith("packloss_")):
            for base in baselines:
                ours[f"time_vs_{base['variant']}"] = ours["time_ms"] / base["time_ms"]
                ours[f"peak_vs_{base['variant']}"] = ours["peak_bytes"] / max(base["peak_bytes"], 1)
        rows.extend(shape_rows)
    return rows


HEAD_FLOORS = ("matmuls_packloss_4", "matmuls_materialised_3")


def _blocked_matmuls(hidden: Tensor, weight: Tensor) -> None:
    """linear_logprobs's four matmuls on its default blocks, nothing else: forward ``x = h Wᵀ`` per
    block; backward ``x`` again, ``d_hidden += x W_block``, ``d_weight[block] += xᵀ h`` (``x`` stands in
    for the block's gradient, which has its shape)."""
    n, v = hidden.shape[0], weight.shape[0]
    cols = min(DEFAULT_VOCAB_CHUNK_SIZE["cpu" if hidden.device.type == "cpu" else "accelerator"], v)
    rows = chunk_rows(cols, hidden.device, budget=HEAD_BLOCK)
    buf = torch.empty(min(rows, n) * cols, dtype=hidden.dtype, device=hidden.device)
    d_h, d_w = torch.empty_like(hidden), torch.empty_like(weight)
    for backward in (False, True):
        for t0, t1 in chunk_ranges(n, rows):
            for v0, v1 in chunk_ranges(v, cols):
                x = torch.mm(hidden[t0:t1], weight[v0:v1].T, out=buf[: (t1 - t0) * (v1 - v0)].view(t1 - t0, v1 - v0))
                if backward:
                    mm_into(d_h[t0:t1], x, weight[v0:v1], first=v0 == 0)
                    mm_into(d_w[v0:v1], x.T, hidden[t0:t1], first=t0 == 0)


def _materialised_matmuls(hidden: Tensor, weight: Tensor) -> None:
    """The three full-size matmuls of a head that keeps its ``[N, V]`` logits: ``x = h Wᵀ``, ``x W``,
    ``xᵀ h`` (``x`` standing in for the logits' gradient)."""
    x = torch.mm(hidden, weight.T)  # [N, V]
    torch.mm(x, weight)  # d_hidden [N, H]
    torch.mm(x.T, hidden)  # d_weight [V, H]


def head_matmuls(variant: str) -> Callable[[Tensor, Tensor], None]:
    """``(hidden, weight) -> None``, no gradient tracked: ``matmuls_packloss_4`` (:func:`_blocked_matmuls`)
    or ``matmuls_materialised_3`` (:func:`_materialised_matmuls`: cut-cross-entropy's ``torch_compile``
    path and the naive head do these three)."""
    fns = {"matmuls_packloss_4": _blocked_matmuls, "matmuls_materialised_3": _materialised_matmuls}
    if variant not in fns:
        raise ValueError(f"head_matmuls: unknown variant {variant!r}; choose from {HEAD_FLOORS}")
    return fns[variant]


def measure_floor(variant: str, n: int, h: int, v: int, device: str, repeat: int, threads: int) -> dict:
    """In a fresh process: :func:`head_matmuls` ``variant``'s peak memory and times (:func:`_peak_and_times`)."""
    torch.set_num_threads(threads)
    hidden, weight, _ = _head_inputs(n, h, v, device, 0)
    fn = head_matmuls(variant)

    def step() -> None:
        with torch.no_grad():
            fn(hidden, weight)

    return _peak_and_times(step, device, repeat)


def run_head_floors(
    shapes: list[tuple[int, int, int]], repeat: int, rounds: int, device: str, progress, head_rows: list[dict]
) -> list[dict]:
    """The ``head floor`` rows at each of the head's timed shapes, each divided by every ``head`` row's
    time at that shape."""
    rows = []
    for shape in shapes:
        n, h, v = shape
        kwargs = dict(n=n, h=h, v=v, device=device, repeat=repeat, threads=torch.get_num_threads())
        target = "packloss.tools.bench.peers_vocab:measure_floor"
        measured = _rounds(target, list(HEAD_FLOORS), kwargs, rounds, progress, f"head floor {_shape(shape)}")
        heads = [r for r in head_rows if r["shape"] == _shape(shape)]
        for variant, out in measured.items():
            row = {"comparison": "head floor", "shape": _shape(shape), "variant": variant, **out}
            row |= {f"time_vs_{r['variant']}": out["time_ms"] / r["time_ms"] for r in heads}
            rows.append(row)
    return rows
