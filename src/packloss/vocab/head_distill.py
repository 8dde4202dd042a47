"""Fused distillation from hidden states: :func:`linear_distill` builds per token chunk the ``[C, V]``
student (and teacher) logits ``s = h Wᵀ``, calls the shared per-chunk core
(:func:`~packloss.vocab.core.chunk_core`) for the per-token losses and ``c_t · ∂L_t/∂s_t``, and
accumulates ``d_hidden`` and ``d_weight`` in the forward; the backward only scales them by the incoming
gradient, in place. The gradients are first-order only: a second backward (``create_graph=True``)
raises ``RuntimeError``.

Vocab-parallel (``parallel=VocabParallel(group)``): ``weight`` is this rank's contiguous vocabulary
shard ``[V_local, H]``, ``hidden`` is replicated; only per-token scalars are all-reduced per chunk, then
``d_hidden`` (SUM) once. No op reads a device value on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from packloss.core import checks
from packloss.core.dtypes import compute_dtype
from packloss.vocab.core import (
    MATMUL,
    ChunkRun,
    DivergenceSpec,
    Impl,
    TeacherFormat,
    VocabParallel,
    check_parallel,
    chunk_core,
    chunk_ranges,
    chunk_rows,
    gradient_buffer,
    graph_is_kept,
    mm_into,
    resolve_impl,
)
from packloss.vocab.first_order import first_order
from packloss.vocab.head import check_head, check_tokens

__all__ = ["linear_distill"]


_TeacherBlock = Callable[[int, int], Tensor]  # (t0, t1) -> [C, V_local] teacher block


def _distill_forward(
    hidden: Tensor, weight: Tensor, teacher_block: _TeacherBlock, mask: Tensor | None, coef: Tensor, run: ChunkRun,
    need_h: bool, need_w: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    """``(L [N], d_hidden [N, H] | None, d_weight [V_local, H] | None)`` with ``d = Σ_t c_t ∂L_t/∂·``,
    chunk by chunk over tokens (``L`` 0 off the members)."""
    cdt = coef.dtype
    w = weight.to(cdt)  # [V_local, H]
    per_token = torch.empty(hidden.shape[0], dtype=cdt, device=hidden.device)  # [N]
    d_h = torch.empty(hidden.shape, dtype=cdt, device=hidden.device) if need_h else None  # [N, H]
    d_w = gradient_buffer(w.shape, hidden.shape[0], cdt, w.device) if need_w else None  # [V_local, H]
    for t0, t1 in chunk_ranges(hidden.shape[0], run.rows):
        m_c = None if mask is None else mask[t0:t1]  # [C]
        h_c = hidden[t0:t1].to(cdt)  # [C, H]
        h_c = h_c if m_c is None else h_c.masked_fill(~m_c[:, None], 0.0)  # no inf/NaN into d_weight
        # L [C] and c · ∂L/∂s [C, V_local], zero rows off the members
        per_token[t0:t1], grad = chunk_core(h_c @ w.T, teacher_block(t0, t1), m_c, coef[t0:t1], run)
        if d_h is not None:
            torch.mm(grad, w, out=d_h[t0:t1])
        if d_w is not None:
            mm_into(d_w, grad.T, h_c, first=t0 == 0)
    if d_h is not None and run.parallel is not None:
        dist.all_reduce(d_h, op=dist.ReduceOp.SUM, group=run.parallel.group)
    return per_token, d_h, d_w


def _times(x: Tensor | None, g: Tensor, dtype: torch.dtype) -> Tensor | None:
    """``x · g`` cast to ``dtype``: in place unless the running backward keeps the graph."""
    if x is None:
        return None
    return (x * g if graph_is_kept() else x.mul_(g)).to(dtype)


class _LinearDistill(torch.autograd.Function):
    """Forward: ``Σ_t c_t L_t``, the detached ``L [N]``, ``d_hidden`` and ``d_weight``; backward: the
    saved gradients times ``grad_output``, in place unless the graph is kept."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_block, mask, coef, run: ChunkRun):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        per_token, d_h, d_w = _distill_forward(hidden, weight, teacher_block, mask, coef, run, need_h, need_w)
        ctx.save_for_backward(d_h, d_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(per_token)
        return (coef * per_token).sum(), per_token

    @staticmethod
    @first_order("linear_distill")
    def backward(ctx, grad_loss, grad_per_token):
        d_h, d_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return _times(d_h, grad_loss, h_dtype), _times(d_w, grad_loss, w_dtype), None, None, None, None


def _teacher_blocks(
    logits: Tensor | None, hidden: Tensor | None, weight: Tensor | None, fmt: TeacherFormat, n: int, v: int,
    cdt: torch.dtype, device: torch.device,
) -> _TeacherBlock:  # fmt: skip
    """A function ``(t0, t1) -> [C, V_local]`` teacher block in ``cdt``, from logits or a teacher head."""
    if logits is not None:
        if hidden is not None or weight is not None:
            raise ValueError("give teacher_logits or teacher_hidden + teacher_weight, not both")
        if not isinstance(logits, Tensor) or logits.shape != (n, v):
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(f"teacher_logits must be [N, V_local] = {(n, v)}, got {shape}")
        checks.same_device("hidden", device, teacher_logits=logits)
        logits = logits.detach()
        return lambda t0, t1: logits[t0:t1].to(cdt)  # [C, V_local]
    if hidden is None or weight is None:
        raise ValueError("give teacher_logits, or both teacher_hidden and teacher_weight")
    if fmt != "logits":
        raise ValueError(f"teacher_format applies to teacher_logits (a teacher head gives logits), got {fmt!r}")
    check_head(hidden, weight, prefix="teacher_")
    checks.same_device("hidden", device, teacher_hidden=hidden)
    if hidden.shape[0] != n or weight.shape[0] != v:
        shapes = f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        raise ValueError(f"teacher_hidden [N, H_t] and teacher_weight [V_local, H_t] need N={n}, V_local={v}: {shapes}")
    hidden, weight = hidden.detach(), weight.detach().to(cdt)
    return lambda t0, t1: hidden[t0:t1].to(cdt) @ weight.T  # [C, V_local]


def _coefficients(coefficients: Tensor | None, mask: Tensor | None, n: int, cdt: torch.dtype, hidden: Tensor):
    """``c [N]`` in ``cdt``: the given coefficients (detached) or 1, and exactly 0 off the members."""
    if coefficients is None:
        return torch.ones(n, dtype=cdt, device=hidden.device) if mask is None else mask.to(cdt)
    check_tokens("coefficients", coefficients, n, "floating", hidden)
    c = coefficients.detach().to(cdt)
    return c if mask is None else torch.where(mask, c, 0.0)


def linear_distill(
    hidden: Tensor,
    weight: Tensor,
    teacher_logits: Tensor | None = None,
    *,
    teacher_hidden: Tensor | None = None,
    teacher_weight: Tensor | None = None,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    teacher_format: TeacherFormat = "logits",
    loss_mask: Tensor | None = None,
    coefficients: Tensor | None = None,
    chunk_size: int | None = None,
    impl: Impl | None = None,
    parallel: VocabParallel | None = None,
) -> tuple[Tensor, Tensor]:
    """Distillation of the student head ``s = h Wᵀ`` against a teacher, never holding ``N × V``:
    ``loss = Σ_t c_t · L_t`` over the members, ``L_t`` the divergence ``kind`` of
    :func:`~packloss.vocab.distill.divergence` between ``softmax(s_t / T)`` and ``softmax(t_t / T_t)``.

    Args:
        hidden, weight: the student head, ``[N, H]`` and ``[V, H]`` (with ``parallel``: ``weight`` is
            this rank's vocabulary shard ``[V_local, H]``, shards of any sizes; ``hidden`` replicated).
        teacher_logits: ``[N, V]`` (``[N, V_local]`` with ``parallel``) in ``teacher_format``, or instead
        teacher_hidden, teacher_weight: a teacher head ``[N, H_t]``, ``[V, H_t]`` (sharded alike). The
            teacher receives no gradient.
        kind, beta, temperature, teacher_temperature, teacher_format, impl: as in ``divergence``.
        loss_mask: ``[N]`` bool members (None: all); non-members contribute exactly 0 to the loss and
            the gradients, whatever their rows or coefficients hold.
        coefficients: ``[N]`` float weights ``c_t``, constants; default 1 (e.g. ``mask / count``: a
            token mean).
        chunk_size: tokens per chunk (default ``chunk_rows(V_local, budget=MATMUL)``); scratch is
            ``O(chunk × V_local)`` float32.
        parallel: :class:`~packloss.vocab.core.VocabParallel`: per chunk MAX ``[2, C]``, SUM ``[2, C]``
            and SUM ``[k, C]`` all-reduces, then SUM of ``d_hidden`` once.

    Returns:
        ``(loss, per_token)``: ``loss`` 0-d in the compute dtype (float32; float64 for float64
        inputs), differentiable w.r.t. ``hidden`` and ``weight`` (gradients computed in the forward,
        kept until backward, then scaled in place); ``per_token [N]`` the detached ``L_t``, 0 off the
        members. ``N = 0`` gives a zero loss (backward works) and an empty ``per_token``; a teacher
        with ``−inf`` logits (zero probabilities, a padded vocabulary) gives finite values (``0 · log 0 = 0``).
    """
    check_head(hidden, weight)
    n, v_local = hidden.shape[0], weight.shape[0]
    spec = DivergenceSpec(kind, beta, temperature, teacher_temperature, teacher_format)
    cdt = compute_dtype(hidden.dtype, weight.dtype)
    teacher_block = _teacher_blocks(
        teacher_logits, teacher_hidden, teacher_weight, teacher_format, n, v_local, cdt, hidden.device
    )
    if loss_mask is not None:
        check_tokens("loss_mask", loss_mask, n, "any", hidden)
        checks.mask_dtype("loss_mask", loss_mask)
        loss_mask = loss_mask.to(torch.bool)
    coef = _coefficients(coefficients, loss_mask, n, cdt, hidden)
    rows = chunk_rows(v_local, hidden.device, chunk_size, budget=MATMUL)
    run = ChunkRun(spec, rows, resolve_impl(impl, hidden.device), check_parallel(parallel))
    return _LinearDistill.apply(hidden, weight, teacher_block, loss_mask, coef, run)
