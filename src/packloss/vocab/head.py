"""The fused LM head: per-token log-probs and entropy straight from hidden states ``h [N, H]`` and the
output weight ``W [V, H]`` (:func:`linear_logprobs`), with an online log-sum-exp over vocabulary blocks,
so the ``N × V`` logits never exist; softcap, per-token temperature and vocab-parallel shards.
Formulas, the block buffer and the backward: ``docs/distill.md``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from packloss.core import checks
from packloss.core.dtypes import compute_dtype
from packloss.vocab.core import (
    HEAD_BLOCK,
    VocabParallel,
    check_parallel,
    check_positive_int,
    check_temperature,
    chunk_ranges,
    chunk_rows,
    gradient_buffer,
    mm_into,
)
from packloss.vocab.first_order import first_order

__all__ = ["linear_logprobs", "DEFAULT_VOCAB_CHUNK_SIZE", "check_head", "check_tokens"]

# Vocabulary rows per block when ``vocab_chunk_size`` is None, by device type: cache-sized on CPU
# (measured: the HEAD_BLOCK comment in vocab/core.py); wider elsewhere, where every block costs a few
# kernel launches that a larger matmul amortises.
DEFAULT_VOCAB_CHUNK_SIZE: dict[str, int] = {"cpu": 1024, "accelerator": 8192}


# ----------------------------------------------------------------------------------------------
# validation


def check_head(hidden: object, weight: object, prefix: str = "") -> None:
    """Raise a clear error unless ``hidden [N, H]`` and ``weight [V, H]`` are floating tensors on one
    device; errors name them ``{prefix}hidden`` / ``{prefix}weight`` (``"teacher_"`` for a teacher head)."""
    h_name, w_name = f"{prefix}hidden", f"{prefix}weight"
    if isinstance(weight, torch.nn.Module):
        raise TypeError(
            f"{w_name} must be a Tensor [V, H], got a Module; pass its .weight (bias-free output layers only)"
        )
    for name, t in ((h_name, hidden), (w_name, weight)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if hidden.shape[1] != weight.shape[1]:
        shapes = f"{tuple(hidden.shape)} vs {tuple(weight.shape)}"
        raise ValueError(f"{h_name} [N, H] and {w_name} [V, H] disagree on H: {shapes}")
    if weight.shape[0] == 0:
        raise ValueError(f"{w_name} must have V >= 1 vocabulary rows, got shape {tuple(weight.shape)}")
    checks.same_device(h_name, hidden.device, **{w_name: weight})


def check_tokens(name: str, t: object, n: int, kind: str, hidden: Tensor | None = None) -> None:
    """``t`` must be an ``[N]`` tensor of ``kind``: ``"integer"``, ``"floating"`` or ``"any"``, on the
    device of ``hidden`` when given."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != (n,):
        raise ValueError(f"{name} must have shape [N] = ({n},), got {tuple(t.shape)}")
    if hidden is not None:
        checks.same_device("hidden", hidden.device, **{name: t})
    if kind == "integer" and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if kind == "floating" and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")


def _inverse_temperature(temperature: float | Tensor, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``1 / T`` as a ``[N]`` tensor (temperature is a constant: it receives no gradient)."""
    if isinstance(temperature, Tensor):
        if temperature.dim() == 0:
            temperature = temperature.reshape(1).expand(n)
        check_tokens("temperature", temperature, n, "any")
        return 1.0 / temperature.detach().to(device=device, dtype=dtype)
    return torch.full((n,), 1.0 / check_temperature("temperature", temperature), device=device, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# block math (pure functions over one token chunk × vocab block)


def _chunk_input(h_c: Tensor, inv_t_c: Tensor, softcap: float | None) -> Tensor:
    """Without softcap the temperature folds into the hidden states: ``x = (h / T) Wᵀ``."""
    return h_c * inv_t_c[:, None] if softcap is None else h_c  # [C, H]


def _block_buffer(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Flat storage for one ``[rows, cols]`` block, reused by every block of a call: on CPU a fresh
    multi-MiB tensor per block is a fresh ``mmap`` whose page faults cost as much as the exp pass."""
    return torch.empty(rows * cols, dtype=dtype, device=device)


def _view(buf: Tensor, rows: int, cols: int) -> Tensor:
    """The first ``rows × cols`` elements of ``buf`` as a contiguous ``[rows, cols]`` block."""
    return buf[: rows * cols].view(rows, cols)


def _block_logits(
    h_in: Tensor, w_b: Tensor, inv_t_c: Tensor, softcap: float | None, out: Tensor
) -> tuple[Tensor, Tensor | None]:
    """``x = c·tanh(h Wᵀ / c) / T`` (or ``h Wᵀ`` with ``h`` pre-scaled) written into ``out [C, B]``;
    returns ``(x, tanh)``."""
    z = torch.mm(h_in, w_b.T, out=out)  # [C, B]
    if softcap is None:
        return z, None
    th = torch.tanh(z.div_(softcap))  # [C, B]
    return th * (softcap * inv_t_c)[:, None], th


def _z_grad(dx: Tensor, th: Tensor | None, inv_t_c: Tensor) -> Tensor:
    """``∂L/∂z = ∂L/∂x · (1 − tanh²) / T`` with softcap; ``∂L/∂x`` itself otherwise (pre-scaled h)."""
    if th is None:
        return dx  # [C, B]
    return dx.mul_(1.0 - th.square_()).mul_(inv_t_c[:, None])  # [C, B]


_Stats = tuple[Tensor, Tensor, Tensor | None]  # (m, s, b) per row, [C] each


def _block_stats(x: Tensor, scratch: Tensor | None) -> _Stats:
    """``m = max x``, ``s = Σ exp(x − m)``, ``b = Σ exp(x − m)(x − m)`` per row (``b`` when a
    ``scratch`` block of ``x``'s shape is given, for ``exp``). ``x`` is overwritten (with ``x − m``)."""
    m = x.amax(dim=1)  # [C]
    d = x.sub_(m[:, None])  # [C, B]
    if scratch is None:
        return m, d.exp_().sum(dim=1), None
    e = torch.exp(d, out=scratch)  # [C, B]
    return m, e.sum(dim=1), e.mul_(d).sum(dim=1)


def _merge_stats(m1: Tensor, s1: Tensor, b1: Tensor | None, m2: Tensor, s2: Tensor, b2: Tensor | None) -> _Stats:
    """Combine two online log-sum-exp states: with ``m = max(m1, m2)``, ``a_k = exp(m_k − m)``,
    ``s = a1 s1 + a2 s2`` and ``b = a1 (b1 + (m1 − m) s1) + a2 (b2 + (m2 − m) s2)``."""
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    s = a1 * s1 + a2 * s2
    if b1 is None or b2 is None:
        return m, s, None
    return m, s, a1 * (b1 + (m1 - m) * s1) + a2 * (b2 + (m2 - m) * s2)


def _label_index(labels_c: Tensor, v0: int | Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Branch-free label lookup in the block ``[v0, v0 + width)``: ``(in_block [C], column [C, 1])``."""
    local = labels_c - v0  # [C]
    in_block = (local >= 0) & (local < width)  # [C]
    return in_block, local.clamp(0, width - 1)[:, None]


def _group_stats(
    m: Tensor, s: Tensor, b: Tensor | None, label: Tensor, group: object
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """Combine per-rank ``(m, s, b)`` and the label logit over ``group``: MAX of ``m``, then one SUM of
    the rescaled ``s``, ``b`` and the label logit (zero on the ranks that do not own the label)."""
    m_g = m.clone()
    dist.all_reduce(m_g, op=dist.ReduceOp.MAX, group=group)
    a = torch.exp(m - m_g)  # [N]
    parts = [a * s, label] + ([] if b is None else [a * (b + (m - m_g) * s)])
    stacked = torch.stack(parts)  # [2 or 3, N]
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
    return m_g, stacked[0], (None if b is None else stacked[2]), stacked[1]


def _check_label_range(
    labels: Tensor, ignore_index: int, v_local: int, start: int | Tensor, group: object | None
) -> None:
    """``ValueError`` naming ``labels`` unless every label but ``ignore_index`` is in ``[0, V)`` (with
    ``group``: owned by exactly one vocabulary shard). One host sync (and a SUM all-reduce of ``[N]``)."""
    if labels.numel() == 0:
        return
    labels = labels.to(torch.int64)  # [N]
    valid = labels != ignore_index  # [N]
    owned = (valid & (labels >= start) & (labels < start + v_local)).to(torch.int32)  # [N]
    if group is not None:
        dist.all_reduce(owned, op=dist.ReduceOp.SUM, group=group)
    bad = valid & (owned != 1)  # [N]
    big = torch.iinfo(torch.int64)
    lo, hi = torch.where(bad, labels, big.max).amin(), torch.where(bad, labels, big.min).amax()
    count, lo, hi = torch.stack([bad.sum(), lo, hi]).tolist()  # sync-ok: the opt-in check_labels read
    if count:
        where = f"[0, {v_local})" if group is None else "exactly one vocabulary shard"
        msg = f"labels must be in {where} or equal ignore_index={ignore_index}; {count} are not, in [{lo}, {hi}]"
        raise ValueError(msg)


# ----------------------------------------------------------------------------------------------
# linear_logprobs


@dataclass(frozen=True)
class _Config:
    chunk_size: int  # C, token rows per chunk
    vocab_chunk_size: int  # B, vocabulary rows per block
    softcap: float | None
    entropy: bool  # compute the entropy
    entropy_grad: bool
    ignore_index: int
    group: object | None  # vocab-parallel process group
    vocab_start: int | Tensor  # global id of weight's first row (0-d int64 when read by an all-reduce)


def _logprobs_forward(
    hidden: Tensor, weight: Tensor, labels: Tensor, inv_t: Tensor, cfg: _Config
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Return ``(logZ [N], label logit [N], entropy [N] | None)`` (label logit 0 when not owned)."""
    cdt = inv_t.dtype
    if hidden.shape[0] == 0:  # N = 0: empty outputs (torch.cat needs at least one chunk)
        empty = inv_t.new_zeros(0)  # [0]
        return empty, empty, (empty if cfg.entropy else None)
    ms, ss, bs, labs = [], [], [], []
    rows, cols = min(cfg.chunk_size, hidden.shape[0]), min(cfg.vocab_chunk_size, weight.shape[0])
    buf = _block_buffer(rows, cols, cdt, hidden.device)
    scratch = _block_buffer(rows, cols, cdt, hidden.device) if cfg.entropy else None
    for t0, t1 in chunk_ranges(hidden.shape[0], cfg.chunk_size):
        h_in = _chunk_input(hidden[t0:t1].to(cdt), inv_t[t0:t1], cfg.softcap)  # [C, H]
        state = None
        lab = torch.zeros(t1 - t0, dtype=cdt, device=hidden.device)  # [C]
        for v0, v1 in chunk_ranges(weight.shape[0], cfg.vocab_chunk_size):
            out = _view(buf, t1 - t0, v1 - v0)  # [C, B]
            x, _ = _block_logits(h_in, weight[v0:v1].to(cdt), inv_t[t0:t1], cfg.softcap, out)  # [C, B]
            in_block, col = _label_index(labels[t0:t1], cfg.vocab_start + v0, v1 - v0)
            lab = lab + torch.where(in_block, x.gather(1, col).squeeze(1), 0.0)
            stats = _block_stats(x, None if scratch is None else _view(scratch, t1 - t0, v1 - v0))
            state = stats if state is None else _merge_stats(*state, *stats)
        for acc, x in zip((ms, ss, bs, labs), (*state, lab), strict=True):
            acc.append(x)
    m, s, lab = torch.cat(ms), torch.cat(ss), torch.cat(labs)  # [N]
    b = torch.cat(bs) if cfg.entropy else None
    if cfg.group is not None:
        m, s, b, lab = _group_stats(m, s, b, lab, cfg.group)
    log_s = torch.log(s)
    entropy = None if b is None else log_s - b / s
    return m + log_s, lab, entropy


def _logprobs_backward(
    saved: tuple[Tensor, ...], g_lp: Tensor, g_ent: Tensor | None, cfg: _Config, need_h: bool, need_w: bool
) -> tuple[Tensor | None, Tensor | None]:
    """Recompute each block's logits and apply ``∂logprob/∂x_v = 1[v = y] − p_v``,
    ``∂entropy/∂x_v = −p_v (log p_v + entropy)`` and ``∂x/∂z = (1 − tanh²(z/c)) / T`` (softcap) or
    ``1 / T``: ``∂x = g_lp (1[v = y] − p) − g_ent p (log p + entropy)``, ``log p = x − logZ``, chained to
    ``d_hidden += dz @ W_block`` and ``d_weight[block] += dzᵀ @ h`` (``g_lp`` zero for ignored labels).

    Rows whose incoming gradients are all zero (ignored labels, entropy unused) contribute exactly 0:
    their hidden state, ``1 / T``, ``logZ`` and entropy are replaced by finite constants first, so NaN or
    inf there never reaches ``d_weight`` or the other rows (``0 · NaN``)."""
    hidden, weight, labels, inv_t, log_z, entropy = saved
    cdt = inv_t.dtype
    n = hidden.shape[0]
    d_h = gradient_buffer(hidden.shape, n, cdt, hidden.device) if need_h else None  # [N, H]
    d_w = gradient_buffer(weight.shape, n, cdt, weight.device) if need_w else None  # [V, H]
    rows, cols = min(cfg.chunk_size, hidden.shape[0]), min(cfg.vocab_chunk_size, weight.shape[0])
    buf = _block_buffer(rows, cols, cdt, hidden.device)
    scratch = None if g_ent is None else _block_buffer(rows, cols, cdt, hidden.device)
    for t0, t1 in chunk_ranges(hidden.shape[0], cfg.chunk_size):
        g = g_lp[t0:t1]  # [C]
        live = g != 0 if g_ent is None else (g != 0) | (g_ent[t0:t1] != 0)  # [C]
        inv_t_c = torch.where(live, inv_t[t0:t1], 1.0)  # [C]
        h_c = hidden[t0:t1].to(cdt).masked_fill(~live[:, None], 0.0)  # [C, H], a copy: dead rows 0
        h_in = _chunk_input(h_c, inv_t_c, cfg.softcap)  # [C, H]
        lz = torch.where(live, log_z[t0:t1], 0.0)[:, None]  # [C, 1]
        if g_ent is not None:
            ge, ent_c = g_ent[t0:t1, None], torch.where(live, entropy[t0:t1], 0.0)[:, None]  # [C, 1]
        for v0, v1 in chunk_ranges(weight.shape[0], cfg.vocab_chunk_size):
            w_b = weight[v0:v1].to(cdt)  # [B, H]
            x, th = _block_logits(h_in, w_b, inv_t_c, cfg.softcap, _view(buf, t1 - t0, v1 - v0))  # [C, B]
            log_p = x.sub_(lz)  # [C, B]
            if scratch is None:
                dx = log_p.exp_().mul_(-g[:, None])  # [C, B]
            else:
                p = torch.exp(log_p, out=_view(scratch, t1 - t0, v1 - v0))  # [C, B]
                dx = p.mul_(log_p.add_(ent_c).mul_(ge).add_(g[:, None])).neg_()  # [C, B]
            in_block, col = _label_index(labels[t0:t1], cfg.vocab_start + v0, v1 - v0)
            dx.scatter_add_(1, col, torch.where(in_block, g, 0.0)[:, None])
            dz = _z_grad(dx, th, inv_t_c)  # [C, B]
            if d_h is not None:
                mm_into(d_h[t0:t1], dz, w_b, first=v0 == 0)
            if d_w is not None:
                mm_into(d_w[v0:v1], dz.T, h_in, first=t0 == 0)
        if d_h is not None and cfg.softcap is None:
            d_h[t0:t1].mul_(inv_t_c[:, None])
    if d_h is not None and cfg.group is not None:
        dist.all_reduce(d_h, op=dist.ReduceOp.SUM, group=cfg.group)
    return d_h, d_w


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_t, cfg: _Config):
        log_z, lab, entropy = _logprobs_forward(hidden, weight, labels, inv_t, cfg)
        valid = labels != cfg.ignore_index  # [N]
        logprobs = torch.where(valid, lab - log_z, 0.0)  # [N]
        ent = entropy if entropy is not None else log_z.new_zeros(0)
        ctx.save_for_backward(hidden, weight, labels, inv_t, log_z, entropy, valid)
        ctx.cfg = cfg
        if not cfg.entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logprobs, ent

    @staticmethod
    @first_order("linear_logprobs")
    def backward(ctx, g_lp, g_ent):
        *saved, valid = ctx.saved_tensors
        hidden, weight, cfg = saved[0], saved[1], ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return None, None, None, None, None
        g = torch.where(valid, g_lp, 0.0) if g_lp is not None else torch.zeros_like(saved[4])
        g_e = g_ent if cfg.entropy_grad else None
        d_h, d_w = _logprobs_backward(tuple(saved), g, g_e, cfg, need_h, need_w)
        d_h, d_w = (None if d is None else d.to(x.dtype) for d, x in ((d_h, hidden), (d_w, weight)))
        return d_h, d_w, None, None, None


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float | Tensor = 1.0,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    return_entropy: bool = True,
    entropy_grad: bool = False,
    softcap: float | None = None,
    ignore_index: int = -100,
    parallel: VocabParallel | None = None,
    check_labels: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs of ``labels`` (and entropy) under ``softmax(softcap(h Wᵀ) / T)``, fused.

    Args:
        hidden: ``[N, H]`` hidden states (any floating dtype).
        weight: ``[V, H]`` output weight (bias-free; with ``parallel``, this rank's vocab shard).
        labels: ``[N]`` integer global token ids; ``ignore_index`` marks positions without a label.
        temperature: a positive float or a ``[N]`` tensor of per-token temperatures (no gradient).
        chunk_size, vocab_chunk_size: the token × vocab block ``C × B``; at most a few float32 blocks
            are alive at a time, each reused for every block. Default ``B``: 1024 on CPU, 8192 on an
            accelerator (``DEFAULT_VOCAB_CHUNK_SIZE``); default ``C``:
            ``chunk_rows(B, budget=HEAD_BLOCK)``, ``threads · 2**19 // B`` on CPU, ``2**26 // B`` on CUDA.
        return_entropy: compute ``entropy = −Σ p log p`` as well.
        entropy_grad: make the entropy differentiable (``∂H/∂x = −p (log p + H)``); otherwise it is
            returned detached.
        softcap: ``c`` of ``l = c·tanh(z / c)``, applied to the raw logits before the temperature.
        ignore_index: label value whose log-prob is 0 and receives no gradient. The entropy does not
            depend on the label, so it is computed at every position (mask it yourself); with
            ``entropy_grad`` its gradient flows wherever the caller's loss uses it. Rows that get no
            gradient (ignored, entropy unused) may hold NaN / inf hidden states: their outputs are
            then NaN, but no gradient is touched. Select the entropy of valid rows with ``torch.where``,
            not by multiplying with a mask (``NaN · 0 = NaN`` in the loss itself).
        parallel: :class:`~packloss.vocab.core.VocabParallel` for a vocab-parallel ``weight`` (see
            the module doc); its ``vocab_start`` places the labels (default: from the shard sizes,
            uneven shards included).
        check_labels: raise ``ValueError`` for labels outside ``[0, V)`` other than ``ignore_index``
            (with ``parallel``: not owned by exactly one shard). Off by default: the check costs one host
            sync (and an all-reduce of ``[N]``); unchecked, such a label silently gets ``−logZ``.

    Returns:
        ``(logprobs [N], entropy [N] | None)`` in float32 (float64 for float64 inputs); empty for
        ``N = 0``. First-order only: differentiating the gradient again raises ``RuntimeError``.
    """
    check_head(hidden, weight)
    n, v_local = hidden.shape[0], weight.shape[0]
    check_tokens("labels", labels, n, "integer", hidden)
    labels = labels if labels.dtype in (torch.int32, torch.int64) else labels.long()  # gather takes these two
    if vocab_chunk_size is None:
        vocab_chunk_size = DEFAULT_VOCAB_CHUNK_SIZE["cpu" if hidden.device.type == "cpu" else "accelerator"]
    check_positive_int("vocab_chunk_size", vocab_chunk_size)
    rows = chunk_rows(min(vocab_chunk_size, v_local), hidden.device, chunk_size, budget=HEAD_BLOCK)
    if softcap is not None and not 0 < softcap < math.inf:
        raise ValueError(f"softcap must be a positive finite float or None, got {softcap!r}")
    if entropy_grad and not return_entropy:
        raise ValueError("entropy_grad=True needs return_entropy=True")
    parallel = check_parallel(parallel)
    cdt = compute_dtype(hidden.dtype, weight.dtype)
    cfg = _Config(
        chunk_size=rows,
        vocab_chunk_size=vocab_chunk_size,
        softcap=None if softcap is None else float(softcap),
        entropy=return_entropy,
        entropy_grad=entropy_grad,
        ignore_index=ignore_index,
        group=None if parallel is None else parallel.group,
        vocab_start=0 if parallel is None else parallel.start(v_local, hidden.device),
    )
    if check_labels:
        _check_label_range(labels, ignore_index, v_local, cfg.vocab_start, cfg.group)
    inv_t = _inverse_temperature(temperature, n, cdt, hidden.device)
    logprobs, entropy = _LinearLogprobs.apply(hidden, weight, labels, inv_t, cfg)
    return logprobs, (entropy if return_entropy else None)
