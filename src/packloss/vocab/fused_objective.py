"""The head and the objective in one pass: :class:`FusedObjective` computes an objective's log-probs and
entropy from ``Outputs(hidden=, head_weight=, labels=)`` and, when the objective is token-local, its loss
and both head gradients chunk by chunk in the forward — three ``N × H × V`` matmuls, nothing recomputed,
no logits kept. The math and the fallback: ``docs/fused_objective.md``."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from packloss.core.bin import ComponentInputs, ComponentOutput, Objective, Plan
from packloss.core.dtypes import compute_dtype
from packloss.core.trust_regions import SelectionStreams, StepSelector
from packloss.vocab.core import (
    ChunkBudget,
    check_positive_int,
    check_temperature,
    chunk_ranges,
    chunk_rows,
    gradient_buffer,
    graph_is_kept,
    mm_into,
)
from packloss.vocab.first_order import first_order
from packloss.vocab.head import check_head, linear_logprobs

__all__ = ["FusedObjective", "ONE_PASS_BLOCK"]

ONE_PASS_BLOCK = ChunkBudget(cpu_per_thread=2**22, accelerator=2**26)
"""Elements of one ``[C, V]`` token-chunk block of the one pass (two are reused, a third with softcap):
at V = 32768 on one CPU thread, 128 rows, 16 MiB each. Measured at N=2048, H=512 (1 thread): 32 rows
take 3.7 s, 64 rows 2.8 s, 128 rows 2.5 s, 256 rows 2.4 s — ``d_weight``'s rank-C updates are
memory-bound when C is small."""


@dataclass(frozen=True, eq=False)
class FusedObjective(Objective):
    """``objective`` on the log-probs and entropy of ``softmax(softcap(h Wᵀ) / temperature)`` at
    ``outputs.labels``, from ``Outputs(hidden [N, H], head_weight [V, H], labels [N])``.

    One pass (``objective.token_local(plan)``: ``∂L/∂logprob_t`` and ``∂L/∂entropy_t`` read token ``t``'s
    outputs only — the per-token trust regions, token-level corrections, KL penalties, SFT, entropy):
    per token chunk ``C``, ``x = h_c Wᵀ`` (``[C, V]``), ``logprob``, ``entropy``, then the objective's
    per-token gradients ``g``, ``g_H`` on the chunk, ``∂x = g (1[v = y] − p) − g_H p (log p + H)``,
    ``d_hidden_c = ∂z W`` and ``d_weight += ∂zᵀ h_c``: three matmuls. The loss value and the metrics
    come from one evaluation of ``objective`` on the whole bin's log-probs afterwards.

    Otherwise (sequence-coupled objectives: GSPO, sequence-level corrections and masks, preference
    losses) it runs the two-step path: :func:`~packloss.vocab.linear_logprobs` then ``objective`` (four
    matmuls); :meth:`one_pass` says which.

    Args:
        objective: the objective to compute (an :class:`~packloss.core.bin.Objective` instance).
        temperature: ``T > 0`` of the softmax (the sampler's).
        softcap: ``c`` of ``c·tanh(z / c)`` on the raw logits, or None.
        chunk_size: token rows per chunk (None: ``chunk_rows(V, budget=ONE_PASS_BLOCK)``).

    Non-members' hidden states and labels may hold anything (NaN, ``-100``): they are replaced by
    zeros and token 0 before the head. First order only (``create_graph=True`` raises).
    """

    objective: Objective
    temperature: float = 1.0
    softcap: float | None = None
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.objective, Objective):
            raise TypeError(f"objective must be an Objective instance, got {type(self.objective).__name__}")
        if isinstance(self.objective, FusedObjective):
            raise TypeError("objective must not be a FusedObjective itself")
        object.__setattr__(self, "temperature", check_temperature("temperature", self.temperature))
        if self.softcap is not None and not 0 < self.softcap < math.inf:
            raise ValueError(f"softcap must be a positive finite float or None, got {self.softcap!r}")
        if self.chunk_size is not None:
            check_positive_int("chunk_size", self.chunk_size)

    def one_pass(self, plan: Plan) -> bool:
        """Whether the objective takes the one pass (three matmuls) on ``plan``, not the two-step path."""
        return self.objective.token_local(plan)

    def token_local(self, plan: Plan) -> bool:
        return self.objective.token_local(plan)

    def check_plan(self, plan: Plan, name: str) -> None:
        self.objective.check_plan(plan, name)

    def step_selector(self) -> StepSelector | None:
        return self.objective.step_selector()

    def selection_streams(self, plan: Plan, name: str) -> SelectionStreams:
        return self.objective.selection_streams(plan, name)

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        out, name = inputs.outputs, inputs.name
        hidden, weight = out.require("hidden", name), out.require("head_weight", name)
        labels = out.require("labels", name)
        check_head(hidden, weight)
        mask = inputs.loss_mask  # [N]
        labels = torch.where(mask, labels, 0).long()  # [N], non-members' labels may be anything
        if not self.one_pass(inputs.plan):
            hidden = hidden.masked_fill(~mask[:, None], 0.0)
            lp, ent = linear_logprobs(
                hidden, weight, labels, temperature=self.temperature, softcap=self.softcap,
                chunk_size=self.chunk_size, entropy_grad=True,
            )  # fmt: skip
            return self.objective(_with_head(inputs, lp, ent))
        lp, ent, d_h, d_w = _one_pass(self, inputs, hidden, weight, labels)
        final = self.objective(_with_head(inputs, lp, ent))
        term = inputs.aggregation.reduce(final.per_token)  # 0-d, the objective's term
        loss = _HeadGradient.apply(term, hidden, weight, d_h, d_w)
        return ComponentOutput(final.per_token.detach(), final.metrics, final.counts, loss)


def _with_head(inputs: ComponentInputs, logprobs: Tensor, entropy: Tensor) -> ComponentInputs:
    """``inputs`` with the head's log-probs and entropy as the objective's outputs."""
    return replace(inputs, outputs=replace(inputs.outputs, logprobs=logprobs, entropy=entropy))


def _chunk_gradients(
    spec: FusedObjective, inputs: ComponentInputs, lp: Tensor, ent: Tensor, t0: int, t1: int
) -> tuple[Tensor, Tensor | None]:
    """``(∂L/∂logprob [C], ∂L/∂entropy [C] | None)`` on tokens ``[t0, t1)``, by autograd through the
    objective over the whole bin's ``lp``/``ent`` (``[N]``, filled up to ``t1``; a token-local objective's
    gradient at ``t`` reads token ``t`` only, so the unfilled rest changes nothing)."""
    lp_v, ent_v = lp.clone().requires_grad_(), ent.clone().requires_grad_()
    with torch.enable_grad():
        out = spec.objective(_with_head(inputs, lp_v, ent_v))
        term = inputs.aggregation.reduce(out.per_token)
        if not term.requires_grad:
            return torch.zeros(t1 - t0, dtype=lp.dtype, device=lp.device), None
        g_lp, g_ent = torch.autograd.grad(term, (lp_v, ent_v), allow_unused=True)
    g = torch.zeros(t1 - t0, dtype=lp.dtype, device=lp.device) if g_lp is None else g_lp[t0:t1]
    return g, (None if g_ent is None else g_ent[t0:t1])


@torch.no_grad()
def _one_pass(
    spec: FusedObjective, inputs: ComponentInputs, hidden: Tensor, weight: Tensor, labels: Tensor
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """``(logprob [N], entropy [N], d_hidden [N, H] | None, d_weight [V, H] | None)`` of the objective's
    term, chunk by chunk over tokens with the whole vocabulary per chunk."""
    n, v = hidden.shape[0], weight.shape[0]
    cdt = compute_dtype(hidden.dtype, weight.dtype)
    mask = inputs.loss_mask  # [N]
    w = weight.detach().to(cdt)  # [V, H]
    inv_t, cap = 1.0 / spec.temperature, spec.softcap
    lp = torch.zeros(n, dtype=cdt, device=hidden.device)  # [N]
    ent = torch.zeros(n, dtype=cdt, device=hidden.device)  # [N]
    d_h = torch.empty(hidden.shape, dtype=cdt, device=hidden.device) if hidden.requires_grad else None
    d_w = gradient_buffer(w.shape, n, cdt, w.device) if weight.requires_grad else None  # [V, H]
    rows = min(chunk_rows(v, hidden.device, spec.chunk_size, budget=ONE_PASS_BLOCK), max(n, 1))
    # blocks reused by every chunk: on CPU a fresh multi-MiB tensor per chunk costs page faults
    buf_x, buf_e = (torch.empty(rows * v, dtype=cdt, device=hidden.device) for _ in range(2))
    for t0, t1 in chunk_ranges(n, rows):
        c = t1 - t0
        h_c = hidden[t0:t1].detach().to(cdt).masked_fill(~mask[t0:t1, None], 0.0)  # [C, H]
        y = labels[t0:t1, None]  # [C, 1]
        z = torch.mm(h_c, w.T, out=buf_x[: c * v].view(c, v))  # [C, V]
        th = None if cap is None else torch.tanh(z / cap)  # [C, V]
        x = z if th is None else torch.mul(th, cap, out=z)  # [C, V] the logits before the temperature
        if inv_t != 1.0:
            x.mul_(inv_t)
        x = x.sub_(x.amax(dim=1, keepdim=True))  # [C, V], x − max
        e = torch.exp(x, out=buf_e[: c * v].view(c, v))  # [C, V], unnormalised p
        s_c = e.sum(dim=1)  # [C]
        log_s = torch.log(s_c)  # [C]
        ent_c = log_s - torch.bmm(e[:, None, :], x[:, :, None]).view(c) / s_c  # [C], log s − Σ e x / s
        lp[t0:t1], ent[t0:t1] = x.gather(1, y).squeeze(1) - log_s, ent_c
        g, g_ent = _chunk_gradients(spec, inputs, lp, ent, t0, t1)
        g = torch.where(mask[t0:t1], g, 0.0)  # [C]
        if g_ent is None:
            dx = e.mul_((-g / s_c)[:, None])  # [C, V], −g p
        else:
            g_ent = torch.where(mask[t0:t1], g_ent, 0.0)  # [C]
            shift = (ent_c - log_s)[:, None]  # [C, 1]: log p + H = x + shift
            dx = e.mul_(x.add_(shift).mul_(g_ent[:, None]).add_(g[:, None])).mul_((-1.0 / s_c)[:, None])
        dx.scatter_add_(1, y, g[:, None])
        dz = dx if inv_t == 1.0 else dx.mul_(inv_t)  # [C, V] ∂L/∂(logits before the temperature)
        if th is not None:
            dz.mul_(1.0 - th.square_())  # ∂L/∂(h Wᵀ)
        if d_h is not None:
            torch.mm(dz, w, out=d_h[t0:t1])
        if d_w is not None:
            mm_into(d_w, dz.T, h_c, first=t0 == 0)
    return lp, ent, d_h, d_w


class _HeadGradient(torch.autograd.Function):
    """``term`` (passed through) with the precomputed head gradients ``d_hidden``, ``d_weight`` as its
    gradients with respect to ``hidden`` and ``weight``, scaled by the incoming gradient."""

    @staticmethod
    def forward(ctx, term, hidden, weight, d_h, d_w):
        ctx.save_for_backward(d_h, d_w)
        ctx.dtypes = hidden.dtype, weight.dtype
        return term.clone()

    @staticmethod
    @first_order("FusedObjective")
    def backward(ctx, g):
        d_h, d_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return g, _times(d_h, g, h_dtype), _times(d_w, g, w_dtype), None, None


def _times(x: Tensor | None, g: Tensor, dtype: torch.dtype) -> Tensor | None:
    """``x · g`` cast to ``dtype``: in place (no second ``[V, H]`` buffer) unless the backward keeps the graph."""
    if x is None:
        return None
    return (x * g if graph_is_kept() else x.mul_(g)).to(dtype)

