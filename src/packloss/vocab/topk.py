"""Top-k + tail distillation: a teacher known only by its top-k ids and log-probs (a teacher served
over the network), against the student over K + 1 buckets, the top-k ids and the tail (every other
id). Per-token forward KL, reverse KL and JSD(β) from logits (:func:`topk_divergence`) or from hidden
states (:func:`linear_topk_divergence`, no ``N × V`` tensor), and the engine component
:class:`TopKDistill`; ``tail=False`` is verl's ``forward_kl_topk``. Formulas: ``docs/distill.md``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from packloss.core import checks
from packloss.core.bin import ComponentInputs, ComponentOutput, Objective, Plan
from packloss.core.dtypes import compute_dtype
from packloss.vocab.core import HEAD_BLOCK, check_beta, check_positive_int, check_temperature, chunk_ranges, chunk_rows
from packloss.vocab.first_order import first_order
from packloss.vocab.head import DEFAULT_VOCAB_CHUNK_SIZE, check_head
from packloss.vocab.topk_head import HeadBlocks, block_columns, head_topk_logits, mask_topk_

__all__ = ["TAIL_FLOOR", "TOPK_KINDS", "TopKDistill", "TopKDivergence", "TopKSpec", "linear_topk_divergence",
           "topk_divergence"]  # fmt: skip

TOPK_KINDS = ("forward_kl", "reverse_kl", "jsd")
TAIL_FLOOR = 1e-6
"""The default floor of the teacher's tail mass ``1 − Σ_k p_k``: about what float32 log-probs resolve of
a sum of K probabilities near 1, so below it the tail is rounding (and reverse KL's ``log p_tail``
stays bounded)."""
NEG_INF = -math.inf


@dataclass(frozen=True)
class TopKSpec:
    """The parameters of a top-k divergence, validated: ``kind`` (one of :data:`TOPK_KINDS`), ``beta`` (JSD,
    in [0, 1]), the student ``temperature`` (finite, > 0), ``tail`` (the tail bucket; False: verl's
    ``forward_kl_topk``, forward KL only), ``tail_floor`` (in (0, 1)) and ``log_prob_min_clamp`` (None or a
    finite number; ``tail=False`` only)."""

    kind: str = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    tail: bool = True
    tail_floor: float = TAIL_FLOOR
    log_prob_min_clamp: float | None = None

    def __post_init__(self) -> None:
        checks.choice("kind", self.kind, TOPK_KINDS)
        object.__setattr__(self, "beta", check_beta(self.beta))
        object.__setattr__(self, "temperature", check_temperature("temperature", self.temperature))
        checks.flag("tail", self.tail)
        floor = checks.positive("tail_floor", self.tail_floor)
        if floor >= 1.0:
            raise ValueError(f"tail_floor must be in (0, 1), got {floor}")
        object.__setattr__(self, "tail_floor", floor)
        if not self.tail and self.kind != "forward_kl":
            raise ValueError(f"tail=False is verl's forward_kl_topk, forward KL only; got kind={self.kind!r}")
        if self.log_prob_min_clamp is not None:
            if self.tail:
                raise ValueError("log_prob_min_clamp applies to tail=False (verl's clamp) only")
            object.__setattr__(self, "log_prob_min_clamp", checks.number("log_prob_min_clamp", self.log_prob_min_clamp))

    @property
    def resolved_kind(self) -> str:
        """``kind``, with JSD at ``β = 0`` forward KL and at ``β = 1`` reverse KL (as the full vocabulary's)."""
        if self.kind == "jsd" and self.beta in (0.0, 1.0):
            return "forward_kl" if self.beta == 0.0 else "reverse_kl"
        return self.kind


class TopKDivergence(NamedTuple):
    """Per-token results ``[N]``, 0 off the members: ``per_token`` the divergence ``ℓ_t`` (differentiable),
    ``student_tail`` ``q_tail`` (detached) and ``teacher_tail`` the mass ``1 − Σ_k p_k`` the teacher's ids
    leave (before ``tail_floor``; 0 when they cover the vocabulary)."""

    per_token: Tensor
    student_tail: Tensor
    teacher_tail: Tensor


# ---------------------------------------------------------------------------------------------------
# The student from logits
# ---------------------------------------------------------------------------------------------------


def _scaled_rows(logits: Tensor, mask: Tensor, t0: int, t1: int, inv_t: float, cdt: torch.dtype) -> Tensor:
    """``z / T`` of rows ``[t0, t1)`` in ``cdt``, a fresh buffer, zero off the members.  ``[c, V]``."""
    x = torch.where(mask[t0:t1, None], logits[t0:t1].to(cdt), 0.0)  # [c, V]
    return x if inv_t == 1.0 else x.mul_(inv_t)


class _TopKLogits(torch.autograd.Function):
    """Forward: ``(tail [N], picked [N, K])`` chunk by chunk; saves only ``[N]`` and ``[N, K]`` tensors (and
    the logits). Backward: the ``[N, V]`` gradient ``(g_tail · exp(x − tail) · [v ∉ top-k] + Σ_k g_k ·
    [v = id_k]) / T``, recomputed chunk by chunk."""

    @staticmethod
    def forward(ctx, logits, ids, present, mask, inv_t: float, rows: int):
        cdt = compute_dtype(logits.dtype)
        (n, v), k = logits.shape, ids.shape[1]
        tail = torch.empty(n, dtype=cdt, device=logits.device)  # [N]
        picked = torch.empty(n, k, dtype=cdt, device=logits.device)  # [N, K]
        for t0, t1 in chunk_ranges(n, rows):
            x = _scaled_rows(logits, mask, t0, t1, inv_t, cdt)  # [c, V]
            in_block, col = block_columns(ids[t0:t1], present[t0:t1], 0, v)
            picked[t0:t1] = torch.where(in_block, x.gather(1, col), 0.0)
            tail[t0:t1] = torch.logsumexp(mask_topk_(x, in_block, col), dim=1)
        ctx.save_for_backward(logits, ids, present, mask, tail)
        ctx.inv_t, ctx.rows = inv_t, rows
        return tail, picked

    @staticmethod
    @first_order("topk_divergence")
    def backward(ctx, g_tail, g_picked):
        logits, ids, present, mask, tail = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        v = logits.shape[1]
        g_t = torch.zeros_like(tail) if g_tail is None else torch.where(mask, g_tail, 0.0)  # [N]
        g_a = torch.zeros(ids.shape, dtype=tail.dtype, device=tail.device) if g_picked is None else g_picked
        g_a = torch.where(present, g_a, 0.0)  # [N, K]
        lt = torch.where(tail == NEG_INF, 0.0, tail)  # an empty tail: all its x are −inf, exp gives 0
        grad = torch.empty_like(logits)  # [N, V]
        for t0, t1 in chunk_ranges(logits.shape[0], ctx.rows):
            x = _scaled_rows(logits, mask, t0, t1, ctx.inv_t, tail.dtype)  # [c, V]
            in_block, col = block_columns(ids[t0:t1], present[t0:t1], 0, v)
            dx = mask_topk_(x, in_block, col).sub_(lt[t0:t1, None]).exp_().mul_(g_t[t0:t1, None])  # [c, V]
            dx.scatter_add_(1, col, torch.where(in_block, g_a[t0:t1], 0.0))
            grad[t0:t1] = dx if ctx.inv_t == 1.0 else dx.mul_(ctx.inv_t)
        return grad, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------
# The K + 1 buckets and the divergences over them
# ---------------------------------------------------------------------------------------------------


def _student_buckets(tail: Tensor, picked: Tensor, present: Tensor) -> Tensor:
    """``log q [N, K + 1]``: the top-k buckets' scaled logits and the tail's log-sum-exp, minus their own
    log-sum-exp, which is the whole vocabulary's ``log Z`` (a sum of positive terms: no cancellation);
    ``−inf`` for an absent id."""
    logits = torch.cat([picked.masked_fill(~present, NEG_INF), tail[:, None]], dim=1)  # [N, K + 1]
    return logits - torch.logsumexp(logits, dim=1, keepdim=True)


def _teacher_buckets(logprobs: Tensor, present: Tensor, empty_tail: Tensor, floor: float) -> tuple[Tensor, Tensor]:
    """``(log p [N, K + 1], rest [N])``: the present ids' log-probs (``−inf`` for an absent one) and
    ``log max(rest, floor)``, ``rest = 1 − Σ_k p_k`` (≥ 0); ``−inf`` and 0 where the tail has no id (the ids
    cover the vocabulary). ``rest = −expm1(m + log1p(r))`` with ``m`` the largest log-prob and
    ``r = Σ_{k ≠ max} exp(log p_k − m)``: ``log Σ_k p_k`` stays exact when one id holds nearly all the mass,
    where ``logsumexp``'s ``log(1 + r)`` would round ``r`` away."""
    lp = torch.where(present, logprobs, NEG_INF)  # [N, K]
    m, top = lp.max(dim=1)  # [N]
    ref = torch.where(m == NEG_INF, 0.0, m)  # [N], no id present: Σ p = 0
    r = torch.exp(lp - ref[:, None]).scatter(1, top[:, None], 0.0).sum(dim=1)  # [N]
    log_sum = (m + torch.log1p(r)).clamp_max(0.0)  # [N], log Σ_k p_k
    rest = torch.where(empty_tail, 0.0, torch.expm1(log_sum).neg_())  # [N], 1 − Σ_k p_k
    log_rest = torch.where(empty_tail, NEG_INF, rest.clamp_min(floor).log())  # [N]
    return torch.cat([lp, log_rest[:, None]], dim=1), rest


def _kl_terms(log_a: Tensor, log_b: Tensor, live: Tensor) -> Tensor:
    """``Σ_b a_b (log a_b − log b_b)`` over the ``live`` buckets with ``a_b > 0`` (``0 · log 0 = 0``); both
    logs are replaced where a term is dropped, so no ``−inf − (−inf)`` reaches the value or the gradient."""
    keep = live & (log_a > NEG_INF)  # [N, B]
    la, lb = torch.where(keep, log_a, 0.0), torch.where(keep, log_b, 0.0)
    return torch.where(keep, la.exp() * (la - lb), 0.0).sum(dim=1)  # [N]


def _bucket_divergence(spec: TopKSpec, log_q: Tensor, log_p: Tensor, present: Tensor) -> Tensor:
    """``ℓ [N]`` of ``spec`` over the buckets ``present [N, B]``: forward ``KL(p‖q)``, reverse ``KL(q‖p)`` or
    ``β KL(p‖m) + (1 − β) KL(q‖m)`` with ``m = β p + (1 − β) q``."""
    live = present & ((log_p > NEG_INF) | (log_q > NEG_INF))  # [N, B], a bucket with mass on a side
    kind = spec.resolved_kind
    if kind == "forward_kl":
        return _kl_terms(log_p, log_q, live)
    if kind == "reverse_kl":
        return _kl_terms(log_q, log_p, live)
    lp, lq = torch.where(live, log_p, 0.0), torch.where(live, log_q, 0.0)
    log_m = torch.logaddexp(lp + math.log(spec.beta), lq + math.log1p(-spec.beta))  # [N, B]
    return spec.beta * _kl_terms(log_p, log_m, live) + (1.0 - spec.beta) * _kl_terms(log_q, log_m, live)


def _verl_topk(spec: TopKSpec, log_q: Tensor, log_p: Tensor, present: Tensor) -> Tensor:
    """verl's ``forward_kl_topk``: ``max(0, Σ_k p̃_k (log p̃_k − log q̃_k))`` over the present top-k ids, no
    tail, ``log p̃ = max(log p, c)``, ``log q̃ = max(log q, c)`` with ``c = log_prob_min_clamp`` (None: none)."""
    lq, lp = log_q[:, :-1], log_p[:, :-1]  # [N, K]
    c = spec.log_prob_min_clamp
    if c is not None:
        lq, lp = lq.clamp_min(c), torch.where(present, lp.clamp_min(c), NEG_INF)
    return _kl_terms(lp, lq, present).clamp_min(0.0)


def _divergence(
    spec: TopKSpec, tail: Tensor, picked: Tensor, logprobs: Tensor, present: Tensor, mask: Tensor, v: int
) -> TopKDivergence:
    """The per-token results from the student's ``tail [N]`` and ``picked [N, K]`` and the teacher's
    ``logprobs [N, K]`` (compute dtype), over the ``present [N, K]`` ids of the ``mask [N]`` rows."""
    empty_tail = present.sum(dim=1) >= v  # [N], the top-k ids name every id (they are distinct)
    log_q = _student_buckets(tail, picked, present)  # [N, K + 1]
    log_p, p_tail = _teacher_buckets(logprobs, present, empty_tail, spec.tail_floor)  # [N, K + 1], [N]
    if spec.tail:
        buckets = torch.cat([present, (mask & ~empty_tail)[:, None]], dim=1)  # [N, K + 1]
        per_token = _bucket_divergence(spec, log_q, log_p, buckets)
    else:
        per_token = _verl_topk(spec, log_q, log_p, present)
    q_tail = log_q[:, -1].detach().exp()  # [N]
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    return TopKDivergence(*(torch.where(mask, x, zero) for x in (per_token, q_tail, p_tail)))


# ---------------------------------------------------------------------------------------------------
# The public functions
# ---------------------------------------------------------------------------------------------------


def _check_teacher(ids: object, logprobs: object, n: int, device: torch.device) -> None:
    checks.tensor("teacher_topk_ids", ids)
    checks.tensor("teacher_topk_logprobs", logprobs, floating=True)
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"teacher_topk_ids must be int32 or int64, got {ids.dtype}")
    if ids.dim() != 2 or ids.shape[0] != n or ids.shape != logprobs.shape:
        raise ValueError(
            f"teacher_topk_ids and teacher_topk_logprobs must both be [N, K] with N={n}, got "
            f"{list(ids.shape)} and {list(logprobs.shape)}"
        )
    if ids.shape[1] == 0:
        raise ValueError("teacher_topk_ids must hold K >= 1 ids per token, got K = 0")
    checks.same_device("the student", device, teacher_topk_ids=ids, teacher_topk_logprobs=logprobs)


def _prepare(ids: Tensor, logprobs: Tensor, loss_mask: Tensor | None, n: int, v: int, device, cdt):
    """``(ids [N, K] long, present [N, K], mask [N], logprobs [N, K] in cdt)``: an id is present when it
    is in ``[0, V)`` on a member row (−1 marks an absent one)."""
    if loss_mask is None:
        mask = torch.ones(n, dtype=torch.bool, device=device)
    else:
        checks.tensor("loss_mask", loss_mask, shape=(n,))
        checks.mask_dtype("loss_mask", loss_mask)
        checks.same_device("the student", device, loss_mask=loss_mask)
        mask = loss_mask.to(torch.bool)
    ids = ids.long()
    present = (ids >= 0) & (ids < v) & mask[:, None]  # [N, K]
    return ids, present, mask, logprobs.detach().to(cdt)


def topk_divergence(
    kind: str,
    student_logits: Tensor,
    teacher_topk_ids: Tensor,
    teacher_topk_logprobs: Tensor,
    loss_mask: Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    tail: bool = True,
    tail_floor: float = TAIL_FLOOR,
    log_prob_min_clamp: float | None = None,
    chunk_size: int | None = None,
) -> TopKDivergence:
    """Per-token top-k divergence ``ℓ_t`` between the teacher's top-k + tail buckets and the student's.

    With ``q = softmax(z / T)``, the buckets are the present ids ``id_k`` and the tail (every other id):
    ``q_k = q[id_k]``, ``log q_tail = logsumexp_{v ∉ top-k} z_v / T − logsumexp_v z_v / T``;
    ``p_k = exp(teacher_topk_logprobs_k)``, ``p_tail = max(1 − Σ_k p_k, tail_floor)`` (0 when the ids cover
    the vocabulary). ``kind``: ``"forward_kl"`` ``Σ_b p_b log(p_b / q_b)``, ``"reverse_kl"``
    ``Σ_b q_b log(q_b / p_b)``, ``"jsd"`` ``β KL(p‖m) + (1 − β) KL(q‖m)``, ``m = β p + (1 − β) q`` (β = 0
    forward, β = 1 reverse KL); terms with a zero weight count 0.

    Args:
        student_logits: ``[N, V]`` float; the gradient flows to it (one ``[N, V]`` tensor, in the backward).
        teacher_topk_ids: ``[N, K]`` int32/int64, distinct per row; ``-1`` (or any id outside ``[0, V)``)
            is absent: its bucket is dropped and its mass left to the tail.
        teacher_topk_logprobs: ``[N, K]`` the teacher's log-probs (no gradient), as served: no temperature.
        loss_mask: ``[N]`` bool members (None: all); other rows may hold anything, they give 0.
        tail: False: verl's ``forward_kl_topk`` (no tail bucket, the loss clamped at 0); forward KL only.
        log_prob_min_clamp: ``tail=False``: verl's clamp of both log-probs (its default config: ``-10.0``).
        chunk_size: tokens per chunk (default :func:`~packloss.vocab.core.chunk_rows` of ``V``).

    Returns:
        :class:`TopKDivergence` of ``[N]`` tensors in float32 (float64 for float64 logits).
    """
    spec = TopKSpec(kind, beta, temperature, tail, tail_floor, log_prob_min_clamp)
    checks.tensor("student_logits", student_logits, floating=True)
    if student_logits.dim() != 2 or student_logits.shape[1] == 0:
        raise ValueError(f"student_logits must be [N, V] with V >= 1, got {list(student_logits.shape)}")
    (n, v), device = student_logits.shape, student_logits.device
    _check_teacher(teacher_topk_ids, teacher_topk_logprobs, n, device)
    cdt = compute_dtype(student_logits.dtype)
    ids, present, mask, logprobs = _prepare(teacher_topk_ids, teacher_topk_logprobs, loss_mask, n, v, device, cdt)
    rows = chunk_rows(v, device, chunk_size)
    tail_lse, picked = _TopKLogits.apply(student_logits, ids, present, mask, 1.0 / spec.temperature, rows)
    return _divergence(spec, tail_lse, picked, logprobs, present, mask, v)


def linear_topk_divergence(
    kind: str,
    hidden: Tensor,
    weight: Tensor,
    teacher_topk_ids: Tensor,
    teacher_topk_logprobs: Tensor,
    loss_mask: Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    tail: bool = True,
    tail_floor: float = TAIL_FLOOR,
    log_prob_min_clamp: float | None = None,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
) -> TopKDivergence:
    """:func:`topk_divergence` of the student head ``z = h Wᵀ`` (``hidden [N, H]``, ``weight [V, H]``,
    bias-free), never holding ``N × V``: the tail's log-sum-exp is online over vocabulary blocks with the
    top-k ids masked out of each, and the backward recomputes the blocks. Memory ``O(N·H + V·H + N·K)`` plus
    one ``chunk_size × vocab_chunk_size`` block (defaults as :func:`~packloss.vocab.head.linear_logprobs`'s).
    Differentiable w.r.t. ``hidden`` and ``weight``; rows off ``loss_mask`` may hold NaN / inf."""
    spec = TopKSpec(kind, beta, temperature, tail, tail_floor, log_prob_min_clamp)
    check_head(hidden, weight)
    (n, v), device = (hidden.shape[0], weight.shape[0]), hidden.device
    _check_teacher(teacher_topk_ids, teacher_topk_logprobs, n, device)
    cdt = compute_dtype(hidden.dtype, weight.dtype)
    ids, present, mask, logprobs = _prepare(teacher_topk_ids, teacher_topk_logprobs, loss_mask, n, v, device, cdt)
    if vocab_chunk_size is None:
        vocab_chunk_size = DEFAULT_VOCAB_CHUNK_SIZE["cpu" if device.type == "cpu" else "accelerator"]
    cols = check_positive_int("vocab_chunk_size", vocab_chunk_size)
    blocks = HeadBlocks(chunk_rows(min(cols, v), device, chunk_size, budget=HEAD_BLOCK), cols)
    tail_lse, picked = head_topk_logits(hidden, weight, ids, present, mask, spec.temperature, blocks)
    return _divergence(spec, tail_lse, picked, logprobs, present, mask, v)


# ---------------------------------------------------------------------------------------------------
# The engine component
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopKDistill(Objective):
    """Top-k + tail distillation component: ``ℓ_t = D(p_t ‖ q_t)`` over the K + 1 buckets of
    :func:`topk_divergence` (the plan's ``teacher_topk_ids`` and the tail), ``p`` from the plan's
    ``teacher_topk_logprobs``, ``q`` from ``Outputs(logits=)`` or the fused ``Outputs(hidden=,
    head_weight=)``; the engine applies members, weights and normalisation (``Σ_t m_t w_t ℓ_t / d_t / D``).

    Args:
        kind: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"``; beta: ``β`` of JSD in [0, 1].
        temperature: the student's ``T`` (finite, > 0); the teacher's log-probs are taken as served.
        tail: the tail bucket (False: verl's ``forward_kl_topk``, forward KL only).
        tail_floor: the floor of the teacher's tail mass (default :data:`TAIL_FLOOR`).
        log_prob_min_clamp: with ``tail=False``, verl's clamp (``-10.0`` in verl's default config).
        chunk_size, vocab_chunk_size: token rows per chunk, vocabulary entries per block (fused path).

    Metrics: ``{kind}`` the mean divergence, ``student_tail_mass`` and ``teacher_tail_mass`` the mean
    tail masses, over the members.
    """

    kind: str = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    tail: bool = True
    tail_floor: float = TAIL_FLOOR
    log_prob_min_clamp: float | None = None
    chunk_size: int | None = None
    vocab_chunk_size: int | None = None

    def __post_init__(self) -> None:
        spec = self.spec
        for name in ("beta", "temperature", "tail_floor", "log_prob_min_clamp"):
            object.__setattr__(self, name, getattr(spec, name))
        for name in ("chunk_size", "vocab_chunk_size"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))

    @property
    def spec(self) -> TopKSpec:
        return TopKSpec(self.kind, self.beta, self.temperature, self.tail, self.tail_floor, self.log_prob_min_clamp)

    def check_plan(self, plan: Plan, name: str) -> None:
        """Raise a ``ValueError`` naming the component unless the plan carries the teacher's top-k."""
        if plan.teacher_topk_ids is None:
            raise ValueError(
                f"component {name!r} (TopKDistill) needs the plan's teacher_topk_ids and teacher_topk_logprobs"
            )

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        plan, outputs, mask = inputs.plan, inputs.outputs, inputs.loss_mask
        options = dict(
            beta=self.beta, temperature=self.temperature, tail=self.tail, tail_floor=self.tail_floor,
            log_prob_min_clamp=self.log_prob_min_clamp, chunk_size=self.chunk_size,
        )  # fmt: skip
        teacher = (plan.teacher_topk_ids, plan.teacher_topk_logprobs)
        if outputs.logits is not None:
            result = topk_divergence(self.kind, outputs.logits, *teacher, mask, **options)
        elif outputs.hidden is not None:
            result = linear_topk_divergence(
                self.kind, outputs.hidden, outputs.head_weight, *teacher, mask, vocab_chunk_size=self.vocab_chunk_size,
                **options,
            )  # fmt: skip
        else:
            raise ValueError(
                f"component {inputs.name!r} (TopKDistill) needs outputs.logits, or outputs.hidden and "
                "outputs.head_weight"
            )
        metrics, counts = {}, {}
        for key, values in ((self.kind, result.per_token), ("student_tail_mass", result.student_tail),
                            ("teacher_tail_mass", result.teacher_tail)):  # fmt: skip
            metrics[key], counts[key] = inputs.mean(values, mask)
        return ComponentOutput(per_token=result.per_token, metrics=metrics, counts=counts)
