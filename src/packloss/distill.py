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

Reusable per-chunk core (imported by the fused LM head, ``packloss.head``). Pure functions of one
``[c, V]`` block (any float dtype, never modified) with stable signatures::

    _chunk_reverse_kl(s, t, *, student_temperature=1.0, teacher_temperature=1.0, teacher_format="logits")
    _chunk_forward_kl(s, t, *, student_temperature=1.0, teacher_temperature=1.0, teacher_format="logits")
    _chunk_soft_cross_entropy(s, t, *, student_temperature=1.0, teacher_temperature=1.0,
                              teacher_format="logits")
    _chunk_jsd(s, t, *, beta, student_temperature=1.0, teacher_temperature=1.0, teacher_format="logits")
        -> (loss_per_token [c], grad_wrt_s [c, V]), both in the compute dtype (float32, or float64)

``_CHUNK_FNS`` maps the loss names to them. ``_chunk_core`` adds masking, ``1 / denominator``
scaling and the cast to the logits' dtype; it is the one core that the eager path runs and the
compiled path compiles.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

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
# Per-chunk pure math: [c, V] blocks in, (loss [c], gradient [c, V]) out, in the compute dtype.
# ---------------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for fp32 / bf16 / fp16, float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _log_softmax(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(x / T)`` over the last dim in the compute dtype; ``x``: ``[c, V]``, unmodified."""
    dtype = _compute_dtype(x.dtype)
    if temperature != 1.0:
        return torch.log_softmax(x.to(dtype).div(temperature), dim=-1)  # [c, V]
    return torch.log_softmax(x, dim=-1, dtype=dtype)  # [c, V]


def _teacher_log_probs(t: torch.Tensor, temperature: float, teacher_format: TeacherFormat) -> torch.Tensor:
    """``log p = log_softmax(u / T_t)`` with ``u = t`` for logits and log-probabilities (re-normalising
    is exact up to rounding) and ``u = log t`` for probabilities (a zero gives ``log p = −inf``)."""
    if teacher_format == "probs":
        t = t.to(_compute_dtype(t.dtype)).log()  # [c, V]
    elif teacher_format not in ("logits", "logprobs"):
        raise ValueError(f"teacher_format must be 'logits', 'logprobs' or 'probs', got {teacher_format!r}")
    return _log_softmax(t, temperature)  # [c, V]


def _chunk_reverse_kl(
    s: torch.Tensor,
    t: torch.Tensor,
    *,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    teacher_format: TeacherFormat = "logits",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reverse KL of one block: ``L = Σ_v q (log q − log p)``.

    Gradient, with ``a = s / T_s``, ``∂ log q_i / ∂a_j = δ_ij − q_j`` and ``∂q_i/∂a_j = q_i (δ_ij − q_j)``:
    ``∂L/∂a_j = q_j (log q_j − log p_j) − q_j L + Σ_i q_i (δ_ij − q_j) = q_j (log q_j − log p_j − L)``,
    so::

        ∂L/∂s_j = q_j (log q_j − log p_j − L) / T_s

    ``s``, ``t``: ``[c, V]``. Returns ``(L [c], ∂L/∂s [c, V])``. A teacher with exact zero
    probabilities where ``q > 0`` gives ``L = +inf`` (the true value).
    """
    log_q = _log_softmax(s, student_temperature)  # [c, V]
    diff = log_q - _teacher_log_probs(t, teacher_temperature, teacher_format)  # [c, V], log q − log p
    q = log_q.exp_()  # [c, V]
    loss = (q * diff).sum(-1)  # [c]
    grad = diff.sub_(loss.unsqueeze(-1)).mul_(q)  # [c, V]
    if student_temperature != 1.0:
        grad.div_(student_temperature)
    return loss, grad


def _chunk_forward_kl(
    s: torch.Tensor,
    t: torch.Tensor,
    *,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    teacher_format: TeacherFormat = "logits",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward KL of one block: ``L = Σ_v p (log p − log q)`` (terms with ``p = 0`` are 0).

    Gradient (``L = Σ p log p − Σ p log q``, ``∂(−Σ_i p_i log q_i)/∂a_j = −p_j + q_j Σ_i p_i``,
    ``Σ p = 1``)::

        ∂L/∂s_j = (q_j − p_j) / T_s

    ``s``, ``t``: ``[c, V]``. Returns ``(L [c], ∂L/∂s [c, V])``.
    """
    log_q = _log_softmax(s, student_temperature)  # [c, V]
    log_p = _teacher_log_probs(t, teacher_temperature, teacher_format)  # [c, V]
    p = log_p.exp()  # [c, V]
    term = p * log_p.sub_(log_q)  # [c, V], p (log p − log q)
    if teacher_format == "probs":  # log p = −inf where p = 0: 0 · (−inf) must count 0
        term = torch.where(p > 0, term, 0.0)
    grad = log_q.exp_().sub_(p)  # [c, V], q − p
    if student_temperature != 1.0:
        grad.div_(student_temperature)
    return term.sum(-1), grad


def _chunk_soft_cross_entropy(
    s: torch.Tensor,
    t: torch.Tensor,
    *,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    teacher_format: TeacherFormat = "logits",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft cross-entropy of one block: ``L = −Σ_v p log q`` (= forward KL + H(p)).

    Gradient (``∂L/∂a_j = −p_j + q_j Σ_i p_i`` and ``Σ p = 1``)::

        ∂L/∂s_j = (q_j − p_j) / T_s

    ``s``, ``t``: ``[c, V]``. Returns ``(L [c], ∂L/∂s [c, V])``.
    """
    log_q = _log_softmax(s, student_temperature)  # [c, V]
    p = _teacher_log_probs(t, teacher_temperature, teacher_format).exp_()  # [c, V]
    loss = -(p * log_q).sum(-1)  # [c]
    grad = log_q.exp_().sub_(p)  # [c, V], q − p
    if student_temperature != 1.0:
        grad.div_(student_temperature)
    return loss, grad


def _chunk_jsd(
    s: torch.Tensor,
    t: torch.Tensor,
    *,
    beta: float,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    teacher_format: TeacherFormat = "logits",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Jensen–Shannon divergence of one block (GKD, Agarwal et al. 2024; TRL)::

        m = β p + (1 − β) q,   L = β KL(p‖m) + (1 − β) KL(q‖m)        (0 < β < 1)

    ``β = 0`` is forward KL and ``β = 1`` reverse KL (the limits of ``L/β`` and ``L/(1 − β)``).

    Gradient. Treating ``q`` as free, ``∂L/∂q_i = (1 − β)(log q_i − log m_i)``: the ``∂ log m``
    terms sum to ``−(β p_i + (1 − β) q_i)(1 − β)/m_i = −(1 − β)`` and cancel the ``+(1 − β)`` from
    ``∂(q log q)``. Through the softmax (``∂q_i/∂a_j = q_i (δ_ij − q_j)``)::

        ∂L/∂s_j = (1 − β) q_j (log q_j − log m_j − KL(q‖m)) / T_s

    i.e. the reverse-KL gradient against ``m``, scaled by ``1 − β``.
    ``s``, ``t``: ``[c, V]``. Returns ``(L [c], ∂L/∂s [c, V])``.
    """
    kw = dict(
        student_temperature=student_temperature,
        teacher_temperature=teacher_temperature,
        teacher_format=teacher_format,
    )
    if beta == 0.0:
        return _chunk_forward_kl(s, t, **kw)
    if beta == 1.0:
        return _chunk_reverse_kl(s, t, **kw)
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    log_q = _log_softmax(s, student_temperature)  # [c, V]
    log_p = _teacher_log_probs(t, teacher_temperature, teacher_format)  # [c, V]
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))  # [c, V]
    p = log_p.exp()  # [c, V]
    term_p = p * log_p.sub_(log_m)  # [c, V], p (log p − log m)
    if teacher_format == "probs":  # 0 · (−inf) must count 0
        term_p = torch.where(p > 0, term_p, 0.0)
    diff = log_m.neg_().add_(log_q)  # [c, V], log q − log m
    q = log_q.exp_()  # [c, V]
    kl_q = (q * diff).sum(-1)  # [c], KL(q‖m)
    loss = beta * term_p.sum(-1) + (1.0 - beta) * kl_q  # [c]
    grad = diff.sub_(kl_q.unsqueeze(-1)).mul_(q).mul_((1.0 - beta) / student_temperature)  # [c, V]
    return loss, grad


_CHUNK_FNS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "reverse_kl": _chunk_reverse_kl,
    "forward_kl": _chunk_forward_kl,
    "soft_cross_entropy": _chunk_soft_cross_entropy,
    "jsd": _chunk_jsd,
}


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk end to end: ``scale · Σ_{members} L`` and ``scale · ∂L/∂s`` with exact zero rows
    for non-members, cast to ``s.dtype``.

    ``s``, ``t``: ``[c, V]`` slices of the caller's tensors (never modified); ``mask``: ``[c]`` bool
    or None (all members); ``scale``: 0-d tensor ``1 / denominator`` in the compute dtype. With
    ``out`` (``[c, V]``, ``s.dtype``, e.g. a slice of the ``[N, V]`` gradient) the gradient is
    written there and None is returned in its place (under ``torch.compile`` the write is part of
    the last fused kernel); without, it is returned.
    """
    kw = dict(
        student_temperature=student_temperature,
        teacher_temperature=teacher_temperature,
        teacher_format=teacher_format,
    )
    if kind == "jsd":
        kw["beta"] = beta
    loss, grad = _CHUNK_FNS[kind](s, t, **kw)  # [c], [c, V]
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

    Gradient: ``∂/∂s = q (log q − log p − KL) / T_s`` (see :func:`_chunk_reverse_kl`).
"""
    + _COMMON_DOC
)
forward_kl.__doc__ = (
    """Forward KL ``KL(p‖q) = Σ_v p (log p − log q)`` per member token, normalised.

    Gradient: ``∂/∂s = (q − p) / T_s`` (see :func:`_chunk_forward_kl`).
"""
    + _COMMON_DOC
)
jsd.__doc__ = (
    """Generalised JSD ``β KL(p‖m) + (1 − β) KL(q‖m)``, ``m = β p + (1 − β) q``, per member token.

    GKD / TRL convention: ``beta=0`` is forward KL, ``beta=1`` reverse KL (the limits of the
    divergence divided by ``β`` resp. ``1 − β``; strictly inside (0, 1) it is not rescaled).
    Gradient: ``∂/∂s = (1 − β) q (log q − log m − KL(q‖m)) / T_s`` (see :func:`_chunk_jsd`).
"""
    + _COMMON_DOC
)
soft_cross_entropy.__doc__ = (
    """Soft cross-entropy ``−Σ_v p log q`` per member token, normalised (forward KL + H(p)).

    Gradient: ``∂/∂s = (q − p) / T_s`` (see :func:`_chunk_soft_cross_entropy`).
"""
    + _COMMON_DOC
)
