"""The student's side of top-k distillation, straight from hidden states ``h [N, H]`` and the LM-head
weight ``W [V, H]``: per token, the scaled logits at the teacher's top-k ids and the log-sum-exp over
every other id (the tail), ``x = (h / T) Wᵀ`` walked in token × vocabulary blocks with an online
log-sum-exp, so the ``N × V`` logits never exist. The backward recomputes each block. The block helpers
are shared with the logits path (:mod:`packloss.vocab.topk`). Formulas: ``docs/distill.md``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from packloss.core.dtypes import compute_dtype
from packloss.vocab.core import chunk_ranges, gradient_buffer, mm_into
from packloss.vocab.first_order import first_order

__all__ = ["HeadBlocks", "block_columns", "head_topk_logits", "mask_topk_", "tail_logsumexp"]

NEG_INF = -math.inf


def block_columns(ids: Tensor, present: Tensor, v0: int, width: int) -> tuple[Tensor, Tensor]:
    """The top-k ids of ``ids [C, K]`` (long) that are ``present [C, K]`` and fall in the vocabulary
    block ``[v0, v0 + width)``: ``(in_block [C, K] bool, column [C, K] long)``, the column clamped into
    the block (read only where ``in_block``)."""
    local = ids - v0  # [C, K]
    return present & (local >= 0) & (local < width), local.clamp(0, width - 1)


def mask_topk_(x: Tensor, in_block: Tensor, column: Tensor) -> Tensor:
    """``x [C, B]`` with ``−inf`` at the columns of its top-k ids, in place. An ``amin`` scatter: an id
    that is absent or outside the block is clamped onto some column and scatters ``+inf`` there, which
    leaves the column as it is (or as a present id set it), in any order."""
    fill = torch.full(column.shape, math.inf, dtype=x.dtype, device=x.device).masked_fill_(in_block, NEG_INF)
    return x.scatter_reduce_(1, column, fill, reduce="amin")


def tail_logsumexp(m: Tensor, s: Tensor) -> Tensor:
    """``log Σ exp`` from an online state ``(m, s)`` (``[C]``): ``−inf`` where every entry was ``−inf``."""
    return torch.where(m == NEG_INF, 0.0, m) + s.log()


def _tail_update(m: Tensor, s: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """Merge the block ``x [C, B]`` (overwritten) into the online log-sum-exp state ``(m, s)``: ``m``
    the running max, ``s = Σ exp(x − m)``; a state that is all ``−inf`` so far uses 0 as its reference, so
    no ``−inf − (−inf)`` is formed."""
    new_m = torch.maximum(m, x.amax(dim=1))  # [C]
    ref = torch.where(new_m == NEG_INF, 0.0, new_m)  # [C]
    s = s * torch.exp(m - ref) + x.sub_(ref[:, None]).exp_().sum(dim=1)
    return new_m, s


@dataclass(frozen=True)
class HeadBlocks:
    """The block of the fused pass: ``rows`` tokens × ``cols`` vocabulary entries."""

    rows: int
    cols: int


def _chunk_input(hidden: Tensor, mask: Tensor, t0: int, t1: int, inv_t: float, cdt: torch.dtype) -> Tensor:
    """``h / T`` of the token rows ``[t0, t1)`` in ``cdt``, zero off the members (so NaN or inf there reach
    neither the statistics nor ``d_weight``).  ``[C, H]``."""
    h = hidden[t0:t1].to(cdt).masked_fill(~mask[t0:t1, None], 0.0)  # [C, H], a copy
    return h if inv_t == 1.0 else h.mul_(inv_t)


class _TopKHead(torch.autograd.Function):
    """Forward: ``(tail [N], picked [N, K])``; backward: ``∂/∂x_v = g_tail · exp(x_v − tail) · [v ∉ top-k]
    + Σ_k g_picked_k · [v = id_k]``, recomputed block by block, then ``d_hidden = ∂x W / T`` and
    ``d_weight = ∂xᵀ (h / T)``."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, present, mask, inv_t: float, blocks: HeadBlocks):
        cdt = compute_dtype(hidden.dtype, weight.dtype)
        (n, k), v, dev = ids.shape, weight.shape[0], hidden.device
        tail = torch.empty(n, dtype=cdt, device=dev)  # [N]
        picked = torch.empty(n, k, dtype=cdt, device=dev)  # [N, K]
        buf = torch.empty(min(blocks.rows, n) * min(blocks.cols, v), dtype=cdt, device=dev)  # one block, reused
        for t0, t1 in chunk_ranges(n, blocks.rows):
            h_in = _chunk_input(hidden, mask, t0, t1, inv_t, cdt)  # [C, H]
            m = torch.full((t1 - t0,), NEG_INF, dtype=cdt, device=dev)  # [C]
            s = torch.zeros(t1 - t0, dtype=cdt, device=dev)  # [C]
            a = torch.zeros(t1 - t0, k, dtype=cdt, device=dev)  # [C, K]
            for v0, v1 in chunk_ranges(v, blocks.cols):
                x = torch.mm(h_in, weight[v0:v1].to(cdt).T, out=buf[: (t1 - t0) * (v1 - v0)].view(t1 - t0, v1 - v0))
                in_block, col = block_columns(ids[t0:t1], present[t0:t1], v0, v1 - v0)
                a = a + torch.where(in_block, x.gather(1, col), 0.0)
                m, s = _tail_update(m, s, mask_topk_(x, in_block, col))
            tail[t0:t1], picked[t0:t1] = tail_logsumexp(m, s), a
        ctx.save_for_backward(hidden, weight, ids, present, mask, tail)
        ctx.inv_t, ctx.blocks = inv_t, blocks
        return tail, picked

    @staticmethod
    @first_order("linear_topk_divergence")
    def backward(ctx, g_tail, g_picked):
        hidden, weight, ids, present, mask, tail = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return None, None, None, None, None, None, None
        cdt, (n, v), dev = tail.dtype, (hidden.shape[0], weight.shape[0]), hidden.device
        g_t = torch.zeros_like(tail) if g_tail is None else torch.where(mask, g_tail, 0.0)  # [N]
        g_a = torch.zeros(ids.shape, dtype=cdt, device=dev) if g_picked is None else g_picked  # [N, K]
        g_a = torch.where(present, g_a, 0.0)  # [N, K]
        lt = torch.where(tail == NEG_INF, 0.0, tail)  # an empty tail: all its x are −inf, exp gives 0
        d_h = gradient_buffer(hidden.shape, n, cdt, dev) if need_h else None  # [N, H]
        d_w = gradient_buffer(weight.shape, n, cdt, dev) if need_w else None  # [V, H]
        rows, cols = ctx.blocks.rows, ctx.blocks.cols
        buf = torch.empty(min(rows, n) * min(cols, v), dtype=cdt, device=dev)
        for t0, t1 in chunk_ranges(n, rows):
            h_in = _chunk_input(hidden, mask, t0, t1, ctx.inv_t, cdt)  # [C, H]
            for v0, v1 in chunk_ranges(v, cols):
                w_b = weight[v0:v1].to(cdt)  # [B, H]
                x = torch.mm(h_in, w_b.T, out=buf[: (t1 - t0) * (v1 - v0)].view(t1 - t0, v1 - v0))  # [C, B]
                in_block, col = block_columns(ids[t0:t1], present[t0:t1], v0, v1 - v0)
                dx = mask_topk_(x, in_block, col).sub_(lt[t0:t1, None]).exp_().mul_(g_t[t0:t1, None])  # [C, B]
                dx.scatter_add_(1, col, torch.where(in_block, g_a[t0:t1], 0.0))
                if d_h is not None:
                    mm_into(d_h[t0:t1], dx, w_b, first=v0 == 0)
                if d_w is not None:
                    mm_into(d_w[v0:v1], dx.T, h_in, first=t0 == 0)
        if d_h is not None and ctx.inv_t != 1.0:
            d_h.mul_(ctx.inv_t)
        d_h = None if d_h is None else d_h.to(hidden.dtype)
        d_w = None if d_w is None else d_w.to(weight.dtype)
        return d_h, d_w, None, None, None, None, None


def head_topk_logits(
    hidden: Tensor, weight: Tensor, ids: Tensor, present: Tensor, mask: Tensor, temperature: float, blocks: HeadBlocks
) -> tuple[Tensor, Tensor]:
    """``(tail [N], picked [N, K])`` of ``x = (h / T) Wᵀ``: ``tail = log Σ_{v ∉ top-k} exp x_v`` and
    ``picked_k = x_{id_k}`` where ``present [N, K]`` (0 elsewhere), differentiable w.r.t. ``hidden [N, H]``
    and ``weight [V, H]``; ``ids [N, K]`` long, ``mask [N]`` bool (rows off it are computed as zeros).
    Memory: ``O(N·H + V·H + N·K)`` and one ``rows × cols`` block."""
    return _TopKHead.apply(hidden, weight, ids, present, mask, 1.0 / temperature, blocks)
