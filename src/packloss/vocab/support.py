"""Log-probs against what the sampler kept: :func:`support_logprobs` renormalises the trainer's
distribution over each position's truncated support (the token set vLLM / sglang return after
top-k / top-p, as CSR ``(token_ids, offsets)`` or as ``[N, K]`` ids), from the support rows of the LM
head only; :func:`logprobs_at` gives the full-vocabulary log-probs at ``K`` given ids per position, from
the fused pass of :mod:`packloss.vocab.head`. Neither builds an ``N × V`` tensor, neither reads a device
value on the host (unless ``check_support``). Formulas and memory: ``docs/distill.md``, "Sampler support"."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from packloss.core import checks
from packloss.core.dtypes import compute_dtype
from packloss.vocab.core import HEAD_BLOCK, check_positive_int, chunk_ranges, chunk_rows, gradient_buffer, mm_into
from packloss.vocab.first_order import first_order
from packloss.vocab.head import (
    DEFAULT_VOCAB_CHUNK_SIZE,
    _block_buffer,
    _block_logits,
    _chunk_input,
    _inverse_temperature,
    _view,
    _z_grad,
    check_head,
    check_tokens,
)

__all__ = ["support_logprobs", "logprobs_at"]

_NEG_INF = -math.inf


# ----------------------------------------------------------------------------------------------
# validation


def _check_softcap(softcap: object) -> float | None:
    if softcap is None:
        return None
    if not 0 < checks.number("softcap", softcap, finite=False) < math.inf:
        raise ValueError(f"softcap must be a positive finite float or None, got {softcap!r}")
    return float(softcap)


def _check_ids(name: str, t: object, hidden: Tensor, dim: int) -> Tensor:
    """``t`` as an int64 tensor of ``dim`` dimensions on the device of ``hidden``."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    checks.same_device("hidden", hidden.device, **{name: t})
    return t.long()


def _flat_support(token_ids: Tensor, offsets: Tensor | None, n: int, v: int) -> tuple[Tensor, Tensor, Tensor]:
    """Every support entry as ``(id [nnz], position [nnz], present [nnz])``: present means an id in
    ``[0, V)``; absent ids are replaced by 0 (a harmless row to gather). Positions come from
    ``searchsorted`` over ``offsets`` (sync-free; clamped, so malformed offsets never index out of range)."""
    if offsets is None:
        k = token_ids.shape[1]
        ids = token_ids.reshape(-1)  # [N·K]
        pos = torch.arange(n, device=ids.device).repeat_interleave(k, output_size=n * k)  # [N·K]
    else:
        ids = token_ids  # [nnz]
        entries = torch.arange(ids.shape[0], device=ids.device)  # [nnz]
        pos = torch.searchsorted(offsets[1:], entries, right=True).clamp_max_(max(n - 1, 0))  # [nnz]
    present = (ids >= 0) & (ids < v)  # [nnz]
    return torch.where(present, ids, 0), pos, present


def _check_support(
    labels: Tensor, token_ids: Tensor, offsets: Tensor | None, v: int, ignore_index: int, flat: tuple[Tensor, ...]
) -> None:
    """``ValueError`` for malformed offsets, ids outside ``[−1, V)``, an id twice in one position, or a
    label (other than ``ignore_index``) outside its position's support. One host sync."""
    ids, pos, present = flat
    raw = token_ids.reshape(-1)  # [nnz]
    nnz = raw.shape[0]
    if offsets is None:
        bad_offsets = raw.new_zeros(())
    else:
        steps = (offsets[1:] < offsets[:-1]).sum()
        bad_offsets = steps + (offsets[0] != 0).long() + (offsets[-1] != nnz).long()
    bad_ids = ((raw < -1) | (raw >= v)).sum()
    # entries sorted by (position, id); an absent entry gets a key of its own below every real one
    key = torch.where(present, pos * (v + 1) + ids, -1 - torch.arange(nnz, device=raw.device))  # [nnz]
    ordered = key.sort().values  # [nnz]
    twice = (ordered[1:] == ordered[:-1]).sum()
    hit = present & (ids == labels[pos])  # [nnz]
    found = torch.zeros_like(labels).index_add_(0, pos, hit.long())  # [N]
    missing = ((labels != ignore_index) & (found == 0)).sum()
    counts = torch.stack([bad_offsets, bad_ids, twice, missing]).tolist()  # sync-ok: the opt-in check_support read
    problems = [
        f"offsets must start at 0, never decrease and end at nnz = {nnz}" if counts[0] else "",
        f"token_ids must be in [-1, V) = [-1, {v}); {counts[1]} are not" if counts[1] else "",
        f"token_ids must be distinct within a position; {counts[2]} repeat" if counts[2] else "",
        f"labels must be in their position's support or equal ignore_index={ignore_index}; {counts[3]} are not"
        if counts[3]
        else "",
    ]
    if any(problems):
        raise ValueError("; ".join(p for p in problems if p))


# ----------------------------------------------------------------------------------------------
# support_logprobs


@dataclass(frozen=True)
class _SupportConfig:
    chunk_size: int  # E, support entries per gathered [E, H] block
    softcap: float | None
    entropy: bool
    ignore_index: int


def _support_logits(
    hidden: Tensor, weight: Tensor, ids: Tensor, pos: Tensor, present: Tensor, inv_t: Tensor, cfg: _SupportConfig
) -> tuple[Tensor, Tensor | None]:
    """``x_j = c·tanh(h_{pos_j} · W_{id_j} / c) / T_{pos_j}`` (``−inf`` at absent entries) ``[nnz]``,
    and ``tanh(z / c)`` ``[nnz]`` with softcap; ``E`` entries' rows of ``h`` and ``W`` at a time."""
    cdt = inv_t.dtype
    z = torch.empty(ids.shape[0], dtype=cdt, device=hidden.device)  # [nnz]
    for e0, e1 in chunk_ranges(ids.shape[0], cfg.chunk_size):
        w_c = weight.index_select(0, ids[e0:e1]).to(cdt)  # [E, H]
        h_c = hidden.index_select(0, pos[e0:e1]).to(cdt)  # [E, H]
        torch.linalg.vecdot(h_c, w_c, out=z[e0:e1])
    th = None
    if cfg.softcap is not None:
        th = torch.tanh(z / cfg.softcap)  # [nnz]
        z = th * cfg.softcap
    return torch.where(present, z * inv_t[pos], _NEG_INF), th


def _segment_logsumexp(x: Tensor, pos: Tensor, present: Tensor, n: int, entropy: bool) -> tuple[Tensor, Tensor | None]:
    """Per position ``logZ = m + log Σ exp(x − m)`` with ``m`` the segment max, and the entropy
    ``log s − b / s`` with ``s = Σ exp(x − m)``, ``b = Σ exp(x − m)(x − m)``; an empty support has
    ``logZ = −inf`` and entropy 0."""
    m = x.new_full((n,), _NEG_INF).scatter_reduce_(0, pos, x, "amax", include_self=True)  # [N]
    m = torch.where(m > _NEG_INF, m, 0.0)  # an empty support: exp(−inf − 0) = 0, never −inf − (−inf)
    d = x - m[pos]  # [nnz], −inf at absent entries
    e = torch.exp(d)  # [nnz]
    s = x.new_zeros(n).index_add_(0, pos, e)  # [N]
    log_z = m + torch.log(s)  # [N]
    if not entropy:
        return log_z, None
    b = x.new_zeros(n).index_add_(0, pos, torch.where(present, e * d, 0.0))  # [N]
    return log_z, torch.where(s > 0, torch.log(s) - b / s, 0.0)


def _support_backward(
    saved: tuple[Tensor, ...], g: Tensor, g_ent: Tensor | None, cfg: _SupportConfig, need_h: bool, need_w: bool
) -> tuple[Tensor | None, Tensor | None]:
    """``∂x_j = g_t (1[j = y_t] − p_j) − g_ent_t p_j (log p_j + entropy_t)`` with ``log p_j = x_j − logZ_t``
    over the support (``t = pos_j``), ``∂z_j = ∂x_j (1 − tanh²) / T_t`` (or ``∂x_j / T_t``), then
    ``d_hidden[t] += ∂z_j W_{id_j}`` and ``d_weight[id_j] += ∂z_j h_t`` by ``index_add_``, ``E`` entries at
    a time. Positions whose incoming gradients are all zero contribute exactly 0 whatever they hold."""
    hidden, weight, ids, pos, present, is_label, x, th, inv_t, log_z, entropy = saved
    cdt = inv_t.dtype
    live = g != 0 if g_ent is None else (g != 0) | (g_ent != 0)  # [N]
    live_e = live[pos] & present  # [nnz]
    log_p = x - torch.where(live, log_z, 0.0)[pos]  # [nnz]
    p = torch.exp(log_p)  # [nnz]
    g_e = g[pos]  # [nnz]
    if g_ent is None:
        dx = -p * g_e
    else:
        dx = -p * (g_e + g_ent[pos] * (log_p + torch.where(live, entropy, 0.0)[pos]))  # [nnz]
    dx = dx + torch.where(is_label, g_e, 0.0)
    dz = dx * inv_t[pos] if th is None else dx * (1.0 - th.square()) * inv_t[pos]  # [nnz]
    dz = torch.where(live_e, dz, 0.0)  # NaN / inf of dead positions and absent entries never spread
    d_h = torch.zeros(hidden.shape, dtype=cdt, device=hidden.device) if need_h else None  # [N, H]
    d_w = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_w else None  # [V, H]
    h_live = torch.where(live[:, None], hidden, 0.0) if need_w else None  # [N, H]
    for e0, e1 in chunk_ranges(ids.shape[0], cfg.chunk_size):
        dz_c = dz[e0:e1, None]  # [E, 1]
        if d_h is not None:
            d_h.index_add_(0, pos[e0:e1], weight.index_select(0, ids[e0:e1]).to(cdt).mul_(dz_c))  # [E, H]
        if d_w is not None:
            d_w.index_add_(0, ids[e0:e1], h_live.index_select(0, pos[e0:e1]).to(cdt).mul_(dz_c))  # [E, H]
    return d_h, d_w


class _SupportLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ids, pos, present, inv_t, cfg: _SupportConfig):
        n = hidden.shape[0]
        x, th = _support_logits(hidden, weight, ids, pos, present, inv_t, cfg)  # [nnz]
        log_z, entropy = _segment_logsumexp(x, pos, present, n, cfg.entropy)  # [N]
        is_label = present & (ids == labels[pos])  # [nnz]
        lab = x.new_zeros(n).index_add_(0, pos, torch.where(is_label, x, 0.0))  # [N]
        found = x.new_zeros(n).index_add_(0, pos, is_label.to(x.dtype)) > 0  # [N]
        valid = labels != cfg.ignore_index  # [N]
        logprobs = torch.where(valid, torch.where(found, lab - log_z, _NEG_INF), 0.0)  # [N]
        ent = x.new_zeros(0) if entropy is None else torch.where(valid, entropy, 0.0)  # [N]
        ctx.save_for_backward(hidden, weight, ids, pos, present, is_label, x, th, inv_t, log_z, entropy, valid, found)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)
        if entropy is None:
            ctx.mark_non_differentiable(ent)
        return logprobs, ent

    @staticmethod
    @first_order("support_logprobs")
    def backward(ctx, g_lp, g_ent):
        *saved, valid, found = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        none = (None,) * 6
        if not (need_h or need_w) or (g_lp is None and g_ent is None):
            return None, None, *none
        g = torch.zeros_like(saved[9]) if g_lp is None else torch.where(valid & found, g_lp, 0.0)  # [N]
        g_e = None if g_ent is None or not ctx.cfg.entropy else torch.where(valid, g_ent, 0.0)  # [N]
        d_h, d_w = _support_backward(tuple(saved), g, g_e, ctx.cfg, need_h, need_w)
        hidden, weight = saved[0], saved[1]
        return (None if d_h is None else d_h.to(hidden.dtype)), (None if d_w is None else d_w.to(weight.dtype)), *none


def support_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    token_ids: Tensor,
    offsets: Tensor | None = None,
    *,
    temperature: float | Tensor = 1.0,
    softcap: float | None = None,
    return_entropy: bool = True,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    check_support: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs of ``labels`` renormalised over the sampler's support, and its entropy.

    With ``z = softcap(h Wᵀ)`` (``c·tanh(z / c)``, or ``z``) and ``S_t`` the support of position ``t``,
    temperature applied before truncation as the samplers do::

        logprob_t = z_{t,y}/T_t − logsumexp_{v∈S_t} z_{t,v}/T_t
        entropy_t = −Σ_{v∈S_t} p_{t,v} log p_{t,v},   p_{t,v} = softmax over S_t of z_{t,v}/T_t

    Args:
        hidden: ``[N, H]`` hidden states; ``weight``: ``[V, H]`` output weight (bias-free).
        labels: ``[N]`` integer token ids; ``ignore_index`` marks positions without a label.
        token_ids, offsets: the supports, CSR: ``token_ids [nnz]`` and ``offsets [N+1]`` (position
            ``t`` keeps ``token_ids[offsets[t]:offsets[t+1]]``); or top-k: ``token_ids [N, K]`` with
            ``offsets=None``. Ids outside ``[0, V)`` (−1, the pad) are absent, so a support may be
            smaller than ``K`` or empty. The ids of one position must be distinct (a repeated id
            counts twice).
        temperature: a positive float or a ``[N]`` tensor of per-token temperatures (no gradient).
        softcap: ``c`` of ``c·tanh(z / c)``, applied to the raw logits before the temperature.
        return_entropy: compute the entropy over the support (differentiable).
        ignore_index: positions whose log-prob and entropy are 0 and receive no gradient; their
            hidden states and supports may hold anything (NaN, an empty support).
        chunk_size: ``E``, support entries whose ``h`` and ``W`` rows are gathered at a time (``[E, H]``
            blocks); default ``chunk_rows(H, budget=HEAD_BLOCK)``.
        check_support: raise ``ValueError`` for malformed offsets, ids outside ``[−1, V)``, an id twice
            in a position, or a label outside its support (one host sync). Unchecked, a label outside
            its support gets log-prob ``−inf`` and no gradient from it (the entropy is unaffected).

    Returns:
        ``(logprobs [N], entropy [N] | None)`` in float32 (float64 for float64 inputs). A support equal
        to the whole vocabulary gives :func:`~packloss.vocab.head.linear_logprobs`. Memory beyond the
        inputs: ``O(N·H + V·H + nnz + E·H)``; first-order only.
    """
    check_head(hidden, weight)
    n, v = hidden.shape[0], weight.shape[0]
    check_tokens("labels", labels, n, "integer", hidden)
    if offsets is None:
        token_ids = _check_ids("token_ids", token_ids, hidden, 2)
        if token_ids.shape[0] != n:
            raise ValueError(f"token_ids [N, K] must have N = {n} rows, got shape {tuple(token_ids.shape)}")
    else:
        token_ids, offsets = _check_ids("token_ids", token_ids, hidden, 1), _check_ids("offsets", offsets, hidden, 1)
        if offsets.shape[0] != n + 1:
            raise ValueError(f"offsets must have shape [N + 1] = ({n + 1},), got {tuple(offsets.shape)}")
        if n == 0 and token_ids.shape[0]:
            raise ValueError(f"token_ids must be empty for N = 0, got {token_ids.shape[0]} entries")
    cfg = _SupportConfig(
        chunk_size=chunk_rows(hidden.shape[1], hidden.device, chunk_size, budget=HEAD_BLOCK),
        softcap=_check_softcap(softcap),
        entropy=checks.flag("return_entropy", return_entropy),
        ignore_index=ignore_index,
    )
    labels = labels.long()
    flat = _flat_support(token_ids, offsets, n, v)
    if checks.flag("check_support", check_support):
        _check_support(labels, token_ids, offsets, v, ignore_index, flat)
    inv_t = _inverse_temperature(temperature, n, compute_dtype(hidden.dtype, weight.dtype), hidden.device)
    logprobs, entropy = _SupportLogprobs.apply(hidden, weight, labels, *flat, inv_t, cfg)
    return logprobs, (entropy if return_entropy else None)


# ----------------------------------------------------------------------------------------------
# logprobs_at


@dataclass(frozen=True)
class _AtConfig:
    chunk_size: int  # C, token rows per chunk
    vocab_chunk_size: int  # B, vocabulary rows per block
    softcap: float | None


def _columns(ids_c: Tensor, v0: int, width: int) -> tuple[Tensor, Tensor]:
    """Branch-free lookup of ``ids_c [C, K]`` in the block ``[v0, v0 + width)``: ``(in_block, column)``."""
    local = ids_c - v0  # [C, K]
    return (local >= 0) & (local < width), local.clamp(0, width - 1)


def _at_forward(hidden: Tensor, weight: Tensor, ids: Tensor, inv_t: Tensor, cfg: _AtConfig) -> tuple[Tensor, Tensor]:
    """``(logZ [N], x at the ids [N, K])`` (0 at absent ids), walking ``C × B`` blocks with an online
    log-sum-exp over the vocabulary blocks."""
    cdt = inv_t.dtype
    n, k = ids.shape
    log_z = torch.empty(n, dtype=cdt, device=hidden.device)  # [N]
    picked = torch.zeros(n, k, dtype=cdt, device=hidden.device)  # [N, K]
    buf = _block_buffer(min(cfg.chunk_size, n), min(cfg.vocab_chunk_size, weight.shape[0]), cdt, hidden.device)
    for t0, t1 in chunk_ranges(n, cfg.chunk_size):
        inv_t_c = inv_t[t0:t1]  # [C]
        h_in = _chunk_input(hidden[t0:t1].to(cdt), inv_t_c, cfg.softcap)  # [C, H]
        lz = torch.full((t1 - t0,), _NEG_INF, dtype=cdt, device=hidden.device)  # [C]
        for v0, v1 in chunk_ranges(weight.shape[0], cfg.vocab_chunk_size):
            x, _ = _block_logits(h_in, weight[v0:v1].to(cdt), inv_t_c, cfg.softcap, _view(buf, t1 - t0, v1 - v0))
            in_block, col = _columns(ids[t0:t1], v0, v1 - v0)  # [C, K]
            picked[t0:t1] += torch.where(in_block, x.gather(1, col), 0.0)
            lz = torch.logaddexp(lz, torch.logsumexp(x, dim=1))
        log_z[t0:t1] = lz
    return log_z, picked


def _at_backward(
    hidden: Tensor, weight: Tensor, ids: Tensor, inv_t: Tensor, log_z: Tensor, g: Tensor, cfg: _AtConfig,
    need_h: bool, need_w: bool,
) -> tuple[Tensor | None, Tensor | None]:  # fmt: skip
    """``∂x_{t,v} = Σ_k g_{t,k} 1[v = id_{t,k}] − G_t p_{t,v}`` with ``G_t = Σ_k g_{t,k}``, chained
    through the softcap and temperature to ``d_hidden += dz @ W_block``, ``d_weight[block] += dzᵀ @ h``
    (``g`` zero at absent ids; rows with no gradient contribute exactly 0 whatever they hold)."""
    cdt = inv_t.dtype
    n = hidden.shape[0]
    d_h = gradient_buffer(hidden.shape, n, cdt, hidden.device) if need_h else None  # [N, H]
    d_w = gradient_buffer(weight.shape, n, cdt, weight.device) if need_w else None  # [V, H]
    total = g.sum(dim=1)  # [N]
    live = (g != 0).any(dim=1)  # [N]
    buf = _block_buffer(min(cfg.chunk_size, n), min(cfg.vocab_chunk_size, weight.shape[0]), cdt, hidden.device)
    for t0, t1 in chunk_ranges(n, cfg.chunk_size):
        live_c = live[t0:t1]  # [C]
        inv_t_c = torch.where(live_c, inv_t[t0:t1], 1.0)  # [C]
        h_in = _chunk_input(hidden[t0:t1].to(cdt).masked_fill(~live_c[:, None], 0.0), inv_t_c, cfg.softcap)
        lz = torch.where(live_c, log_z[t0:t1], 0.0)[:, None]  # [C, 1]
        for v0, v1 in chunk_ranges(weight.shape[0], cfg.vocab_chunk_size):
            w_b = weight[v0:v1].to(cdt)  # [B, H]
            x, th = _block_logits(h_in, w_b, inv_t_c, cfg.softcap, _view(buf, t1 - t0, v1 - v0))  # [C, B]
            dx = x.sub_(lz).exp_().mul_(-total[t0:t1, None])  # [C, B]
            in_block, col = _columns(ids[t0:t1], v0, v1 - v0)  # [C, K]
            dx.scatter_add_(1, col, torch.where(in_block, g[t0:t1], 0.0))
            dz = _z_grad(dx, th, inv_t_c)  # [C, B]
            if d_h is not None:
                mm_into(d_h[t0:t1], dz, w_b, first=v0 == 0)
            if d_w is not None:
                mm_into(d_w[v0:v1], dz.T, h_in, first=t0 == 0)
        if d_h is not None and cfg.softcap is None:
            d_h[t0:t1].mul_(inv_t_c[:, None])
    return d_h, d_w


class _LogprobsAt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, inv_t, cfg: _AtConfig):
        log_z, picked = _at_forward(hidden, weight, ids, inv_t, cfg)
        present = (ids >= 0) & (ids < weight.shape[0])  # [N, K]
        ctx.save_for_backward(hidden, weight, ids, inv_t, log_z, present)
        ctx.cfg = cfg
        return torch.where(present, picked - log_z[:, None], 0.0)  # [N, K]

    @staticmethod
    @first_order("logprobs_at")
    def backward(ctx, g_out):
        hidden, weight, ids, inv_t, log_z, present = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return None, None, None, None, None
        g = torch.where(present, g_out, 0.0)  # [N, K]
        d_h, d_w = _at_backward(hidden, weight, ids, inv_t, log_z, g, ctx.cfg, need_h, need_w)
        d_h, d_w = (None if d is None else d.to(x.dtype) for d, x in ((d_h, hidden), (d_w, weight)))
        return d_h, d_w, None, None, None


def logprobs_at(
    hidden: Tensor,
    weight: Tensor,
    token_ids: Tensor,
    *,
    temperature: float | Tensor = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
) -> Tensor:
    """The full-vocabulary log-probs of ``K`` given ids per position (e.g. the sampler's top-k), fused::

        out_{t,k} = x_{t, id_{t,k}} − logZ_t,   x = softcap(h Wᵀ) / T,   logZ_t = logsumexp_v x_{t,v}

    ``logZ`` is an online log-sum-exp over vocabulary blocks and the ``K`` logits are gathered from the
    same blocks, as :func:`~packloss.vocab.head.linear_logprobs` does for one label, so no ``N × V``
    tensor exists. Ids outside ``[0, V)`` (−1, the pad) give 0 and receive no gradient; a repeated id
    gives the same value twice and its gradients add.

    Args:
        hidden: ``[N, H]``; weight: ``[V, H]`` (bias-free); token_ids: ``[N, K]`` integer ids.
        temperature: a positive float or a ``[N]`` tensor (no gradient); softcap: ``c`` or None.
        chunk_size, vocab_chunk_size: the ``C × B`` block, defaults as ``linear_logprobs``.

    Returns:
        ``[N, K]`` in float32 (float64 for float64 inputs), differentiable w.r.t. ``hidden`` and
        ``weight`` (first-order only).
    """
    check_head(hidden, weight)
    n, v = hidden.shape[0], weight.shape[0]
    token_ids = _check_ids("token_ids", token_ids, hidden, 2)
    if token_ids.shape[0] != n:
        raise ValueError(f"token_ids [N, K] must have N = {n} rows, got shape {tuple(token_ids.shape)}")
    if vocab_chunk_size is None:
        vocab_chunk_size = DEFAULT_VOCAB_CHUNK_SIZE["cpu" if hidden.device.type == "cpu" else "accelerator"]
    check_positive_int("vocab_chunk_size", vocab_chunk_size)
    cfg = _AtConfig(
        chunk_size=chunk_rows(min(vocab_chunk_size, v), hidden.device, chunk_size, budget=HEAD_BLOCK),
        vocab_chunk_size=vocab_chunk_size,
        softcap=_check_softcap(softcap),
    )
    inv_t = _inverse_temperature(temperature, n, compute_dtype(hidden.dtype, weight.dtype), hidden.device)
    return _LogprobsAt.apply(hidden, weight, token_ids, inv_t, cfg)
