"""The ``cp`` suite: one packed bin split over CP gloo ranks on CPU (``torch.chunk`` shards), loss
forward + backward per micro-batch, packloss's per-sequence partial sums against gather-first (every
rank all-gathers the shard's stream and computes the whole bin's loss, as prime-rl's ``gather_for_cp``):
bytes each rank sends into collectives, time, and for the fused-head distillation peak memory. Both
variants are checked to give each rank the same gradient before they are timed. ``docs/benchmarks.md``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from packloss.core.bin import Component, Plan
from packloss.core.context_parallel import ContextShard
from packloss.core.engine import compute_loss
from packloss.core.outputs import Outputs
from packloss.core.pg import PolicyGradient
from packloss.core.step import count_denominators
from packloss.core.trust_regions import GSPO
from packloss.testing.archetypes import random_seq_lens
from packloss.testing.context_parallel import CollectiveCount
from packloss.testing.dist import run_gloo
from packloss.tools.bench._measure import check, peak_bytes, release_freed_memory, reset_peak, time_ms
from packloss.vocab.component import VocabDistill

__all__ = ["run"]

OBJECTIVES = {
    "ppo_clip/token": (PolicyGradient("ppo_clip"), "token"),
    "gspo/sequence_mean": (PolicyGradient(GSPO(0.02, 0.02)), "sequence_mean"),
}
_RTOL = 1e-5


def _all_gather() -> Callable:
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13


class _GatherFirst(torch.autograd.Function):
    """All-gather a contiguous shard ``[C]`` (padded to the chunk size) into the bin's ``[N]``; every rank
    then computes the whole loss, so each keeps its own slice of the gradient (no collective back)."""

    @staticmethod
    def forward(ctx, x: Tensor, start: int, n: int, chunk: int, world: int) -> Tensor:  # noqa: ANN001
        ctx.start, ctx.size = start, x.shape[0]
        padded = torch.zeros((chunk, *x.shape[1:]), dtype=x.dtype)
        padded[: x.shape[0]] = x
        out = torch.empty((chunk * world, *x.shape[1:]), dtype=x.dtype)
        _all_gather()(out, padded)
        return out[:n]

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        return grad[ctx.start : ctx.start + ctx.size], None, None, None, None


def _bytes(calls: list[tuple[str, tuple[int, ...]]], itemsize: int) -> int:
    """Bytes a rank puts into the counted collectives: an all-reduce's tensor, an all-gather's own chunk."""
    total = 0
    for name, shape in calls:
        numel = 1
        for d in shape:
            numel *= d
        total += numel * itemsize // (1 if name == "all_reduce" else dist.get_world_size())
    return total


def _rl_worker(rank: int, world: int, name: str, num_tokens: int, num_seqs: int, warmup: int, repeat: int) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(num_seqs)
    lens = random_seq_lens(num_tokens, num_seqs, g)
    n = sum(lens)
    objective, mode = OBJECTIVES[name]
    mask = torch.rand(n, generator=g) > 0.3
    rollout = -torch.rand(n, generator=g) * 2 - 0.05
    trn_full = (rollout + 0.01 * torch.randn(n, generator=g)).clamp(max=-1e-4)
    adv = torch.randn(n, generator=g)
    shard = ContextShard.contiguous(lens, rank, world)
    pos = shard.positions
    start, chunk = (int(pos[0]) if pos.numel() else n), -(-n // world)

    def plan(p: Tensor | None, s: ContextShard | None) -> Plan:
        take = (lambda x: x) if p is None else (lambda x: x[p])
        comp = {"pg": Component(objective, mask=take(mask), normalize=mode)}
        return Plan(lens, comp, rollout_logprobs=take(rollout), advantages=take(adv), old_logprobs=take(rollout),
                    shard=s)  # fmt: skip

    sharded, whole = plan(pos, shard), plan(None, None)
    den_sharded = count_denominators([sharded], all_reduce=True)
    den_whole = count_denominators([whole])  # every rank counts the whole bin itself
    trn = trn_full[pos].clone().requires_grad_()

    def partial_sums() -> Tensor:
        trn.grad = None
        compute_loss(sharded, Outputs(logprobs=trn), den_sharded).loss.backward()
        return trn.grad

    def gather_first() -> Tensor:
        trn.grad = None
        gathered = _GatherFirst.apply(trn, start, n, chunk, world)
        compute_loss(whole, Outputs(logprobs=gathered), den_whole).loss.backward()
        return trn.grad

    out = {}
    reference = None
    for variant, fn in (("partial_sums", partial_sums), ("gather_first", gather_first)):
        with CollectiveCount() as comm:
            grad = fn().clone()
        if reference is None:
            reference = grad
        else:
            check(f"cp {name} {variant}", grad, reference, _RTOL)
        out[variant] = {"bytes": _bytes(comm.calls, 4), "collectives": len(comm.calls),
                        "time_ms": time_ms(fn, "cpu", warmup, repeat)}  # fmt: skip
    return out


def _head_worker(rank: int, world: int, num_tokens: int, hidden: int, vocab: int) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    lens = random_seq_lens(num_tokens, 64, g)
    n = sum(lens)
    h_all = torch.randn(n, hidden, generator=g) * 0.5
    teacher_all = torch.randn(n, hidden, generator=g) * 0.5
    w = (torch.randn(vocab, hidden, generator=g) * 0.05).requires_grad_()
    teacher_w = torch.randn(vocab, hidden, generator=g) * 0.05
    mask = torch.rand(n, generator=g) > 0.2
    shard = ContextShard.contiguous(lens, rank, world)
    pos = shard.positions
    start, chunk = int(pos[0]), -(-n // world)
    objective = VocabDistill("reverse_kl")

    def plan(p: Tensor | None, s: ContextShard | None, teacher: Tensor) -> Plan:
        m = mask if p is None else mask[p]
        return Plan(lens, {"kd": Component(objective, mask=m, normalize="sequence_mean")}, teacher_hidden=teacher,
                    teacher_weight=teacher_w, shard=s)  # fmt: skip

    out = {}
    grads = {}
    for variant in ("partial_sums", "gather_first"):
        h = h_all[pos].clone().requires_grad_()
        release_freed_memory("cpu")
        base = reset_peak("cpu")
        if variant == "partial_sums":
            p = plan(pos, shard, teacher_all[pos])
            loss = compute_loss(p, Outputs(hidden=h, head_weight=w), count_denominators([p], all_reduce=True)).loss
        else:
            p = plan(None, None, _GatherFirst.apply(teacher_all[pos], start, n, chunk, world).detach())
            gathered = _GatherFirst.apply(h, start, n, chunk, world)
            loss = compute_loss(p, Outputs(hidden=gathered, head_weight=w), count_denominators([p])).loss
        loss.backward()
        out[variant] = {"peak_bytes": peak_bytes("cpu") - base}
        grads[variant] = h.grad.clone()
        w.grad = None
    check("cp head distill", grads["gather_first"], grads["partial_sums"], _RTOL)
    return out


def run(device: str, quick: bool, progress: Callable[[str], None] | None = None) -> dict:
    """Rows per ``(objective, cp)``: bytes into collectives per rank and fwd+bwd time (median over
    ranks' medians) of both variants and their ratios; fused-head distillation: peak memory per rank."""
    if device != "cpu":
        raise ValueError(f"packloss bench cp runs on CPU gloo ranks only, got --device {device}")
    report = progress or (lambda _description: None)
    num_tokens, num_seqs, warmup, repeat = (2048, 16, 1, 3) if quick else (32768, 256, 3, 20)
    head = (2048, 256, 256) if quick else (32768, 1024, 1024)  # hidden states, not vocabulary chunks, dominate
    rows = []
    for cp in (2, 4):
        for name in OBJECTIVES:
            report(f"cp {name} cp={cp}")
            ranks = run_gloo(_rl_worker, world_size=cp, args=(name, num_tokens, num_seqs, warmup, repeat), timeout=900)
            row = {"comparison": "cp", "shape": f"{name} N={num_tokens} S={num_seqs}", "cp": cp}
            for variant in ("partial_sums", "gather_first"):
                row[f"{variant}_bytes"] = max(r[variant]["bytes"] for r in ranks)
                row[f"{variant}_ms"] = sorted(r[variant]["time_ms"] for r in ranks)[len(ranks) // 2]
            row["partial_sums_collectives"] = ranks[0]["partial_sums"]["collectives"]
            row["bytes_ratio"] = row["partial_sums_bytes"] / max(row["gather_first_bytes"], 1)
            row["time_ratio"] = row["partial_sums_ms"] / row["gather_first_ms"]
            rows.append(row)
        report(f"cp head distill cp={cp}")
        ranks = run_gloo(_head_worker, world_size=cp, args=head, timeout=900)
        shape = f"head reverse_kl N={head[0]} H={head[1]} V={head[2]}"
        row = {"comparison": "cp memory", "shape": shape, "cp": cp}
        for variant in ("partial_sums", "gather_first"):
            row[f"{variant}_peak_MiB"] = max(r[variant]["peak_bytes"] for r in ranks) / 2**20
        row["memory_ratio"] = row["partial_sums_peak_MiB"] / row["gather_first_peak_MiB"]
        rows.append(row)
    return {"rows": rows, "threads": torch.get_num_threads()}
