"""Full-vocabulary distillation from logits: per-token reverse KL, forward KL, JSD(β) and soft
cross-entropy ``[N]`` (0 off the members), with the gradient computed in the forward chunk by chunk and
one saved ``[N, V]`` gradient. Formulas, memory, edge cases: ``docs/distill.md``."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from packloss.core import checks
from packloss.core.dtypes import compute_dtype
from packloss.vocab import core as chunks
from packloss.vocab.core import ChunkRun, DivergenceSpec, Impl, TeacherFormat, VocabParallel
from packloss.vocab.first_order import first_order

__all__ = ["divergence", "reverse_kl", "forward_kl", "jsd", "soft_cross_entropy"]


def _scale_rows(rows: Tensor, factor: Tensor, out: Tensor | None = None) -> None:
    """``rows · factor[:, None]`` computed in the dtype of ``factor`` (the compute dtype) and written to
    ``out``, or back into ``rows`` when ``out`` is None; ``rows``, ``out``: ``[c, V]``, ``factor``: ``[c]``."""
    target = rows if out is None else out
    if rows.dtype != factor.dtype:
        target.copy_(rows.to(factor.dtype).mul_(factor[:, None]))  # [c, V] compute-dtype scratch
    elif out is None:
        rows.mul_(factor[:, None])
    else:
        torch.mul(rows, factor[:, None], out=out)


class _PerToken(torch.autograd.Function):
    """Forward: per-token losses ``[N]`` and the per-token gradients, chunk by chunk; saves only the
    ``[N, V]`` gradient. Backward: rows scaled by ``grad_output``, in place unless the graph is kept."""

    @staticmethod
    def forward(ctx, student: Tensor, teacher: Tensor, mask: Tensor | None, run: ChunkRun) -> Tensor:
        n = student.shape[0]
        grad = torch.empty_like(student) if ctx.needs_input_grad[0] else None  # [N, V], logits dtype
        loss = torch.empty(n, dtype=compute_dtype(student.dtype), device=student.device)  # [N]
        for start, stop in chunks.chunk_ranges(n, run.rows):
            m_c = None if mask is None else mask[start:stop]  # [c]
            out = None if grad is None else grad[start:stop]  # [c, V]
            loss[start:stop], _ = chunks.chunk_core(student[start:stop], teacher[start:stop], m_c, None, run, out=out)
        if grad is not None:
            ctx.save_for_backward(grad, mask)
            ctx.rows = run.rows
        return loss

    @staticmethod
    @first_order("divergence")
    def backward(ctx, grad_output: Tensor):
        grad, mask = ctx.saved_tensors
        g = grad_output if mask is None else torch.where(mask, grad_output, 0.0)  # [N]; no 0 · NaN rows
        out = torch.empty_like(grad) if chunks.graph_is_kept() else None  # [N, V], or scale in place
        for start, stop in chunks.chunk_ranges(grad.shape[0], ctx.rows):
            _scale_rows(grad[start:stop], g[start:stop], None if out is None else out[start:stop])
        return (grad if out is None else out), None, None, None


def _check_logits(student: object, teacher: object) -> None:
    for name, x in (("student_logits", student), ("teacher_logits", teacher)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
    if student.dim() != 2 or student.shape != teacher.shape:
        raise ValueError(
            f"student and teacher logits must both be [N, V], got {tuple(student.shape)} and {tuple(teacher.shape)}"
        )
    if student.shape[1] == 0:
        raise ValueError(f"student_logits must have a vocabulary of V >= 1 entries, got {tuple(student.shape)}")
    checks.same_device("student_logits", student.device, teacher_logits=teacher)


def _check_mask(loss_mask: object, n: int, device: torch.device) -> Tensor | None:
    """``loss_mask`` as an ``[N]`` bool tensor on ``device`` (None stays None: every token is a member)."""
    if loss_mask is None:
        return None
    if not isinstance(loss_mask, Tensor):
        raise TypeError(f"loss_mask must be a torch.Tensor or None, got {type(loss_mask).__name__}")
    if loss_mask.shape != (n,):
        raise ValueError(f"loss_mask must be [N] = [{n}], got {tuple(loss_mask.shape)}")
    checks.mask_dtype("loss_mask", loss_mask)
    checks.same_device("student_logits", device, loss_mask=loss_mask)
    return loss_mask.to(torch.bool)


def divergence(
    kind: str,
    student_logits: Tensor,
    teacher_logits: Tensor,
    loss_mask: Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    teacher_format: TeacherFormat = "logits",
    chunk_size: int | None = None,
    impl: Impl | None = None,
    parallel: VocabParallel | None = None,
) -> Tensor:
    """Per-token divergence ``L_t`` of ``kind`` between ``q = softmax(s / T)`` and ``p = softmax(t / T_t)``.

    Args:
        kind: a key of :data:`~packloss.vocab.core.DIVERGENCES` (``"reverse_kl"``, ``"forward_kl"``,
            ``"soft_cross_entropy"``, ``"jsd"``).
        student_logits: ``[N, V]`` float (fp32 / bf16 / fp16 / fp64); the gradient flows to it.
        teacher_logits: ``[N, V]``, no gradient; logits unless ``teacher_format`` says otherwise.
        loss_mask: ``[N]`` bool, the member tokens (None: all). Non-member rows may hold anything,
            including ±inf / NaN: their loss is 0 and their gradient exactly zero.
        beta: ``β`` of JSD in [0, 1] (``0``: forward KL, ``1``: reverse KL); ignored by other kinds.
        temperature: ``T``, ``q = softmax(s / T)``.
        teacher_temperature: ``T_t``, ``p = softmax(t / T_t)``; for ``teacher_format="probs"``
            ``p ∝ t^(1/T_t)``.
        teacher_format: ``"logits"``, ``"logprobs"`` (treated as logits: re-normalised) or
            ``"probs"`` (exact zeros allowed).
        chunk_size: tokens per chunk (default :func:`~packloss.vocab.core.chunk_rows` of ``V``:
            ``threads · 2**18 // V`` on CPU, 1 MiB of float32 per buffer and thread; ``2**26 // V``
            on CUDA).
        impl: ``"eager"`` (fused ``log_softmax`` plus in-place float32 ops, ~5 ``[chunk, V]``
            buffers), ``"compiled"`` (the same core under ``torch.compile(dynamic=True)``: fused,
            out-of-place after functionalisation, one graph for every N) or None, the default:
            ``"eager"`` on CPU, ``"compiled"`` on CUDA. Measured on CPU (docs/benchmarks.md,
            "Distillation (CPU)"): both hold the same memory (the gradient plus < 2 % scratch) and
            compiled runs 1.23-1.29x faster once compiled, but its first call per loss
            configuration (kind, temperatures, teacher format and β are compile-time constants)
            compiles for tens of seconds on a small CPU. On CUDA (not yet measured), fusing the ~12
            passes per block into a few kernels saves memory bandwidth, which bounds this loss there.
        parallel: :class:`~packloss.vocab.core.VocabParallel` when ``student_logits`` and
            ``teacher_logits`` are this rank's vocabulary shard ``[N, V_local]`` (shards of any sizes).
            Per chunk it all-reduces ``[2, C]`` (MAX), ``[2, C]`` (SUM) and ``[k, C]`` (SUM); the
            losses are the full-vocabulary ones on every rank, the gradient this shard's columns.

    Returns:
        ``[N]`` float32 (float64 for float64 logits), differentiable w.r.t. ``student_logits``. Peak
        memory beyond the inputs: the ``[N, V]`` gradient in the logits' dtype plus ``O(chunk × V)``
        float32 scratch.
    """
    spec = DivergenceSpec(kind, beta, temperature, teacher_temperature, teacher_format)
    _check_logits(student_logits, teacher_logits)
    n, v = student_logits.shape
    device = student_logits.device
    mask = _check_mask(loss_mask, n, device)
    run = ChunkRun(
        spec,
        chunks.chunk_rows(v, device, chunk_size),
        chunks.resolve_impl(impl, device),
        chunks.check_parallel(parallel),
    )
    return _PerToken.apply(student_logits, teacher_logits.detach(), mask, run)


def _named(kind: str, doc: str) -> Callable[..., Tensor]:
    """:func:`divergence` of one ``kind``, with its signature (``beta`` only for JSD)."""

    def fn(student_logits: Tensor, teacher_logits: Tensor, loss_mask: Tensor | None = None, **options) -> Tensor:
        if "beta" in options and kind != "jsd":
            raise TypeError(f"{kind}() got an unexpected keyword argument 'beta'")
        return divergence(kind, student_logits, teacher_logits, loss_mask, **options)

    params = [p for name, p in _SIGNATURE.parameters.items() if name != "kind" and (name != "beta" or kind == "jsd")]
    fn.__name__ = fn.__qualname__ = kind
    fn.__doc__ = doc + " Arguments: :func:`divergence`."
    fn.__signature__ = _SIGNATURE.replace(parameters=params)  # type: ignore[attr-defined]
    return fn


_SIGNATURE = inspect.signature(divergence)

reverse_kl = _named(
    "reverse_kl",
    """Per-token reverse KL ``KL(q‖p) = Σ_v q (log q − log p)``, ``[N]``; gradient
    ``∂L/∂s = q (log q − log p − KL) / T``.""",
)
forward_kl = _named(
    "forward_kl",
    """Per-token forward KL ``KL(p‖q) = Σ_v p (log p − log q)``, ``[N]``; gradient
    ``∂L/∂s = (q − p) / T``.""",
)
jsd = _named(
    "jsd",
    """Per-token generalised JSD ``β KL(p‖m) + (1 − β) KL(q‖m)``, ``m = β p + (1 − β) q``,
    ``[N]`` (GKD / TRL convention: ``beta=0`` is forward KL, ``beta=1`` reverse KL, the limits of the divergence
    divided by ``β`` resp. ``1 − β``); gradient ``∂L/∂s = (1 − β) q (log q − log m − KL(q‖m)) / T``.""",
)
soft_cross_entropy = _named(
    "soft_cross_entropy",
    """Per-token soft cross-entropy ``−Σ_v p log q`` (forward KL
    + H(p)), ``[N]``; gradient ``∂L/∂s = (q − p) / T``.""",
)
