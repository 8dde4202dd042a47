"""Full-vocabulary distillation from teacher logits: reverse KL, forward KL, JSD(β), soft cross-entropy.

Notation (per token, every tensor ``[V]``): student logits ``s``, teacher logits ``t``, temperatures
``T_s`` and ``T_t``; student ``q = softmax(s / T_s)``, teacher ``p = softmax(t / T_t)``.

* :func:`reverse_kl` ``KL(q‖p) = Σ_v q (log q − log p)``
* :func:`forward_kl` ``KL(p‖q) = Σ_v p (log p − log q)``
* :func:`jsd` ``β KL(p‖m) + (1 − β) KL(q‖m)`` with ``m = β p + (1 − β) q`` (GKD / TRL convention:
  ``β = 0`` is forward KL, ``β = 1`` is reverse KL)
* :func:`soft_cross_entropy` ``−Σ_v p log q``

Each returns a scalar ``Σ_{members} loss_token / denominator`` that supports ``backward()``.

How (DESIGN.md §5): a custom :class:`torch.autograd.Function` computes, in its forward, the loss AND
the gradient w.r.t. the student logits chunk by chunk over tokens, in float32 whatever the input
dtype (float64 stays float64), with ``O(chunk × V)`` float32 scratch. It writes the gradient
(already scaled by ``1 / denominator``) into one ``[N, V]`` tensor of the logits' dtype and saves
only that tensor; its backward returns ``grad_output * gradient``, multiplying in place so no
second ``[N, V]`` tensor is allocated (when the backward retains the graph, ``retain_graph=True``,
it multiplies out of place instead, so repeated backwards stay correct). Masked tokens get exact
zero gradient and contribute exactly 0 to the loss; their logits may hold anything (±inf, NaN):
every operation is row-wise, and the masked rows are dropped with ``torch.where``. There is no host
synchronisation: denominators stay tensors, masking is ``torch.where``.

Reusable per-chunk core (imported by the fused LM head, ``packloss.head``), three stages over one
``[c, V]`` block (any float dtype, never modified), computed in float32 (float64 stays float64):

1. ``_log_probs``: ``log q`` and ``log p`` normalised over the whole vocabulary;
2. ``_<kind>_sums``: the per-token partial sums over the block (``[k, c]``: ``[KL(q‖p)]``,
   ``[KL(p‖q)]``, ``[−Σ p log q]`` or ``[KL(p‖m), KL(q‖m)]``) and the block state the gradient needs;
3. ``_reverse_kl_grad``, ``_q_minus_p_grad`` (forward KL, soft cross-entropy) or ``_jsd_grad``: the
   per-token loss ``[c]`` and ``∂L/∂s`` ``[c, V]`` from the summed scalars.

``_chunk_divergence(kind, s, t, *, beta, student_temperature, teacher_temperature, teacher_format,
group=None)`` runs them. Without a group the block holds the whole vocabulary: stage 1 is one fused
``log_softmax`` and the sums are complete. With a ``torch.distributed`` group the block is this
rank's vocabulary shard: stage 1 all-reduces the per-token log-sum-exp (one MAX and one SUM of
``[2, c]``), stage 2 its ``[k, c]`` sums (SUM), and stage 3 is local to the shard. ``_chunk_core``
adds masking, ``1 / denominator`` scaling and the cast to the logits' dtype; it is the one core that
the eager path runs and the compiled path compiles (always without a group).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

__all__ = ["reverse_kl", "forward_kl", "jsd", "soft_cross_entropy"]

TeacherFormat = Literal["logits", "logprobs", "probs"]
Normalize = Literal["token", "position", "sum"]
Impl = Literal["eager", "compiled"]

# Default chunk height: rows = max(1, elements // V). CPU: 2**18 float32 elements (1 MiB per
# buffer, ~5 live per chunk) per intra-op thread, so each thread's share of a chunk stays in its
# cache; measured 2-3x faster than naive autograd on one thread, and faster than 16 MiB chunks.
# CUDA: large enough to fill the device (256 MiB per buffer).
_CPU_ELEMENTS_PER_THREAD = 2**18
_CUDA_ELEMENTS = 2**26


def _default_chunk_rows(vocab: int, device: torch.device) -> int:
    elements = _CPU_ELEMENTS_PER_THREAD * torch.get_num_threads() if device.type == "cpu" else _CUDA_ELEMENTS
    return max(1, elements // max(vocab, 1))

# The default implementation per device type; the measurements behind it: the `impl` argument.
_DEFAULT_IMPL: dict[str, Impl] = {"cpu": "eager", "cuda": "compiled"}


# ---------------------------------------------------------------------------------------------------
# Per-chunk pure math in three stages over one [c, V] block of the vocabulary (all of it, or with a
# process group this rank's shard), in the compute dtype:
#   1. log-probabilities normalised over the whole vocabulary (``_log_probs``);
#   2. per-token partial sums over the block, plus the block state the gradient needs (``*_sums``);
#   3. from the summed per-token scalars, the loss [c] and the gradient block [c, V] (``*_grad``).
# Single-process the block is the whole vocabulary and the sums are complete; vocab-parallel, stages
# 1 and 2 each end in per-token all-reduces, and stage 3 is local.
# ---------------------------------------------------------------------------------------------------

_State = tuple[torch.Tensor, torch.Tensor]  # two [c, V] buffers kept from stage 2 for stage 3
_SumsFn = Callable[[torch.Tensor, torch.Tensor, float, TeacherFormat], tuple[torch.Tensor, _State]]
_GradFn = Callable[[_State, torch.Tensor, float, float], tuple[torch.Tensor, torch.Tensor]]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for fp32 / bf16 / fp16, float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``x / T`` in the compute dtype; ``x`` itself (not copied, never modified) when that is a no-op."""
    x = x.to(_compute_dtype(x.dtype))  # [c, V]
    return x if temperature == 1.0 else x / temperature


def _log_softmax(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(x / T)`` over the last dim in the compute dtype; ``x``: ``[c, V]``, unmodified."""
    dtype = _compute_dtype(x.dtype)
    if temperature != 1.0:
        return torch.log_softmax(x.to(dtype).div(temperature), dim=-1)  # [c, V]
    return torch.log_softmax(x, dim=-1, dtype=dtype)  # [c, V]


def _teacher_logits(t: torch.Tensor, teacher_format: TeacherFormat) -> torch.Tensor:
    """``u`` with ``p = softmax(u / T_t)``: ``t`` itself for logits and log-probabilities (re-normalising
    is exact up to rounding), ``log t`` for probabilities (a zero gives ``log p = −inf``)."""
    if teacher_format == "probs":
        return t.to(_compute_dtype(t.dtype)).log()  # [c, V]
    if teacher_format not in ("logits", "logprobs"):
        raise ValueError(f"teacher_format must be 'logits', 'logprobs' or 'probs', got {teacher_format!r}")
    return t


def _sharded_log_softmax(a: torch.Tensor, b: torch.Tensor, group: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a − logZ_a, b − logZ_b)`` for two ``[c, V_local]`` blocks whose rows are split over the
    vocabulary shards of ``group``. With this rank's ``ℓ_r = logsumexp_v x`` (per row), one MAX
    all-reduce gives ``M = max_r ℓ_r`` and one SUM all-reduce ``logZ = M + log Σ_r exp(ℓ_r − M)``,
    both of one ``[2, c]`` tensor (an all ``−inf`` shard contributes ``exp(−inf) = 0``)."""
    lse = torch.stack([torch.logsumexp(a, dim=-1), torch.logsumexp(b, dim=-1)])  # [2, c]
    top = lse.clone()  # [2, c]
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    total = lse.sub_(top).exp_()  # [2, c]
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    log_z = total.log_().add_(top)  # [2, c]
    return a - log_z[0, :, None], b - log_z[1, :, None]  # [c, V_local] each


def _log_probs(
    s: torch.Tensor,
    t: torch.Tensor,
    student_temperature: float,
    teacher_temperature: float,
    teacher_format: TeacherFormat,
    group: object | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1: ``log q = log_softmax(s / T_s)`` and ``log p = log_softmax(u / T_t)``
    (:func:`_teacher_logits`), ``[c, V]`` fresh buffers of the compute dtype that stage 2 may
    overwrite. Whole vocabulary: one fused ``log_softmax`` each; vocab shard: the log-normalisers
    over ``group`` (:func:`_sharded_log_softmax`)."""
    u = _teacher_logits(t, teacher_format)  # [c, V]
    if group is None:
        return _log_softmax(s, student_temperature), _log_softmax(u, teacher_temperature)
    return _sharded_log_softmax(_scaled(s, student_temperature), _scaled(u, teacher_temperature), group)


def _reverse_kl_sums(
    log_q: torch.Tensor, log_p: torch.Tensor, beta: float, teacher_format: TeacherFormat
) -> tuple[torch.Tensor, _State]:
    """Reverse KL ``L = Σ_v q (log q − log p)``: sums ``[L]`` (``[1, c]``), state ``(q, log q − log p)``.
    A teacher with exact zero probabilities where ``q > 0`` gives ``L = +inf`` (the true value)."""
    diff = log_p.neg_().add_(log_q)  # [c, V], log q − log p
    q = log_q.exp_()  # [c, V]
    return (q * diff).sum(-1)[None], (q, diff)


def _reverse_kl_grad(
    state: _State, sums: torch.Tensor, beta: float, student_temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reverse-KL loss ``[c]`` and gradient ``[c, V]``. With ``a = s / T_s``,
    ``∂ log q_i / ∂a_j = δ_ij − q_j`` and ``∂q_i/∂a_j = q_i (δ_ij − q_j)``:
    ``∂L/∂a_j = q_j (log q_j − log p_j) − q_j L + Σ_i q_i (δ_ij − q_j) = q_j (log q_j − log p_j − L)``,
    so::

        ∂L/∂s_j = q_j (log q_j − log p_j − L) / T_s
    """
    q, diff = state
    loss = sums[0]  # [c]
    grad = diff.sub_(loss.unsqueeze(-1)).mul_(q)  # [c, V]
    if student_temperature != 1.0:
        grad.div_(student_temperature)
    return loss, grad


def _forward_kl_sums(
    log_q: torch.Tensor, log_p: torch.Tensor, beta: float, teacher_format: TeacherFormat
) -> tuple[torch.Tensor, _State]:
    """Forward KL ``L = Σ_v p (log p − log q)`` (terms with ``p = 0`` are 0): sums ``[L]``, state
    ``(log q, p)``."""
    p = log_p.exp()  # [c, V]
    term = log_p.sub_(log_q).mul_(p)  # [c, V], p (log p − log q)
    if teacher_format == "probs":  # log p = −inf where p = 0: 0 · (−inf) must count 0
        term = torch.where(p > 0, term, 0.0)
    return term.sum(-1)[None], (log_q, p)


def _soft_cross_entropy_sums(
    log_q: torch.Tensor, log_p: torch.Tensor, beta: float, teacher_format: TeacherFormat
) -> tuple[torch.Tensor, _State]:
    """Soft cross-entropy ``L = −Σ_v p log q`` (= forward KL + H(p)): sums ``[L]``, state ``(log q, p)``."""
    p = log_p.exp_()  # [c, V]
    return (p * log_q).sum(-1).neg_()[None], (log_q, p)


def _q_minus_p_grad(
    state: _State, sums: torch.Tensor, beta: float, student_temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward-KL and soft-cross-entropy loss ``[c]`` and gradient ``[c, V]``. Both are
    ``−Σ_i p_i log q_i`` up to a constant in ``s``; ``∂(−Σ_i p_i log q_i)/∂a_j = −p_j + q_j Σ_i p_i``
    and ``Σ p = 1``, so::

        ∂L/∂s_j = (q_j − p_j) / T_s
    """
    log_q, p = state
    grad = log_q.exp_().sub_(p)  # [c, V], q − p
    if student_temperature != 1.0:
        grad.div_(student_temperature)
    return sums[0], grad


def _jsd_sums(
    log_q: torch.Tensor, log_p: torch.Tensor, beta: float, teacher_format: TeacherFormat
) -> tuple[torch.Tensor, _State]:
    """Generalised Jensen–Shannon divergence, ``0 < β < 1`` (GKD, Agarwal et al. 2024; TRL)::

        m = β p + (1 − β) q,   L = β KL(p‖m) + (1 − β) KL(q‖m)

    ``log m`` is elementwise, so the sums are ``[KL(p‖m), KL(q‖m)]`` (``[2, c]``) and the state
    ``(q, log q − log m)``."""
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))  # [c, V]
    p = log_p.exp()  # [c, V]
    term_p = log_p.sub_(log_m).mul_(p)  # [c, V], p (log p − log m)
    if teacher_format == "probs":  # 0 · (−inf) must count 0
        term_p = torch.where(p > 0, term_p, 0.0)
    diff = log_m.neg_().add_(log_q)  # [c, V], log q − log m
    q = log_q.exp_()  # [c, V]
    return torch.stack([term_p.sum(-1), (q * diff).sum(-1)]), (q, diff)


def _jsd_grad(
    state: _State, sums: torch.Tensor, beta: float, student_temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """JSD loss ``β KL(p‖m) + (1 − β) KL(q‖m)`` ``[c]`` and gradient ``[c, V]``. Treating ``q`` as
    free, ``∂L/∂q_i = (1 − β)(log q_i − log m_i)``: the ``∂ log m`` terms sum to
    ``−(β p_i + (1 − β) q_i)(1 − β)/m_i = −(1 − β)`` and cancel the ``+(1 − β)`` from
    ``∂(q log q)``. Through the softmax (``∂q_i/∂a_j = q_i (δ_ij − q_j)``)::

        ∂L/∂s_j = (1 − β) q_j (log q_j − log m_j − KL(q‖m)) / T_s

    i.e. the reverse-KL gradient against ``m``, scaled by ``1 − β``."""
    q, diff = state
    kl_q = sums[1]  # [c], KL(q‖m)
    loss = beta * sums[0] + (1.0 - beta) * kl_q  # [c]
    grad = diff.sub_(kl_q.unsqueeze(-1)).mul_(q).mul_((1.0 - beta) / student_temperature)  # [c, V]
    return loss, grad


_STAGES: dict[str, tuple[_SumsFn, _GradFn]] = {
    "reverse_kl": (_reverse_kl_sums, _reverse_kl_grad),
    "forward_kl": (_forward_kl_sums, _q_minus_p_grad),
    "soft_cross_entropy": (_soft_cross_entropy_sums, _q_minus_p_grad),
    "jsd": (_jsd_sums, _jsd_grad),
}


def _stages(kind: str, beta: float) -> tuple[_SumsFn, _GradFn]:
    """Stages 2 and 3 of ``kind``; JSD at ``β = 0`` is forward KL and at ``β = 1`` reverse KL (the
    limits of ``L/β`` and ``L/(1 − β)``)."""
    if kind == "jsd":
        if beta == 0.0:
            return _STAGES["forward_kl"]
        if beta == 1.0:
            return _STAGES["reverse_kl"]
        if not 0.0 < beta < 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
    return _STAGES[kind]


def _chunk_divergence(
    kind: str,
    s: torch.Tensor,
    t: torch.Tensor,
    *,
    beta: float = 0.5,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    teacher_format: TeacherFormat = "logits",
    group: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss ``[c]`` and ``∂L/∂s`` ``[c, V]`` of one block, in the compute dtype.

    ``s``, ``t``: ``[c, V]`` student / teacher blocks (never modified). With ``group`` they are this
    rank's vocabulary shard of the rows (student and teacher sharded alike); the loss is then the
    full-vocabulary one on every rank and the gradient this shard's columns. Communication per block:
    MAX and SUM all-reduces of ``[2, c]`` (stage 1) and one SUM of the ``[k, c]`` sums (k = 2 for
    JSD, else 1).
    """
    partial_sums, finish = _stages(kind, beta)
    log_q, log_p = _log_probs(s, t, student_temperature, teacher_temperature, teacher_format, group)  # [c, V]
    sums, state = partial_sums(log_q, log_p, beta, teacher_format)  # [k, c], block buffers
    if group is not None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return finish(state, sums, beta, student_temperature)


def _chunk_core(
    s: torch.Tensor,
    t: torch.Tensor,
    mask: torch.Tensor | None,
    scale: torch.Tensor,
    kind: str,
    student_temperature: float,
    teacher_temperature: float,
    teacher_format: TeacherFormat,
    beta: float,
    out: torch.Tensor | None = None,
    group: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk end to end: ``scale · Σ_{members} L`` and ``scale · ∂L/∂s`` with exact zero rows
    for non-members, cast to ``s.dtype``.

    ``s``, ``t``: ``[c, V]`` slices of the caller's tensors (never modified; with ``group``, this
    rank's vocabulary shard, see :func:`_chunk_divergence`); ``mask``: ``[c]`` bool or None (all
    members); ``scale``: 0-d tensor ``1 / denominator`` in the compute dtype. With ``out`` (``[c, V]``,
    ``s.dtype``, e.g. a slice of the ``[N, V]`` gradient) the gradient is written there and None is
    returned in its place (under ``torch.compile`` the write is part of the last fused kernel);
    without, it is returned.
    """
    loss, grad = _chunk_divergence(
        kind,
        s,
        t,
        beta=beta,
        student_temperature=student_temperature,
        teacher_temperature=teacher_temperature,
        teacher_format=teacher_format,
        group=group,
    )  # [c], [c, V]
    grad = grad.mul_(scale)  # [c, V]
    if mask is None:
        if out is None:
            return loss.sum() * scale, grad.to(s.dtype)
        out.copy_(grad)
        return loss.sum() * scale, None
    total = torch.where(mask, loss, 0.0).sum() * scale  # drops whatever non-member rows produced
    keep = mask.unsqueeze(-1)  # [c, 1]
    if out is None:
        return total, torch.where(keep, grad, 0.0).to(s.dtype)
    out.copy_(grad.masked_fill_(~keep, 0.0))  # [c, V], cast to the logits' dtype
    return total, None


@functools.cache
def _compiled_core() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """``_chunk_core`` under ``torch.compile(dynamic=True)``: one graph for every chunk height and
    vocabulary size (no recompilation per N). Inductor functionalises the core's in-place ops, so
    this is the out-of-place program, fused into a few kernels."""
    return torch.compile(_chunk_core, dynamic=True)


@dataclass(frozen=True)
class _Spec:
    kind: str
    student_temperature: float
    teacher_temperature: float
    teacher_format: TeacherFormat
    beta: float
    chunk_size: int
    impl: Impl


def _graph_is_kept() -> bool:
    """Whether the running backward keeps the graph (``retain_graph=True``); True if unknown."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep_graph is None else keep_graph()


class _DistillFunction(torch.autograd.Function):
    """Forward: loss and scaled gradient, chunk by chunk; saves only the ``[N, V]`` gradient.
    Backward: ``grad_output * gradient``, in place unless the graph is retained (then a copy)."""

    @staticmethod
    def forward(
        ctx,
        student: torch.Tensor,
        teacher: torch.Tensor,
        mask: torch.Tensor | None,
        scale: torch.Tensor,
        spec: _Spec,
    ) -> torch.Tensor:
        n = student.shape[0]
        grad = torch.empty_like(student) if ctx.needs_input_grad[0] else None  # [N, V], logits dtype
        total = torch.zeros((), dtype=scale.dtype, device=student.device)
        for start in range(0, n, spec.chunk_size):
            stop = min(start + spec.chunk_size, n)
            args = (
                student[start:stop],
                teacher[start:stop],
                None if mask is None else mask[start:stop],
                scale,
                spec.kind,
                spec.student_temperature,
                spec.teacher_temperature,
                spec.teacher_format,
                spec.beta,
            )
            core = _compiled_core() if spec.impl == "compiled" else _chunk_core
            loss_c, _ = core(*args, out=None if grad is None else grad[start:stop])
            total = total + loss_c
        if grad is not None:
            ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        if _graph_is_kept():  # retain_graph / create_graph: the saved gradient must survive
            return grad * grad_output, None, None, None, None
        return grad.mul_(grad_output), None, None, None, None


def _scale(
    normalize: Normalize,
    denominator: torch.Tensor | float | None,
    mask: torch.Tensor | None,
    n: int,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``1 / denominator`` as a 0-d tensor of the compute ``dtype``: token → member count (at
    least 1) or the given denominator; position → N or the given denominator; sum → 1."""
    if normalize == "sum":
        if denominator is not None:
            raise ValueError("normalize='sum' takes no denominator")
        return torch.ones((), dtype=dtype, device=device)
    if normalize not in ("token", "position"):
        raise ValueError(f"normalize must be 'token', 'position' or 'sum', got {normalize!r}")
    if isinstance(denominator, torch.Tensor):
        return denominator.to(device=device, dtype=dtype).reciprocal()
    if denominator is not None:
        return torch.full((), 1.0 / denominator, dtype=dtype, device=device)
    if normalize == "token" and mask is not None:
        return mask.sum().clamp(min=1).to(dtype).reciprocal()
    return torch.full((), 1.0 / max(n, 1), dtype=dtype, device=device)


def _distill(
    kind: str,
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    loss_mask: torch.Tensor | None,
    *,
    student_temperature: float,
    teacher_temperature: float,
    teacher_format: TeacherFormat,
    beta: float,
    normalize: Normalize,
    denominator: torch.Tensor | float | None,
    chunk_size: int | None,
    impl: Impl | None,
) -> torch.Tensor:
    if student_logits.dim() != 2 or student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student and teacher logits must both be [N, V], got {tuple(student_logits.shape)} "
            f"and {tuple(teacher_logits.shape)}"
        )
    n, v = student_logits.shape
    if loss_mask is not None:
        if loss_mask.shape != (n,):
            raise ValueError(f"loss_mask must be [N] = [{n}], got {tuple(loss_mask.shape)}")
        loss_mask = loss_mask.to(torch.bool)
    if student_temperature <= 0 or teacher_temperature <= 0:
        raise ValueError("temperatures must be positive")
    if teacher_format not in ("logits", "logprobs", "probs"):
        raise ValueError(f"teacher_format must be 'logits', 'logprobs' or 'probs', got {teacher_format!r}")
    impl = impl or _DEFAULT_IMPL.get(student_logits.device.type, "compiled")
    if impl not in ("eager", "compiled"):
        raise ValueError(f"impl must be 'eager', 'compiled' or None, got {impl!r}")
    rows = chunk_size or _default_chunk_rows(v, student_logits.device)
    spec = _Spec(
        kind, float(student_temperature), float(teacher_temperature), teacher_format, float(beta), rows, impl
    )
    dtype = _compute_dtype(student_logits.dtype)
    scale = _scale(normalize, denominator, loss_mask, n, student_logits.device, dtype)
    return _DistillFunction.apply(student_logits, teacher_logits.detach(), loss_mask, scale, spec)


_COMMON_DOC = """
    Args:
        student_logits: ``[N, V]`` float (fp32 / bf16 / fp16); the gradient flows to it.
        teacher_logits: ``[N, V]``, no gradient; logits unless ``teacher_format`` says otherwise.
        loss_mask: ``[N]`` bool, the member tokens (None: all). Non-member rows may hold anything,
            including ±inf / NaN; their gradient is exactly zero.
        student_temperature: ``T_s``, ``q = softmax(s / T_s)``.
        teacher_temperature: ``T_t``, ``p = softmax(t / T_t)``; for ``teacher_format="probs"``
            ``p ∝ t^(1/T_t)``.
        teacher_format: ``"logits"``, ``"logprobs"`` (treated as logits: re-normalised) or
            ``"probs"`` (exact zeros allowed).
        normalize: ``"token"`` divides the sum over members by the member count (at least 1),
            ``"position"`` by N, ``"sum"`` by 1. ``denominator`` (tensor or number) replaces the
            token / position count, e.g. a global token count shared by micro-batches.
        chunk_size: tokens per chunk (default: ``threads · 2**18 // V`` on CPU, 1 MiB of float32
            per buffer and thread; ``2**26 // V`` on CUDA).
        impl: ``"eager"`` (fused ``log_softmax`` plus in-place float32 ops, ~5 ``[chunk, V]``
            buffers), ``"compiled"`` (the same core under ``torch.compile(dynamic=True)``: fused,
            out-of-place after functionalisation, one graph for every N) or None, the default:
            ``"eager"`` on CPU, ``"compiled"`` on CUDA. Measured on CPU (docs/benchmarks.md,
            "Distillation (CPU)"): both hold the same memory (the gradient plus < 2 % scratch) and
            compiled runs 1.23-1.29x faster once compiled, but its first call per loss
            configuration (kind, temperatures, teacher format and β are compile-time constants)
            compiles for tens of seconds on a small CPU, which outweighs that gain in the CPU uses
            of this library (tests, small runs). On CUDA (not yet measured), fusing the ~12 passes per
            block into a few kernels saves memory bandwidth, which is what bounds this loss there.

    Returns:
        A 0-d float32 tensor (float64 for float64 logits). Peak memory beyond the inputs: the
        ``[N, V]`` gradient in the logits' dtype plus ``O(chunk × V)`` float32 scratch.
    """


def reverse_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    *,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    teacher_format: TeacherFormat = "logits",
    normalize: Normalize = "token",
    denominator: torch.Tensor | float | None = None,
    chunk_size: int | None = None,
    impl: Impl | None = None,
) -> torch.Tensor:
    return _distill(
        "reverse_kl", student_logits, teacher_logits, loss_mask,
        student_temperature=student_temperature, teacher_temperature=teacher_temperature,
        teacher_format=teacher_format, beta=1.0, normalize=normalize, denominator=denominator,
        chunk_size=chunk_size, impl=impl,
    )  # fmt: skip


def forward_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    *,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    teacher_format: TeacherFormat = "logits",
    normalize: Normalize = "token",
    denominator: torch.Tensor | float | None = None,
    chunk_size: int | None = None,
    impl: Impl | None = None,
) -> torch.Tensor:
    return _distill(
        "forward_kl", student_logits, teacher_logits, loss_mask,
        student_temperature=student_temperature, teacher_temperature=teacher_temperature,
        teacher_format=teacher_format, beta=0.0, normalize=normalize, denominator=denominator,
        chunk_size=chunk_size, impl=impl,
    )  # fmt: skip


def jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    teacher_format: TeacherFormat = "logits",
    normalize: Normalize = "token",
    denominator: torch.Tensor | float | None = None,
    chunk_size: int | None = None,
    impl: Impl | None = None,
) -> torch.Tensor:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    return _distill(
        "jsd", student_logits, teacher_logits, loss_mask,
        student_temperature=student_temperature, teacher_temperature=teacher_temperature,
        teacher_format=teacher_format, beta=beta, normalize=normalize, denominator=denominator,
        chunk_size=chunk_size, impl=impl,
    )  # fmt: skip


def soft_cross_entropy(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    *,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    teacher_format: TeacherFormat = "logits",
    normalize: Normalize = "token",
    denominator: torch.Tensor | float | None = None,
    chunk_size: int | None = None,
    impl: Impl | None = None,
) -> torch.Tensor:
    return _distill(
        "soft_cross_entropy", student_logits, teacher_logits, loss_mask,
        student_temperature=student_temperature, teacher_temperature=teacher_temperature,
        teacher_format=teacher_format, beta=0.0, normalize=normalize, denominator=denominator,
        chunk_size=chunk_size, impl=impl,
    )  # fmt: skip


reverse_kl.__doc__ = (
    """Reverse KL ``KL(q‖p) = Σ_v q (log q − log p)`` per member token, normalised.

    Gradient: ``∂/∂s = q (log q − log p − KL) / T_s`` (see :func:`_reverse_kl_grad`).
"""
    + _COMMON_DOC
)
forward_kl.__doc__ = (
    """Forward KL ``KL(p‖q) = Σ_v p (log p − log q)`` per member token, normalised.

    Gradient: ``∂/∂s = (q − p) / T_s`` (see :func:`_q_minus_p_grad`).
"""
    + _COMMON_DOC
)
jsd.__doc__ = (
    """Generalised JSD ``β KL(p‖m) + (1 − β) KL(q‖m)``, ``m = β p + (1 − β) q``, per member token.

    GKD / TRL convention: ``beta=0`` is forward KL, ``beta=1`` reverse KL (the limits of the
    divergence divided by ``β`` resp. ``1 − β``; strictly inside (0, 1) it is not rescaled).
    Gradient: ``∂/∂s = (1 − β) q (log q − log m − KL(q‖m)) / T_s`` (see :func:`_jsd_grad`).
"""
    + _COMMON_DOC
)
soft_cross_entropy.__doc__ = (
    """Soft cross-entropy ``−Σ_v p log q`` per member token, normalised (forward KL + H(p)).

    Gradient: ``∂/∂s = (q − p) / T_s`` (see :func:`_q_minus_p_grad`).
"""
    + _COMMON_DOC
)
