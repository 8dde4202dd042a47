"""Fused LM head: per-token log-probs, entropy and distillation losses straight from hidden states.

For hidden states ``h [N, H]`` and the output weight ``W [V, H]`` the logits of token ``i`` are

    z_i = W h_i                                   # [V]
    l_i = c · tanh(z_i / c)                        # softcap c (Gemma style), or l_i = z_i
    x_i = l_i / T_i                                # per-token temperature T_i

and, with ``logZ_i = log Σ_v exp(x_iv)`` and ``p_i = softmax(x_i)``,

    logprob_i = x_{i, y_i} − logZ_i                # y_i the label
    entropy_i = −Σ_v p_iv log p_iv = logZ_i − Σ_v p_iv x_iv

Nothing of size ``N × V`` is ever materialised: the forward walks token chunks ``[C, H]`` and vocab
blocks ``[B, H]`` of ``W`` and keeps, per token, an online log-sum-exp state ``(m, s, b)``

    m = max_v x_v,   s = Σ_v exp(x_v − m),   b = Σ_v exp(x_v − m)(x_v − m)

so that ``logZ = m + log s`` and ``entropy = log s − b / s`` (the shifted ``b`` keeps the entropy
free of cancellation for large logits). The label logit is gathered branch-free: every block
compares the labels with its vocabulary range and adds ``torch.where(in_block, x[label], 0)``.
No op reads a device value on the host, so forward and backward are sync-free.

The backward recomputes each block's logits and applies

    ∂logprob_i/∂x_iv = 1[v = y_i] − p_iv
    ∂entropy_i/∂x_iv = −p_iv (log p_iv + entropy_i)           (only with ``entropy_grad=True``)
    ∂x/∂z = (1 − tanh²(z/c)) / T   (softcap),   1 / T   (no softcap)

accumulating ``d_hidden += dz @ W_block`` and ``d_weight[block] += dzᵀ @ h_chunk`` only for the
inputs that need a gradient.

Vocab-parallel (``group`` given): ``weight`` is this rank's contiguous vocabulary shard. By default
rank ``r`` holds rows ``[r·V_local, (r+1)·V_local)`` of the full vocabulary, ``V_local =
weight.shape[0]`` (equal shards); pass ``vocab_start`` for uneven shards. ``hidden`` and ``labels``
are replicated; labels are global ids. The per-token states are combined with one ``MAX`` and one
``SUM`` all-reduce, and the backward all-reduces ``d_hidden`` (``SUM``), so values and gradients
equal the single-process result; ``d_weight`` is the gradient of this rank's shard.

:func:`linear_distill` computes the distillation losses of :mod:`packloss.distill` (reverse KL,
forward KL, JSD(β), soft cross-entropy) from the student head, against teacher logits or a teacher
head. It is token-chunked: per chunk it builds the ``[C, V]`` student (and teacher) logits, calls
the shared per-chunk core of ``packloss.distill`` (``_chunk_core``) for the masked, normalised loss
and ``∂L/∂s``, and accumulates ``d_hidden = ∂L/∂s · W`` and ``d_weight += ∂L/∂sᵀ · h`` in the
forward; the backward only scales them by the incoming gradient. Vocab-parallel, each rank builds
only its shard's ``[C, V_local]`` logits and the core communicates per-token scalars only: a MAX and
a SUM all-reduce of ``[2, C]`` (the student and teacher log-normalisers) and a SUM of the ``[k, C]``
partial sums of the divergence (k = 2 for JSD, else 1); ``∂L/∂s`` of the shard is then local, so
``d_weight`` is this rank's rows and ``d_hidden`` is all-reduced (``SUM``) once after the last chunk.
Shards may have any sizes (student and teacher sharded alike); no ``vocab_start`` is needed.

Compute dtype: float32 for any input dtype (float64 for float64 inputs, so ``gradcheck`` works);
outputs are in the compute dtype, gradients in the dtype of their input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from packloss.distill import _chunk_core, _scale

__all__ = ["linear_logprobs", "linear_distill"]

DEFAULT_CHUNK_SIZE = 1024
DEFAULT_VOCAB_CHUNK_SIZE = 8192
DEFAULT_DISTILL_CHUNK_ELEMENTS = 2**22  # linear_distill: tokens per chunk = this // V_local


# ----------------------------------------------------------------------------------------------
# validation


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_head(hidden: object, weight: object) -> None:
    """Raise a clear error unless ``hidden [N, H]`` and ``weight [V, H]`` are floating tensors."""
    if isinstance(weight, torch.nn.Module):
        raise TypeError(
            "weight must be a Tensor [V, H], got a Module; pass its .weight (a bias-free output layer is required)"
        )
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [N, H] and weight [V, H] disagree on H: {tuple(hidden.shape)} vs {tuple(weight.shape)}"
        )


def _check_tokens(name: str, t: object, n: int, integer: bool) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != (n,):
        raise ValueError(f"{name} must have shape [N] = ({n},), got {tuple(t.shape)}")
    if integer and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")


def _check_chunk(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _inverse_temperature(temperature: float | torch.Tensor, n: int, like: torch.Tensor) -> torch.Tensor:
    """``1 / T`` as a ``[N]`` tensor (temperature is a constant: it receives no gradient)."""
    if isinstance(temperature, torch.Tensor):
        if temperature.dim() == 0:
            temperature = temperature.reshape(1).expand(n)
        _check_tokens("temperature", temperature, n, integer=False)
        return 1.0 / temperature.detach().to(device=like.device, dtype=like.dtype)
    if not isinstance(temperature, (int, float)) or temperature <= 0:
        raise ValueError(f"temperature must be a positive float or a [N] tensor, got {temperature!r}")
    return torch.full((n,), 1.0 / temperature, device=like.device, dtype=like.dtype)


# ----------------------------------------------------------------------------------------------
# block math (pure functions over one token chunk × vocab block)


@dataclass(frozen=True)
class _Sharding:
    """Where this rank's ``weight`` rows sit in the global vocabulary."""

    group: object | None
    vocab_start: int


def _sharding(group: object | None, vocab_start: int | None, v_local: int) -> _Sharding:
    if group is None:
        if vocab_start not in (None, 0):
            raise ValueError("vocab_start is only meaningful with a process group")
        return _Sharding(None, 0)
    start = dist.get_rank(group) * v_local if vocab_start is None else vocab_start
    return _Sharding(group, start)


def _ranges(total: int, step: int) -> Iterator[tuple[int, int]]:
    for start in range(0, total, step):
        yield start, min(start + step, total)


def _chunk_input(h_c: torch.Tensor, inv_t_c: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Without softcap the temperature folds into the hidden states: ``x = (h / T) Wᵀ``."""
    return h_c * inv_t_c[:, None] if softcap is None else h_c  # [C, H]


def _block_logits(
    h_in: torch.Tensor, w_b: torch.Tensor, inv_t_c: torch.Tensor, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x = c·tanh(h Wᵀ / c) / T`` (or ``h Wᵀ`` with ``h`` pre-scaled); returns ``(x, tanh)``."""
    z = h_in @ w_b.T  # [C, B]
    if softcap is None:
        return z, None
    th = torch.tanh(z.div_(softcap))  # [C, B]
    return th * (softcap * inv_t_c)[:, None], th


def _z_grad(dx: torch.Tensor, th: torch.Tensor | None, inv_t_c: torch.Tensor) -> torch.Tensor:
    """``∂L/∂z = ∂L/∂x · (1 − tanh²) / T`` with softcap; ``∂L/∂x`` itself otherwise (pre-scaled h)."""
    if th is None:
        return dx  # [C, B]
    return dx.mul_(1.0 - th.square_()).mul_(inv_t_c[:, None])  # [C, B]


def _block_stats(x: torch.Tensor, entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``m = max x``, ``s = Σ exp(x − m)``, ``b = Σ exp(x − m)(x − m)`` per row (``b`` if entropy).

    ``x`` is overwritten (with ``x − m``)."""
    m = x.amax(dim=1)  # [C]
    d = x.sub_(m[:, None])  # [C, B]
    if not entropy:
        return m, d.exp_().sum(dim=1), None
    e = torch.exp(d)  # [C, B]
    s = e.sum(dim=1)  # [C]
    return m, s, e.mul_(d).sum(dim=1)


def _merge_stats(
    m1: torch.Tensor,
    s1: torch.Tensor,
    b1: torch.Tensor | None,
    m2: torch.Tensor,
    s2: torch.Tensor,
    b2: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Combine two online log-sum-exp states: with ``m = max(m1, m2)``, ``a_k = exp(m_k − m)``,
    ``s = a1 s1 + a2 s2`` and ``b = a1 (b1 + (m1 − m) s1) + a2 (b2 + (m2 − m) s2)``."""
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    s = a1 * s1 + a2 * s2
    if b1 is None or b2 is None:
        return m, s, None
    b = a1 * (b1 + (m1 - m) * s1) + a2 * (b2 + (m2 - m) * s2)
    return m, s, b


def _label_index(labels_c: torch.Tensor, v0: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Branch-free label lookup in the block ``[v0, v0 + width)``: ``(in_block [C], column [C, 1])``."""
    local = labels_c - v0  # [C]
    in_block = (local >= 0) & (local < width)  # [C]
    return in_block, local.clamp(0, width - 1)[:, None]


def _group_stats(
    m: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None, label: torch.Tensor, group: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Combine per-rank ``(m, s, b)`` and the label logit over ``group``: MAX of ``m``, then one SUM of
    the rescaled ``s``, ``b`` and the label logit (zero on the ranks that do not own the label)."""
    m_g = m.clone()
    dist.all_reduce(m_g, op=dist.ReduceOp.MAX, group=group)
    a = torch.exp(m - m_g)  # [N]
    parts = [a * s, label] + ([] if b is None else [a * (b + (m - m_g) * s)])
    stacked = torch.stack(parts)  # [2 or 3, N]
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
    return m_g, stacked[0], (None if b is None else stacked[2]), stacked[1]


# ----------------------------------------------------------------------------------------------
# linear_logprobs


@dataclass(frozen=True)
class _Config:
    chunk_size: int
    vocab_chunk_size: int
    softcap: float | None
    entropy: bool
    entropy_grad: bool
    ignore_index: int
    sharding: _Sharding


def _logprobs_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    inv_t: torch.Tensor,
    cfg: _Config,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Return ``(logZ [N], label logit [N], entropy [N] | None)`` (label logit 0 when not owned)."""
    cdt = inv_t.dtype
    ms, ss, bs, labs = [], [], [], []
    for t0, t1 in _ranges(hidden.shape[0], cfg.chunk_size):
        h_in = _chunk_input(hidden[t0:t1].to(cdt), inv_t[t0:t1], cfg.softcap)  # [C, H]
        state = None
        lab = torch.zeros(t1 - t0, dtype=cdt, device=hidden.device)  # [C]
        for v0, v1 in _ranges(weight.shape[0], cfg.vocab_chunk_size):
            x, _ = _block_logits(h_in, weight[v0:v1].to(cdt), inv_t[t0:t1], cfg.softcap)  # [C, B]
            in_block, col = _label_index(labels[t0:t1], cfg.sharding.vocab_start + v0, v1 - v0)
            lab = lab + torch.where(in_block, x.gather(1, col).squeeze(1), 0.0)
            stats = _block_stats(x, cfg.entropy)
            state = stats if state is None else _merge_stats(*state, *stats)
        ms.append(state[0])
        ss.append(state[1])
        bs.append(state[2])
        labs.append(lab)
    m, s, lab = torch.cat(ms), torch.cat(ss), torch.cat(labs)  # [N]
    b = torch.cat(bs) if cfg.entropy else None
    if cfg.sharding.group is not None:
        m, s, b, lab = _group_stats(m, s, b, lab, cfg.sharding.group)
    log_s = torch.log(s)
    entropy = None if b is None else log_s - b / s
    return m + log_s, lab, entropy


def _logprobs_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    inv_t: torch.Tensor,
    log_z: torch.Tensor,
    entropy: torch.Tensor | None,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor | None,
    cfg: _Config,
    need_h: bool,
    need_w: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``∂x = g_lp (1[v = y] − p) − g_ent p (log p + entropy)``, ``log p = x − logZ``, chained to ``d_hidden`` and
    ``d_weight`` block by block (``g_lp`` already zero for ignored labels)."""
    cdt = inv_t.dtype
    d_h = torch.zeros(hidden.shape, dtype=cdt, device=hidden.device) if need_h else None  # [N, H]
    d_w = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_w else None  # [V, H]
    for t0, t1 in _ranges(hidden.shape[0], cfg.chunk_size):
        inv_t_c = inv_t[t0:t1]
        h_in = _chunk_input(hidden[t0:t1].to(cdt), inv_t_c, cfg.softcap)  # [C, H]
        lz = log_z[t0:t1, None]  # [C, 1]
        g = g_lp[t0:t1]  # [C]
        if g_ent is not None:
            ge, ent_c = g_ent[t0:t1, None], entropy[t0:t1, None]  # [C, 1]
        for v0, v1 in _ranges(weight.shape[0], cfg.vocab_chunk_size):
            w_b = weight[v0:v1].to(cdt)  # [B, H]
            x, th = _block_logits(h_in, w_b, inv_t_c, cfg.softcap)  # [C, B]
            log_p = x.sub_(lz)  # [C, B]
            if g_ent is None:
                dx = log_p.exp_().mul_(-g[:, None])  # [C, B]
            else:
                p = torch.exp(log_p)  # [C, B]
                dx = p.mul_(log_p.add_(ent_c).mul_(ge).add_(g[:, None])).neg_()  # [C, B]
            in_block, col = _label_index(labels[t0:t1], cfg.sharding.vocab_start + v0, v1 - v0)
            dx.scatter_add_(1, col, torch.where(in_block, g, 0.0)[:, None])
            dz = _z_grad(dx, th, inv_t_c)  # [C, B]
            if d_h is not None:
                d_h[t0:t1].addmm_(dz, w_b)
            if d_w is not None:
                d_w[v0:v1].addmm_(dz.T, h_in)
        if d_h is not None and cfg.softcap is None:
            d_h[t0:t1].mul_(inv_t_c[:, None])
    if d_h is not None and cfg.sharding.group is not None:
        dist.all_reduce(d_h, op=dist.ReduceOp.SUM, group=cfg.sharding.group)
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
    def backward(ctx, g_lp, g_ent):
        hidden, weight, labels, inv_t, log_z, entropy, valid = ctx.saved_tensors
        cfg: _Config = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return None, None, None, None, None
        g = torch.where(valid, g_lp, 0.0) if g_lp is not None else torch.zeros_like(log_z)
        g_e = g_ent if cfg.entropy_grad else None
        d_h, d_w = _logprobs_backward(hidden, weight, labels, inv_t, log_z, entropy, g, g_e, cfg, need_h, need_w)
        d_h = None if d_h is None else d_h.to(hidden.dtype)
        d_w = None if d_w is None else d_w.to(weight.dtype)
        return d_h, d_w, None, None, None


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE,
    return_entropy: bool = True,
    entropy_grad: bool = False,
    softcap: float | None = None,
    ignore_index: int = -100,
    group: object | None = None,
    vocab_start: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of ``labels`` (and entropy) under ``softmax(softcap(h Wᵀ) / T)``, fused.

    Args:
        hidden: ``[N, H]`` hidden states (any floating dtype).
        weight: ``[V, H]`` output weight (bias-free; with ``group``, this rank's vocab shard).
        labels: ``[N]`` integer global token ids; ``ignore_index`` marks positions without a label.
        temperature: a positive float or a ``[N]`` tensor of per-token temperatures (no gradient).
        chunk_size, vocab_chunk_size: the token × vocab block; at most a few float32 blocks of
            ``chunk_size × vocab_chunk_size`` are alive at a time.
        return_entropy: compute ``entropy = −Σ p log p`` as well.
        entropy_grad: make the entropy differentiable (``∂H/∂x = −p (log p + H)``); otherwise it is
            returned detached.
        softcap: ``c`` of ``l = c·tanh(z / c)``, applied to the raw logits before the temperature.
        ignore_index: label value whose log-prob is 0 and receives no gradient. The entropy does not
            depend on the label, so it is computed at every position (mask it yourself); with
            ``entropy_grad`` its gradient flows wherever the caller's loss uses it.
        group: a ``torch.distributed`` process group for vocab-parallel ``weight`` (see module doc).
        vocab_start: global id of this rank's first row (default ``rank · V_local``).

    Returns:
        ``(logprobs [N], entropy [N] | None)`` in float32 (float64 for float64 inputs). Labels outside
        ``[0, V)`` other than ``ignore_index`` are not checked (that would need a host sync).
    """
    _check_head(hidden, weight)
    n = hidden.shape[0]
    _check_tokens("labels", labels, n, integer=True)
    _check_chunk("chunk_size", chunk_size)
    _check_chunk("vocab_chunk_size", vocab_chunk_size)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive float or None, got {softcap!r}")
    if entropy_grad and not return_entropy:
        raise ValueError("entropy_grad=True needs return_entropy=True")
    cdt = _compute_dtype(hidden, weight)
    inv_t = _inverse_temperature(temperature, n, torch.empty(0, dtype=cdt, device=hidden.device))
    cfg = _Config(
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        softcap=None if softcap is None else float(softcap),
        entropy=return_entropy,
        entropy_grad=entropy_grad,
        ignore_index=ignore_index,
        sharding=_sharding(group, vocab_start, weight.shape[0]),
    )
    logprobs, entropy = _LinearLogprobs.apply(hidden, weight, labels, inv_t, cfg)
    return logprobs, (entropy if return_entropy else None)


# ----------------------------------------------------------------------------------------------
# linear_distill


_KINDS = ("reverse_kl", "forward_kl", "jsd", "soft_cross_entropy")


@dataclass(frozen=True)
class _DistillConfig:
    kind: str
    beta: float
    student_temperature: float
    teacher_temperature: float
    chunk_size: int
    group: object | None


def _distill_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_block: Callable[[int, int], torch.Tensor],
    mask: torch.Tensor | None,
    scale: torch.Tensor,
    cfg: _DistillConfig,
    need_h: bool,
    need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(loss, d_hidden [N, H] | None, d_weight [V_local, H] | None)``, chunk by chunk over tokens."""
    cdt = _compute_dtype(hidden, weight)
    w = weight.to(cdt)  # [V_local, H]
    d_h = torch.zeros(hidden.shape, dtype=cdt, device=hidden.device) if need_h else None  # [N, H]
    d_w = torch.zeros(w.shape, dtype=cdt, device=w.device) if need_w else None  # [V_local, H]
    loss = torch.zeros((), dtype=cdt, device=hidden.device)
    for t0, t1 in _ranges(hidden.shape[0], cfg.chunk_size):
        h_c = hidden[t0:t1].to(cdt)  # [C, H]
        loss_c, grad = _chunk_core(
            h_c @ w.T,  # [C, V_local]
            teacher_block(t0, t1),  # [C, V_local]
            None if mask is None else mask[t0:t1],
            scale,
            cfg.kind,
            cfg.student_temperature,
            cfg.teacher_temperature,
            "logits",
            cfg.beta,
            group=cfg.group,
        )  # scale · Σ_members L, scale · ∂L/∂s [C, V_local] with zero non-member rows
        loss = loss + loss_c
        if d_h is not None:
            d_h[t0:t1] = grad @ w
        if d_w is not None:
            d_w.addmm_(grad.T, h_c)
    if d_h is not None and cfg.group is not None:
        dist.all_reduce(d_h, op=dist.ReduceOp.SUM, group=cfg.group)
    return loss, d_h, d_w


class _LinearDistill(torch.autograd.Function):
    """Forward: loss, ``d_hidden`` and ``d_weight``; backward: both times ``grad_output``."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_block, mask, scale, cfg: _DistillConfig):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, d_h, d_w = _distill_forward(hidden, weight, teacher_block, mask, scale, cfg, need_h, need_w)
        ctx.save_for_backward(d_h, d_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        d_h, d_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        d_h = None if d_h is None else (d_h * grad_output).to(h_dtype)
        d_w = None if d_w is None else (d_w * grad_output).to(w_dtype)
        return d_h, d_w, None, None, None, None


def _teacher_blocks(
    teacher_logits: torch.Tensor | None,
    teacher_hidden: torch.Tensor | None,
    teacher_weight: torch.Tensor | None,
    n: int,
    v_local: int,
    cdt: torch.dtype,
) -> Callable[[int, int], torch.Tensor]:
    """A function ``(t0, t1) -> [C, V_local]`` teacher logits in ``cdt``, from logits or a teacher head."""
    if teacher_logits is not None:
        if teacher_hidden is not None or teacher_weight is not None:
            raise ValueError("give teacher_logits or teacher_hidden + teacher_weight, not both")
        if teacher_logits.shape != (n, v_local):
            raise ValueError(f"teacher_logits must be [N, V_local] = {(n, v_local)}, got {tuple(teacher_logits.shape)}")
        t_logits = teacher_logits.detach()
        return lambda t0, t1: t_logits[t0:t1].to(cdt)
    if teacher_hidden is None or teacher_weight is None:
        raise ValueError("give teacher_logits, or both teacher_hidden and teacher_weight")
    _check_head(teacher_hidden, teacher_weight)
    if teacher_hidden.shape[0] != n or teacher_weight.shape[0] != v_local:
        raise ValueError(
            f"teacher_hidden [N, H_t] and teacher_weight [V_local, H_t] must match N={n}, V_local={v_local}, "
            f"got {tuple(teacher_hidden.shape)} and {tuple(teacher_weight.shape)}"
        )
    t_h, t_w = teacher_hidden.detach(), teacher_weight.detach().to(cdt)
    return lambda t0, t1: t_h[t0:t1].to(cdt) @ t_w.T  # [C, V_local]


def linear_distill(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_logits: torch.Tensor | None = None,
    *,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    normalize: str = "token",
    denominator: torch.Tensor | float | None = None,
    chunk_size: int | None = None,
    group: object | None = None,
) -> torch.Tensor:
    """Distillation loss of the student head ``s = h Wᵀ`` against a teacher, never holding ``N × V``.

    ``loss = Σ_{i∈mask} L_i / denominator`` with ``L_i`` one of (``q = softmax(s_i / T_s)``,
    ``p = softmax(t_i / T_t)``): ``"reverse_kl"`` ``KL(q‖p)``, ``"forward_kl"`` ``KL(p‖q)``,
    ``"jsd"`` ``β KL(p‖m) + (1 − β) KL(q‖m)``, ``m = β p + (1 − β) q``, ``"soft_cross_entropy"``
    ``−Σ p log q`` — the math and normalisation of :mod:`packloss.distill`, shared with it.

    Args:
        hidden, weight: the student head, ``[N, H]`` and ``[V, H]`` (with ``group``: ``hidden``
            replicated and ``weight`` this rank's vocabulary shard ``[V_local, H]``; the shards of
            the group, of any sizes, partition the vocabulary).
        teacher_logits: ``[N, V]`` (``[N, V_local]`` with ``group``), or instead
        teacher_hidden, teacher_weight: a teacher head, ``[N, H_t]`` and ``[V, H_t]`` (sharded alike).
            The teacher receives no gradient.
        loss_mask: ``[N]`` bool members (None: all).
        normalize, denominator: ``"token"`` (member count or ``denominator``), ``"position"`` (N or
            ``denominator``), ``"sum"``.
        chunk_size: tokens per chunk (default ``2**22 // V_local``); scratch is ``O(chunk × V_local)``
            float32.
        group: a ``torch.distributed`` process group for a vocab-parallel head (see module doc):
            per chunk it all-reduces ``[2, C]`` (MAX), ``[2, C]`` (SUM) and ``[k, C]`` (SUM)
            per-token scalars, then ``d_hidden`` (SUM) once; the loss and ``d_hidden`` equal the
            single-process ones on every rank, ``d_weight`` is this rank's rows.

    Returns:
        A 0-d loss in the compute dtype (float32; float64 for float64 inputs). Its gradients
        w.r.t. ``hidden`` and ``weight`` are computed in the forward (``[N, H]`` and ``[V, H]``,
        kept until backward); a second backward gives the same gradients again.
    """
    _check_head(hidden, weight)
    n, v_local = hidden.shape[0], weight.shape[0]
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    if kind == "jsd" and not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if student_temperature <= 0 or teacher_temperature <= 0:
        raise ValueError("student_temperature and teacher_temperature must be positive")
    cdt = _compute_dtype(hidden, weight)
    teacher_block = _teacher_blocks(teacher_logits, teacher_hidden, teacher_weight, n, v_local, cdt)
    if loss_mask is not None:
        _check_tokens("loss_mask", loss_mask, n, integer=False)
        loss_mask = loss_mask.to(torch.bool)
    rows = chunk_size if chunk_size is not None else max(1, DEFAULT_DISTILL_CHUNK_ELEMENTS // v_local)
    _check_chunk("chunk_size", rows)
    cfg = _DistillConfig(
        kind=kind,
        beta=float(beta),
        student_temperature=float(student_temperature),
        teacher_temperature=float(teacher_temperature),
        chunk_size=rows,
        group=group,
    )
    scale = _scale(normalize, denominator, loss_mask, n, hidden.device, cdt)
    return _LinearDistill.apply(hidden, weight, teacher_block, loss_mask, scale, cfg)
