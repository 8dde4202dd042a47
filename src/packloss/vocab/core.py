"""The vocabulary core shared by :mod:`packloss.vocab.distill` (from logits) and
:mod:`packloss.vocab.head` (from hidden states): one chunk policy, one vocab-parallel options object
(:class:`VocabParallel`), one divergence registry (:data:`DIVERGENCES`: a divergence is its per-chunk
partial sums and its gradient) and one per-chunk kernel, in float32 whatever the input dtype. The
three stages, the vocab-parallel collectives and the chunk budgets: ``docs/distill.md``."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from packloss.core import checks
from packloss.core.dtypes import compute_dtype

__all__ = [
    "ChunkBudget", "ChunkRun", "DIVERGENCES", "Divergence", "DivergenceSpec", "ELEMENTWISE", "HEAD_BLOCK", "MATMUL",
    "VocabParallel", "chunk_core", "chunk_divergence", "chunk_ranges", "chunk_rows", "compiled_chunk",
    "gradient_buffer", "graph_is_kept", "log_probs", "masked_chunk", "mm_into", "resolve", "resolve_impl",
]  # fmt: skip

TeacherFormat = Literal["logits", "logprobs", "probs"]
Impl = Literal["eager", "compiled"]
TEACHER_FORMATS = ("logits", "logprobs", "probs")
IMPLS = ("eager", "compiled")
# The default implementation per device type; the measurements behind it: the ``impl`` argument of
# :func:`packloss.vocab.distill.divergence`.
_DEFAULT_IMPL: dict[str, Impl] = {"cpu": "eager", "cuda": "compiled"}


# ---------------------------------------------------------------------------------------------------
# Options and validation
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VocabParallel:
    """Vocab-parallel options: the LM head (or the logits) of this rank is a contiguous shard of the
    vocabulary, split over the ranks of ``group``.

    Args:
        group: a ``torch.distributed`` process group (e.g. ``dist.group.WORLD``).
        vocab_start: global id of this shard's first row, used only to look labels up
            (:func:`~packloss.vocab.head.linear_logprobs`). Default ``None``: the shards are placed in
            rank order from their sizes, found by one SUM all-reduce of ``[world_size]`` integers per
            call (uneven shards work; pass ``vocab_start`` to skip that collective).
    """

    group: object
    vocab_start: int | None = None

    def __post_init__(self) -> None:
        if self.group is None:
            raise TypeError("VocabParallel.group must be a torch.distributed process group; use parallel=None instead")
        start = self.vocab_start
        if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 0):
            raise ValueError(f"vocab_start must be a non-negative int or None, got {start!r}")

    def start(self, v_local: int, device: torch.device) -> int | Tensor:
        """Global id of this rank's first vocabulary row: ``vocab_start``, or a 0-d int64 tensor on
        ``device`` (the sum of the lower ranks' shard sizes, read by an all-reduce, no host sync)."""
        if self.vocab_start is not None:
            return self.vocab_start
        rank = dist.get_rank(self.group)
        sizes = torch.zeros(dist.get_world_size(self.group), dtype=torch.int64, device=device)  # [R]
        sizes[rank] = v_local
        dist.all_reduce(sizes, group=self.group)
        return sizes[:rank].sum()


def check_parallel(parallel: object) -> VocabParallel | None:
    if parallel is not None and not isinstance(parallel, VocabParallel):
        raise TypeError(f"parallel must be a VocabParallel or None, got {type(parallel).__name__}")
    return parallel


def check_positive_int(name: str, value: object) -> int:
    return checks.integer(name, value, minimum=1)


def check_temperature(name: str, value: object) -> float:
    """``value`` as a float, finite and > 0 (NaN fails)."""
    return checks.positive(name, value)


def check_beta(value: object) -> float:
    value = checks.number("beta", value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {value}")
    return value


def check_teacher_format(value: object) -> TeacherFormat:
    if value not in TEACHER_FORMATS:
        raise ValueError(f"teacher_format must be one of {TEACHER_FORMATS}, got {value!r}")
    return value


def check_kind(kind: object) -> str:
    if not isinstance(kind, str) or kind not in DIVERGENCES:
        raise ValueError(f"kind must be one of {sorted(DIVERGENCES)}, got {kind!r}")
    return kind


def resolve_impl(impl: object, device: torch.device) -> Impl:
    """``impl``, or the device's default (``"eager"`` on CPU, ``"compiled"`` elsewhere) for None."""
    if impl is None:
        return _DEFAULT_IMPL.get(device.type, "compiled")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    return impl


@dataclass(frozen=True)
class DivergenceSpec:
    """The parameters of one divergence, validated: ``kind`` (a key of :data:`DIVERGENCES`), ``beta``
    (JSD, in [0, 1]), ``temperature`` ``T`` and ``teacher_temperature`` ``T_t`` (finite, > 0),
    ``teacher_format``."""

    kind: str
    beta: float = 0.5
    temperature: float = 1.0
    teacher_temperature: float = 1.0
    teacher_format: TeacherFormat = "logits"

    def __post_init__(self) -> None:
        check_kind(self.kind)
        object.__setattr__(self, "beta", check_beta(self.beta))
        object.__setattr__(self, "temperature", check_temperature("temperature", self.temperature))
        object.__setattr__(
            self, "teacher_temperature", check_temperature("teacher_temperature", self.teacher_temperature)
        )
        check_teacher_format(self.teacher_format)


# ---------------------------------------------------------------------------------------------------
# The chunk policy
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkBudget:
    """Elements of one ``[rows, width]`` float32 buffer: ``cpu_per_thread`` per intra-op thread on CPU,
    ``accelerator`` on any other device."""

    cpu_per_thread: int
    accelerator: int


# The three budgets and the measurements behind them: docs/distill.md, "Chunk budgets".
ELEMENTWISE = ChunkBudget(cpu_per_thread=2**18, accelerator=2**26)  # elementwise passes over [rows, V]
MATMUL = ChunkBudget(cpu_per_thread=2**22, accelerator=2**26)  # whole-vocabulary chunks feeding GEMMs
HEAD_BLOCK = ChunkBudget(cpu_per_thread=2**19, accelerator=2**26)  # the fused head's token × vocab blocks


def chunk_rows(
    width: int, device: torch.device, chunk_size: int | None = None, *, budget: ChunkBudget = ELEMENTWISE
) -> int:
    """Rows per chunk of a ``[rows, width]`` block: ``chunk_size`` if given (a positive int, else a
    ``ValueError``), otherwise ``max(1, elements // width)`` with ``elements`` from ``budget``:
    ``cpu_per_thread · torch.get_num_threads()`` on CPU, ``accelerator`` elsewhere."""
    if chunk_size is not None:
        return check_positive_int("chunk_size", chunk_size)
    device = torch.device(device)
    elements = budget.cpu_per_thread * torch.get_num_threads() if device.type == "cpu" else budget.accelerator
    return max(1, elements // max(int(width), 1))


def chunk_ranges(total: int, rows: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive chunks of ``rows`` covering ``range(total)``."""
    for start in range(0, total, rows):
        yield start, min(start + rows, total)


def gradient_buffer(shape: torch.Size, blocks: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Storage for a gradient filled by :func:`mm_into`: left uninitialised when ``blocks > 0`` (the
    first block writes every row), zeros when no block will run (``N = 0``)."""
    return (torch.empty if blocks else torch.zeros)(shape, dtype=dtype, device=device)


def mm_into(dst: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """``dst = a @ b`` on the first block that reaches ``dst``, ``dst += a @ b`` after: a gradient
    accumulated block by block needs no zero-filled pass over it first."""
    if first:
        torch.mm(a, b, out=dst)
    else:
        dst.addmm_(a, b)


def graph_is_kept() -> bool:
    """Whether the running backward keeps the graph (``retain_graph=True``); True if unknown."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep_graph is None else keep_graph()


# ---------------------------------------------------------------------------------------------------
# Stage 1: log-probabilities over the whole vocabulary
# ---------------------------------------------------------------------------------------------------


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``x / T`` in the compute dtype; ``x`` itself (not copied, never modified) when that is a no-op."""
    x = x.to(compute_dtype(x.dtype))  # [c, V]
    return x if temperature == 1.0 else x / temperature


def _log_softmax(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(x / T)`` over the last dim in the compute dtype; ``x``: ``[c, V]``, unmodified."""
    dtype = compute_dtype(x.dtype)
    if temperature != 1.0:
        return torch.log_softmax(x.to(dtype).div(temperature), dim=-1)  # [c, V]
    return torch.log_softmax(x, dim=-1, dtype=dtype)  # [c, V]


def _teacher_logits(t: torch.Tensor, teacher_format: TeacherFormat) -> torch.Tensor:
    """``u`` with ``p = softmax(u / T_t)``: ``t`` itself for logits and log-probabilities (re-normalising
    is exact up to rounding), ``log t`` for probabilities (a zero gives ``log p = −inf``)."""
    if teacher_format == "probs":
        return t.to(compute_dtype(t.dtype)).log()  # [c, V]
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


def log_probs(
    s: torch.Tensor,
    t: torch.Tensor,
    temperature: float,
    teacher_temperature: float,
    teacher_format: TeacherFormat,
    group: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1: ``log q = log_softmax(s / T)`` and ``log p = log_softmax(u / T_t)`` (``u = t``, or
    ``log t`` for probabilities), ``[c, V]`` fresh buffers of the compute dtype that stage 2 may
    overwrite. Whole vocabulary: one fused ``log_softmax`` each; a vocabulary shard: the
    log-normalisers over ``group`` (MAX and SUM all-reduces of ``[2, c]``)."""
    u = _teacher_logits(t, teacher_format)  # [c, V]
    if group is None:
        return _log_softmax(s, temperature), _log_softmax(u, teacher_temperature)
    return _sharded_log_softmax(_scaled(s, temperature), _scaled(u, teacher_temperature), group)


# ---------------------------------------------------------------------------------------------------
# Stages 2 and 3: the divergences
# ---------------------------------------------------------------------------------------------------

State = tuple[Tensor, Tensor]  # two [c, V] buffers kept from stage 2 for stage 3
Sums = tuple[Tensor, State]  # the [k, c] partial sums and the state
LossGrad = tuple[Tensor, Tensor]  # the loss [c] and ∂L/∂s [c, V]
SumsFn = Callable[[Tensor, Tensor, float, TeacherFormat], Sums]
GradFn = Callable[[State, Tensor, float, float], LossGrad]


def reverse_kl_sums(log_q: Tensor, log_p: Tensor, beta: float, teacher_format: TeacherFormat) -> Sums:
    """Reverse KL ``L = Σ_v q (log q − log p)``: sums ``[L]`` (``[1, c]``), state ``(q, log q − log p)``.
    Terms with ``q = 0`` count 0 (a padded vocabulary: ``−inf − (−inf)``); a teacher zero where ``q > 0``
    gives ``L = +inf`` (the true value)."""
    diff = log_p.neg_().add_(log_q)  # [c, V], log q − log p
    q = log_q.exp_()  # [c, V]
    diff.masked_fill_(q == 0, 0.0)  # 0 · (anything) = 0, also in the gradient q (diff − L)
    return (q * diff).sum(-1)[None], (q, diff)


def reverse_kl_grad(state: State, sums: Tensor, beta: float, temperature: float) -> LossGrad:
    """Reverse-KL loss ``[c]`` and gradient ``[c, V]``. With ``a = s / T``, ``∂ log q_i/∂a_j = δ_ij − q_j``
    and ``∂q_i/∂a_j = q_i (δ_ij − q_j)``, so ``∂L/∂a_j = q_j (log q_j − log p_j − L)`` and::

        ∂L/∂s_j = q_j (log q_j − log p_j − L) / T
    """
    q, diff = state
    loss = sums[0]  # [c]
    grad = diff.sub_(loss.unsqueeze(-1)).mul_(q)  # [c, V]
    return loss, grad if temperature == 1.0 else grad.div_(temperature)


def forward_kl_sums(log_q: Tensor, log_p: Tensor, beta: float, teacher_format: TeacherFormat) -> Sums:
    """Forward KL ``L = Σ_v p (log p − log q)`` (terms with ``p = 0`` count 0): sums ``[L]``, state
    ``(log q, p)``."""
    p = log_p.exp()  # [c, V]
    term = log_p.sub_(log_q).mul_(p)  # [c, V], p (log p − log q)
    term.masked_fill_(p == 0, 0.0)  # log p = −inf where p = 0 (any teacher format): 0 · (−inf) counts 0
    return term.sum(-1)[None], (log_q, p)


def soft_cross_entropy_sums(log_q: Tensor, log_p: Tensor, beta: float, teacher_format: TeacherFormat) -> Sums:
    """Soft cross-entropy ``L = −Σ_v p log q`` (forward KL + H(p)), terms with ``p = 0`` counting 0 (a
    padded vocabulary has ``log q = −inf`` there): sums ``[L]``, state ``(log q, p)``."""
    p = log_p.exp_()  # [c, V]
    term = (p * log_q).masked_fill_(p == 0, 0.0)  # [c, V]
    return term.sum(-1).neg_()[None], (log_q, p)


def q_minus_p_grad(state: State, sums: Tensor, beta: float, temperature: float) -> LossGrad:
    """Forward-KL and soft-cross-entropy loss ``[c]`` and gradient ``[c, V]``: both are ``−Σ_i p_i log q_i``
    up to a constant in ``s``, ``∂(−Σ_i p_i log q_i)/∂a_j = −p_j + q_j Σ_i p_i`` and ``Σ p = 1``, so::

        ∂L/∂s_j = (q_j − p_j) / T
    """
    log_q, p = state
    grad = log_q.exp_().sub_(p)  # [c, V], q − p
    return sums[0], grad if temperature == 1.0 else grad.div_(temperature)


def jsd_sums(log_q: Tensor, log_p: Tensor, beta: float, teacher_format: TeacherFormat) -> Sums:
    """Generalised Jensen–Shannon divergence, ``0 < β < 1`` (GKD, Agarwal et al. 2024; TRL)::

        m = β p + (1 − β) q,   L = β KL(p‖m) + (1 − β) KL(q‖m)

    ``log m`` is elementwise, so the sums are ``[KL(p‖m), KL(q‖m)]`` (``[2, c]``), the state
    ``(q, log q − log m)``; terms with ``p = 0`` (resp. ``q = 0``) count 0."""
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))  # [c, V]
    p = log_p.exp()  # [c, V]
    term_p = log_p.sub_(log_m).mul_(p).masked_fill_(p == 0, 0.0)  # [c, V], p (log p − log m); 0 · (−inf) = 0
    diff = log_m.neg_().add_(log_q)  # [c, V], log q − log m
    q = log_q.exp_()  # [c, V]
    diff.masked_fill_(q == 0, 0.0)  # padded vocabulary: −inf − (−inf)
    return torch.stack([term_p.sum(-1), (q * diff).sum(-1)]), (q, diff)


def jsd_grad(state: State, sums: Tensor, beta: float, temperature: float) -> LossGrad:
    """JSD loss ``β KL(p‖m) + (1 − β) KL(q‖m)`` ``[c]`` and gradient ``[c, V]``. Treating ``q`` as free,
    ``∂L/∂q_i = (1 − β)(log q_i − log m_i)``: the ``∂ log m`` terms sum to ``−(1 − β)`` and cancel the
    ``+(1 − β)`` of ``∂(q log q)``. Through the softmax::

        ∂L/∂s_j = (1 − β) q_j (log q_j − log m_j − KL(q‖m)) / T

    i.e. the reverse-KL gradient against ``m``, scaled by ``1 − β``."""
    q, diff = state
    kl_q = sums[1]  # [c], KL(q‖m)
    loss = beta * sums[0] + (1.0 - beta) * kl_q  # [c]
    grad = diff.sub_(kl_q.unsqueeze(-1)).mul_(q).mul_((1.0 - beta) / temperature)  # [c, V]
    return loss, grad


@dataclass(frozen=True)
class Divergence:
    """A divergence of the registry, as its stages 2 and 3 over one ``[c, V]`` block (compute dtype):

    * ``sums(log_q, log_p, beta, teacher_format) -> (sums [k, c], state)``: per-token partial sums
      over the block (summed over the vocabulary shards when vocab-parallel) and the ``[c, V]`` state
      of the gradient; it may overwrite ``log_q`` and ``log_p``;
    * ``grad(state, sums, beta, temperature) -> (loss [c], ∂L/∂s [c, V])`` from the complete sums; it
      may overwrite the state.
    """

    sums: SumsFn
    grad: GradFn


DIVERGENCES: dict[str, Divergence] = {
    "reverse_kl": Divergence(reverse_kl_sums, reverse_kl_grad),
    "forward_kl": Divergence(forward_kl_sums, q_minus_p_grad),
    "soft_cross_entropy": Divergence(soft_cross_entropy_sums, q_minus_p_grad),
    "jsd": Divergence(jsd_sums, jsd_grad),
}


def resolve(kind: str, beta: float) -> Divergence:
    """The registry entry of ``kind``; JSD at ``β = 0`` is forward KL and at ``β = 1`` reverse KL (the
    limits of ``L/β`` and ``L/(1 − β)``)."""
    if kind == "jsd" and beta in (0.0, 1.0):
        return DIVERGENCES["forward_kl" if beta == 0.0 else "reverse_kl"]
    return DIVERGENCES[check_kind(kind)]


# ---------------------------------------------------------------------------------------------------
# The per-chunk kernel
# ---------------------------------------------------------------------------------------------------


def _block_divergence(
    kind: str,
    s: torch.Tensor,
    t: torch.Tensor,
    beta: float,
    temperature: float,
    teacher_temperature: float,
    teacher_format: TeacherFormat,
    group: object | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    entry = resolve(kind, beta)
    log_q, log_p = log_probs(s, t, temperature, teacher_temperature, teacher_format, group)  # [c, V] each
    sums, state = entry.sums(log_q, log_p, beta, teacher_format)  # [k, c], block buffers
    if group is not None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return entry.grad(state, sums, beta, temperature)


def chunk_divergence(
    kind: str,
    s: torch.Tensor,
    t: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    teacher_format: TeacherFormat = "logits",
    parallel: VocabParallel | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss ``[c]`` and ``∂L/∂s`` ``[c, V]`` of one block, in the compute dtype, unmasked.

    ``s``, ``t``: ``[c, V]`` student / teacher blocks (never modified). With ``parallel`` they are this
    rank's vocabulary shard of the rows; the loss is then the full-vocabulary one on every rank and
    the gradient this shard's columns. Communication: MAX and SUM all-reduces of ``[2, c]`` (stage 1)
    and one SUM of the ``[k, c]`` sums (k = 2 for JSD strictly inside (0, 1), else 1).
    """
    group = None if parallel is None else parallel.group
    return _block_divergence(kind, s, t, beta, temperature, teacher_temperature, teacher_format, group)


def masked_chunk(
    s: torch.Tensor,
    t: torch.Tensor,
    mask: torch.Tensor | None,
    coef: torch.Tensor | None,
    kind: str,
    beta: float,
    temperature: float,
    teacher_temperature: float,
    teacher_format: TeacherFormat,
    out: torch.Tensor | None = None,
    group: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk end to end: per-token losses ``L [c]`` (0 off the members) and the rows
    ``c_t · ∂L_t/∂s_t`` (``coef`` None: ``c_t = 1``), exactly zero off the members whatever those
    rows hold, cast to ``s.dtype``.

    ``mask``: ``[c]`` bool or None (all members); ``coef``: ``[c]`` compute dtype or None. With ``out``
    (``[c, V]``, ``s.dtype``, e.g. a slice of an ``[N, V]`` gradient) the gradient is written there and
    None is returned in its place (under ``torch.compile`` the write is part of the last fused kernel).
    """
    loss, grad = _block_divergence(kind, s, t, beta, temperature, teacher_temperature, teacher_format, group)
    if coef is not None:
        grad = grad.mul_(coef[:, None])  # [c, V]
    if mask is not None:
        loss = torch.where(mask, loss, 0.0)  # [c], drops whatever non-member rows produced
        grad = grad.masked_fill_(~mask[:, None], 0.0)  # [c, V]
    if out is None:
        return loss, grad.to(s.dtype)
    out.copy_(grad)  # cast to the logits' dtype
    return loss, None


@functools.cache
def compiled_chunk() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """:func:`masked_chunk` under ``torch.compile(dynamic=True)``: one graph for every chunk height and
    vocabulary size (no recompilation per N). Inductor functionalises the in-place ops, so this is the
    out-of-place program fused into a few kernels."""
    return torch.compile(masked_chunk, dynamic=True)


@dataclass(frozen=True)
class ChunkRun:
    """A chunked divergence: ``spec``, token ``rows`` per chunk, ``impl`` and the ``parallel`` options."""

    spec: DivergenceSpec
    rows: int
    impl: Impl = "eager"
    parallel: VocabParallel | None = None


def chunk_core(
    s: Tensor, t: Tensor, mask: Tensor | None, coef: Tensor | None, run: ChunkRun, *, out: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """:func:`masked_chunk` of ``run.spec`` on one chunk, eager or compiled, over ``run.parallel``'s group."""
    fn = compiled_chunk() if run.impl == "compiled" else masked_chunk
    group = None if run.parallel is None else run.parallel.group
    sp = run.spec
    return fn(
        s, t, mask, coef, sp.kind, sp.beta, sp.temperature, sp.teacher_temperature, sp.teacher_format,
        out=out, group=group,
    )  # fmt: skip
