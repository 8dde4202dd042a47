"""Multi-teacher full-vocabulary distillation in one packed pass: each token ``t`` distils from one of
``T`` teacher heads, ``u_t = h_t · W_{k(t)}ᵀ``, with ``k`` given per sequence (host ints) or per token
(an ``[N]`` tensor) by :class:`TeacherHeads`. :func:`linear_multi_distill` is the fused pass (the student
``h Wᵀ`` and the teachers' logits built one token chunk at a time on the core of
:mod:`packloss.vocab.head_distill`, so no ``N × V`` tensor exists); :class:`MultiTeacherDistill` is its
engine component, built per bin. Formulas, costs and limits: ``docs/distill.md``, "Multi-teacher
distillation"."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from packloss.core import checks
from packloss.core.bin import ComponentInputs, ComponentOutput, Objective, Plan
from packloss.core.dtypes import compute_dtype
from packloss.core.layout import Layout, check_seq_lens
from packloss.vocab.core import (
    IMPLS,
    MATMUL,
    ChunkRun,
    DivergenceSpec,
    Impl,
    check_positive_int,
    chunk_ranges,
    chunk_rows,
    resolve_impl,
)
from packloss.vocab.distill import divergence
from packloss.vocab.head import check_head, check_tokens
from packloss.vocab.head_distill import _coefficients, _LinearDistill

__all__ = ["TeacherHeads", "MultiTeacherDistill", "linear_multi_distill", "multi_teacher_logits"]


def _heads(weights: object, hidden: Tensor) -> tuple[Tensor, ...]:
    """``weights`` (``[T, V, H_t]`` or a sequence of ``T`` ``[V, H_t]``) as ``T`` ``[V, H_t]`` tensors (views, no
    copy), checked against ``hidden [N, H_t]``."""
    if isinstance(weights, Tensor):
        checks.tensor("weights", weights, floating=True)
        if weights.dim() != 3:
            raise ValueError(f"weights must be [T, V, H_t] (or a list of T [V, H_t]), got {list(weights.shape)}")
        heads = tuple(weights.unbind(0))
    elif isinstance(weights, Sequence) and not isinstance(weights, str | bytes):
        heads = tuple(weights)
    else:
        raise TypeError(f"weights must be a [T, V, H_t] tensor or a list of T [V, H_t] tensors, got {type(weights)}")
    if not heads:
        raise ValueError("weights holds no teacher: T must be >= 1")
    for k, w in enumerate(heads):
        check_head(hidden, w, prefix="teacher_")
        if w.shape != heads[0].shape:
            raise ValueError(f"weights[{k}] is {list(w.shape)} but weights[0] is {list(heads[0].shape)}: one [V, H_t]")
    return heads


@dataclass(frozen=True, eq=False, repr=False)
class TeacherHeads:
    """``T`` teacher heads over one bin and which one each token distils from.

    Args:
        hidden: ``[N, H_t]``, the teachers' last hidden states at every token (each token's row is
            its own teacher's; one width ``H_t`` for all).
        weights: ``[T, V, H_t]``, or a list of ``T`` ``[V, H_t]`` tensors of one shape (not stacked:
            no copy). Teachers of different widths: zero-pad ``hidden`` and the narrower heads' columns
            to the widest ``H_t`` (each padded column adds ``0 · 0``: the logits are unchanged).
        index: the teacher of every sequence, host ints ``[S]`` in ``[0, T)`` (needs ``seq_lens``),
            or of every token, an ``[N]`` integer tensor on ``hidden``'s device (not read on the host:
            a member outside ``[0, T)`` gets NaN logits, so a NaN loss; :meth:`validate` checks).
        seq_lens: the bin's host sequence lengths, with a per-sequence ``index`` only.

    Derived at construction (host → device copies, no sync): ``token_index [N]`` long, and for a
    per-sequence index ``bounds`` (host offsets ``[T + 1]`` of each teacher's tokens in ``order``) and
    ``order`` / ``inverse`` (``[N]`` long, the stable permutation grouping tokens by teacher and its
    inverse; None when the tokens are already grouped).
    """

    hidden: Tensor
    weights: Tensor | Sequence[Tensor]
    index: Sequence[int] | Tensor
    seq_lens: Sequence[int] | None = None
    heads: tuple[Tensor, ...] = field(init=False)
    token_index: Tensor = field(init=False)
    bounds: tuple[int, ...] | None = field(init=False)
    order: Tensor | None = field(init=False)
    inverse: Tensor | None = field(init=False)

    def __post_init__(self) -> None:
        checks.tensor("hidden", self.hidden, floating=True)
        heads = _heads(self.weights, self.hidden)
        set_ = lambda k, v: object.__setattr__(self, k, v)  # a frozen dataclass
        set_("heads", heads)
        n, device = self.hidden.shape[0], self.hidden.device
        bounds = order = inverse = None
        if isinstance(self.index, Tensor):
            if self.seq_lens is not None:
                raise ValueError("seq_lens goes with a per-sequence index (host ints), not an [N] index tensor")
            check_tokens("index", self.index, n, "integer", self.hidden)
            token_index = self.index.long()  # [N]
        else:
            if self.seq_lens is None:
                raise ValueError("a per-sequence index (host ints) needs seq_lens= (the bin's sequence lengths)")
            lens = check_seq_lens(self.seq_lens, n)
            index = self._host_index(self.index, len(lens), len(heads))
            set_("seq_lens", lens)
            set_("index", index)
            per_token = Layout.build(lens, "cpu").broadcast_ints(index, "cpu")  # [N], host-side
            counts = [0] * len(heads)
            for k, length in zip(index, lens, strict=True):
                counts[k] += length
            bounds = tuple(sum(counts[:k]) for k in range(len(heads) + 1))
            if list(index) != sorted(index):  # not grouped yet: a permutation, built once
                perm = torch.argsort(per_token, stable=True)  # [N], CPU
                order, inverse = perm.to(device), torch.argsort(perm).to(device)
            token_index = per_token.to(device)
        set_("token_index", token_index)
        set_("bounds", bounds)
        set_("order", order)
        set_("inverse", inverse)

    @staticmethod
    def _host_index(index: object, num_seqs: int, num_teachers: int) -> tuple[int, ...]:
        if isinstance(index, str | bytes) or not isinstance(index, Sequence):
            raise TypeError(f"index must be host ints [S] or an [N] integer tensor, got {type(index).__name__}")
        ids = checks.host_sequence("index", index, num_seqs, "ints")
        for k in ids:
            checks.integer("index", k)
            if not 0 <= k < num_teachers:
                raise ValueError(f"index must be in [0, T={num_teachers}), got {k}")
        return ids

    @property
    def num_teachers(self) -> int:
        return len(self.heads)

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.heads[0].shape[0]

    def __repr__(self) -> str:
        how = "per sequence" if self.bounds is not None else "per token"
        v, h_t = self.heads[0].shape
        return f"TeacherHeads(T={self.num_teachers}, N={self.num_tokens}, V={v}, H_t={h_t}, index {how})"

    def validate(self, mask: Tensor | None = None) -> TeacherHeads:
        """Return ``self``, or raise a ``ValueError`` when a token's index (only ``mask``'s tokens when
        given) is outside ``[0, T)``. Reads a value: one sync (opt-in, off the hot path)."""
        bad = (self.token_index < 0) | (self.token_index >= self.num_teachers)  # [N]
        if mask is not None:
            bad = bad & mask
        count = int(bad.sum())  # sync-ok: opt-in validation
        if count:
            raise ValueError(f"index holds {count} token(s) outside [0, T={self.num_teachers})")
        return self


# ---------------------------------------------------------------------------------------------------
# The teachers' logits of a token chunk
# ---------------------------------------------------------------------------------------------------

_Block = Callable[[int, int], Tensor]  # (t0, t1) -> [C, V] teacher logits of the chunk's tokens


def _masked_blocks(hidden: Tensor, heads: Sequence[Tensor], index: Tensor, cdt: torch.dtype) -> _Block:
    """Tokens in their own order: every head over the chunk, kept where the token's index names it (NaN
    where it names none). ``T`` teacher matmuls per chunk."""

    def block(t0: int, t1: int) -> Tensor:
        h_c, k_c = hidden[t0:t1].to(cdt), index[t0:t1, None]  # [C, H_t], [C, 1]
        out: Tensor | float = math.nan
        for k, w in enumerate(heads):
            out = torch.where(k_c == k, h_c @ w.T, out)  # [C, V]
        return out

    return block


def _grouped_blocks(hidden: Tensor, heads: Sequence[Tensor], bounds: Sequence[int], cdt: torch.dtype) -> _Block:
    """Tokens grouped by teacher (``bounds`` host offsets): each chunk is cut at the teachers' boundaries
    on the host, and every piece is one matmul against its own head, written into the chunk's block.
    Exactly one teacher matmul per token row."""

    def block(t0: int, t1: int) -> Tensor:
        spans = ((k, max(t0, bounds[k]), min(t1, bounds[k + 1])) for k in range(len(heads)))
        pieces = [(k, a, b) for k, a, b in spans if a < b]  # the teachers of this chunk, in order
        if len(pieces) == 1:
            k, a, b = pieces[0]
            return hidden[a:b].to(cdt) @ heads[k].T  # [C, V]
        out = torch.empty(t1 - t0, heads[0].shape[0], dtype=cdt, device=hidden.device)  # [C, V]
        for k, a, b in pieces:
            torch.mm(hidden[a:b].to(cdt), heads[k].T, out=out[a - t0 : b - t0])
        return out

    return block


def _check_teachers(teachers: object, n: int, v: int, device: torch.device) -> TeacherHeads:
    if not isinstance(teachers, TeacherHeads):
        raise TypeError(f"teachers must be a TeacherHeads, got {type(teachers).__name__}")
    if teachers.num_tokens != n or teachers.vocab_size != v:
        raise ValueError(
            f"teachers hold N={teachers.num_tokens} tokens and V={teachers.vocab_size} entries; the student "
            f"has N={n}, V={v}"
        )
    checks.same_device("hidden", device, **{"teachers.hidden": teachers.hidden})
    return teachers


def multi_teacher_logits(teachers: TeacherHeads, dtype: torch.dtype, chunk_size: int | None = None) -> Tensor:
    """Each token's teacher logits ``u_t = h_t · W_{k(t)}ᵀ`` as one ``[N, V]`` tensor of ``dtype`` (the
    student-logits path, which holds ``N × V`` tensors anyway), built ``chunk_rows(V, budget=MATMUL)``
    (or ``chunk_size``) tokens at a time: ``T`` matmuls per chunk, no gradient."""
    if not isinstance(teachers, TeacherHeads):
        raise TypeError(f"teachers must be a TeacherHeads, got {type(teachers).__name__}")
    n, v, device = teachers.num_tokens, teachers.vocab_size, teachers.hidden.device
    heads = tuple(w.detach().to(dtype) for w in teachers.heads)
    block = _masked_blocks(teachers.hidden.detach(), heads, teachers.token_index, dtype)
    out = torch.empty(n, v, dtype=dtype, device=device)  # [N, V]
    for t0, t1 in chunk_ranges(n, chunk_rows(v, device, chunk_size, budget=MATMUL)):
        out[t0:t1] = block(t0, t1)
    return out


def linear_multi_distill(
    hidden: Tensor,
    weight: Tensor,
    teachers: TeacherHeads,
    *,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    loss_mask: Tensor | None = None,
    coefficients: Tensor | None = None,
    chunk_size: int | None = None,
    impl: Impl | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused multi-teacher distillation: ``loss = Σ_t c_t · L_t`` over the members, ``L_t`` the
    divergence ``kind`` between ``softmax(h_t Wᵀ / T)`` and ``softmax(h'_t W_{k(t)}ᵀ / T_t)`` (``h'``,
    ``W_k``, ``k`` from ``teachers``), never holding ``N × V``.

    Args:
        hidden, weight: the student head, ``[N, H]`` and ``[V, H]``.
        teachers: a :class:`TeacherHeads` of the same ``N`` and ``V``; no gradient reaches it.
        kind, beta, temperature, teacher_temperature, loss_mask, coefficients, chunk_size, impl: as in
            :func:`~packloss.vocab.head_distill.linear_distill`.

    A per-sequence index computes each token against its own head only: the rows are taken in
    ``teachers.order`` (``[N, H]`` and ``[N, H_t]`` gathers, once) and each chunk is cut at the
    teachers' host-known boundaries. A per-token index runs every head over every chunk and selects
    with ``torch.where`` (``T`` teacher matmuls per token). ``T = 1`` runs ``linear_distill``'s ops.

    Returns:
        ``(loss, per_token)`` as :func:`~packloss.vocab.head_distill.linear_distill`'s.
    """
    check_head(hidden, weight)
    n, v = hidden.shape[0], weight.shape[0]
    teachers = _check_teachers(teachers, n, v, hidden.device)
    spec = DivergenceSpec(kind, beta, temperature, teacher_temperature)
    cdt = compute_dtype(hidden.dtype, weight.dtype)
    if loss_mask is not None:
        check_tokens("loss_mask", loss_mask, n, "any", hidden)
        checks.mask_dtype("loss_mask", loss_mask)
        loss_mask = loss_mask.to(torch.bool)
    coef = _coefficients(coefficients, loss_mask, n, cdt, hidden)  # [N], 0 off the members
    run = ChunkRun(spec, chunk_rows(v, hidden.device, chunk_size, budget=MATMUL), resolve_impl(impl, hidden.device))
    heads = tuple(w.detach().to(cdt) for w in teachers.heads)
    t_hidden = teachers.hidden.detach()
    if teachers.bounds is None:
        block = _masked_blocks(t_hidden, heads, teachers.token_index, cdt)
        return _LinearDistill.apply(hidden, weight, block, loss_mask, coef, run)
    order = teachers.order
    if order is None:  # already grouped by teacher
        block = _grouped_blocks(t_hidden, heads, teachers.bounds, cdt)
        return _LinearDistill.apply(hidden, weight, block, loss_mask, coef, run)
    block = _grouped_blocks(t_hidden.index_select(0, order), heads, teachers.bounds, cdt)  # [N, H_t] gathered once
    mask = None if loss_mask is None else loss_mask.index_select(0, order)  # [N]
    loss, per_token = _LinearDistill.apply(
        hidden.index_select(0, order), weight, block, mask, coef.index_select(0, order), run
    )  # d_hidden flows back through the gather
    return loss, per_token.index_select(0, teachers.inverse)  # [N], the tokens' own order


@dataclass(frozen=True)
class MultiTeacherDistill(Objective):
    """Full-vocabulary distillation from several teachers: ``ℓ_t = L_t``, the divergence ``kind`` between
    ``q = softmax(s_t / temperature)`` and ``p = softmax(u_t / teacher_temperature)``, with the teacher
    logits ``u_t = h'_t · W_{k(t)}ᵀ`` of the token's own teacher ``k(t)`` (``teachers``).

    Args:
        kind, beta, temperature, teacher_temperature, chunk_size, impl: as in
            :class:`~packloss.vocab.component.VocabDistill` (the teachers give logits).
        teachers: the bin's :class:`TeacherHeads` (keyword only). It holds this bin's tensors, so the
            objective is built per bin, as the component's mask is.

    The student is ``Outputs(hidden=, head_weight=)`` (fused, :func:`linear_multi_distill`: the engine's
    coefficients ``m·w/(d·D)`` go into the pass and the component returns its term) or
    ``Outputs(logits=)`` (:func:`multi_teacher_logits` then :func:`~packloss.vocab.distill.divergence`).
    Metrics ``{kind}``, the mean over the members, and ``teacher{k}/{kind}``, over teacher ``k``'s
    members (its count is theirs).
    """

    kind: str = "reverse_kl"
    beta: float = 0.5
    temperature: float = 1.0
    teacher_temperature: float = 1.0
    chunk_size: int | None = None
    impl: Impl | None = None
    teachers: TeacherHeads = field(kw_only=True)

    def __post_init__(self) -> None:
        spec = DivergenceSpec(self.kind, self.beta, self.temperature, self.teacher_temperature)
        object.__setattr__(self, "beta", spec.beta)
        object.__setattr__(self, "temperature", spec.temperature)
        object.__setattr__(self, "teacher_temperature", spec.teacher_temperature)
        if self.chunk_size is not None:
            check_positive_int("chunk_size", self.chunk_size)
        if self.impl not in (None, *IMPLS):
            raise ValueError(f"impl must be one of {IMPLS} or None, got {self.impl!r}")
        if not isinstance(self.teachers, TeacherHeads):
            raise TypeError(f"teachers must be a TeacherHeads, got {type(self.teachers).__name__}")

    def check_plan(self, plan: Plan, name: str) -> None:
        """Raise a ``ValueError`` naming the component unless ``teachers`` fits the plan's bin."""
        where = f"component {name!r} (MultiTeacherDistill)"
        t = self.teachers
        if t.num_tokens != plan.num_tokens:
            raise ValueError(f"{where}: teachers hold N={t.num_tokens} tokens, the plan {plan.num_tokens}")
        if t.hidden.device != plan.device:
            raise ValueError(f"{where}: teachers are on {t.hidden.device}, the plan on {plan.device}")
        if t.bounds is not None and (plan.shard is not None or t.seq_lens != plan.seq_lens):
            raise ValueError(
                f"{where}: a per-sequence index needs the plan's own seq_lens and no context-parallel shard "
                "(give a shard a per-token index of its tokens)"
            )

    def _output(self, inputs: ComponentInputs, per_token: Tensor, loss: Tensor | None = None) -> ComponentOutput:
        mask, index = inputs.loss_mask, self.teachers.token_index
        value, count = inputs.mean(per_token, mask)
        metrics, counts = {self.kind: value}, {self.kind: count}
        for k in range(self.teachers.num_teachers):  # T metrics, T host-known
            key = f"teacher{k}/{self.kind}"
            metrics[key], counts[key] = inputs.mean(per_token, mask & (index == k))
        return ComponentOutput(per_token=per_token, metrics=metrics, counts=counts, loss=loss)

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        outputs, mask = inputs.outputs, inputs.loss_mask
        options = dict(beta=self.beta, temperature=self.temperature, teacher_temperature=self.teacher_temperature,
                       chunk_size=self.chunk_size, impl=self.impl)  # fmt: skip
        if outputs.logits is not None:
            s = outputs.logits  # [N, V]
            _check_teachers(self.teachers, s.shape[0], s.shape[1], s.device)
            teacher = multi_teacher_logits(self.teachers, compute_dtype(s.dtype), self.chunk_size)  # [N, V]
            return self._output(inputs, divergence(self.kind, s, teacher, mask, **options))
        if outputs.hidden is not None:
            h, w = outputs.hidden, outputs.head_weight  # [N, H], [V, H]
            coefficients = inputs.aggregation.coefficients(compute_dtype(h.dtype, w.dtype))  # [N], 0 off members
            loss, per_token = linear_multi_distill(
                h, w, self.teachers, kind=self.kind, loss_mask=mask, coefficients=coefficients, **options
            )
            return self._output(inputs, per_token, loss)
        raise ValueError(
            f"component {inputs.name!r} (MultiTeacherDistill) needs outputs.logits, or outputs.hidden and "
            "outputs.head_weight"
        )
