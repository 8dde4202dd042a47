"""``compute_loss``: every component of a packed bin, each once over the whole bin, with what the
step computed (:mod:`packloss.core.step`): ``total = Σ_c Σ_t m_t · w_t · ℓ_t / d_t / D``. No host read;
the op count does not depend on the number of sequences; the loss is always attached to the graph of
the given outputs, so every rank runs backward even when every component is empty."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from packloss.core.bin import ComponentInputs, ComponentOutput, Plan
from packloss.core.dtypes import upcast
from packloss.core.outputs import Outputs
from packloss.core.step import StepDenominators, aggregation, bin_selection

__all__ = ["LossResult", "compute_loss"]


@dataclass(frozen=True)
class LossResult:
    """``loss`` (0-d, at least float32), ``metrics`` and the member ``counts`` they were taken over
    (scalars, or ``[S]`` with ``per_sequence_metrics``; merge with :func:`~packloss.merge_metrics`),
    ``per_token[name]`` each component's per-token loss ``[N]`` (zero off its members; detached for
    fused components) and ``terms[name]`` its normalised term of ``loss``."""

    loss: Tensor
    metrics: dict[str, Tensor]
    counts: dict[str, Tensor]
    per_token: dict[str, Tensor]
    terms: dict[str, Tensor]


def _compute_dtype(outputs: Outputs) -> torch.dtype:
    dtype = torch.float32
    for value in (outputs.logprobs, outputs.entropy, outputs.values, outputs.logits, outputs.hidden):
        if value is not None:
            dtype = torch.promote_types(dtype, value.dtype)
    return dtype


def compute_loss(
    plan: Plan,
    outputs: Outputs,
    denominators: StepDenominators | None = None,
    *,
    per_sequence_metrics: bool = False,
) -> LossResult:
    """Loss, metrics and per-token losses of one packed bin.

    Args:
        plan: the bin's layout, components and pre-forward streams.
        outputs: the forward's outputs (``logprobs [N]``, ``entropy [N]``, ``logits [N, V]``,
            ``hidden [N, H]`` + ``head_weight``), as the components need them.
        denominators: the step's :class:`~packloss.StepDenominators` (from
            :func:`~packloss.count_denominators`); None normalises by this bin's own counts. Counted
            for other modes or components than the plan's, they raise a ``ValueError``.
        per_sequence_metrics: report ``[S]`` metrics and counts instead of scalars.

    Returns:
        :class:`LossResult`; metric names are ``"{component}/{metric}"``, and every component
        reports ``"{component}/loss"`` (the mean per-token loss over its members).
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a Plan, got {type(plan).__name__}")
    if not isinstance(outputs, Outputs):
        raise TypeError(f"outputs must be an Outputs, got {type(outputs).__name__}")
    if denominators is not None:
        if not isinstance(denominators, StepDenominators):
            raise TypeError(f"denominators must be StepDenominators or None, got {type(denominators).__name__}")
        denominators.check(plan)
    outputs.check(plan)
    dtype = _compute_dtype(outputs)

    total: Tensor | None = None
    metrics: dict[str, Tensor] = {}
    counts: dict[str, Tensor] = {}
    per_token: dict[str, Tensor] = {}
    terms: dict[str, Tensor] = {}
    for name, comp in plan.components.items():
        agg = aggregation(plan, name, denominators, dtype)
        selection = bin_selection(plan, name, denominators)
        inputs = ComponentInputs(plan, outputs, name, agg, per_sequence_metrics, selection)
        out = comp.loss(inputs)
        if not isinstance(out, ComponentOutput):
            raise TypeError(f"component {name!r} must return a ComponentOutput, got {type(out).__name__}")
        _check_output(name, out, plan.num_tokens)
        masked = None if out.per_token is None else agg.mask_tokens(out.per_token)  # [N]
        term = agg.reduce_masked(masked) if out.loss is None else upcast(out.loss)
        if term.dim() != 0:
            raise ValueError(f"component {name!r} returned a loss of shape {tuple(term.shape)}, not a scalar")
        terms[name] = term
        total = term if total is None else total + term
        if masked is not None:
            per_token[name] = masked
        _collect_metrics(name, out, masked, inputs, metrics, counts)
    if total is None or not total.requires_grad:
        anchor = outputs.anchor()
        if anchor is not None:
            total = anchor if total is None else total + anchor
    return LossResult(loss=total, metrics=metrics, counts=counts, per_token=per_token, terms=terms)


def _check_output(name: str, out: ComponentOutput, n: int) -> None:
    if out.per_token is None:
        if out.loss is None:
            raise ValueError(f"component {name!r} returned neither a per-token loss nor a fused loss")
        return
    if not isinstance(out.per_token, Tensor) or tuple(out.per_token.shape) != (n,):
        shape = tuple(out.per_token.shape) if isinstance(out.per_token, Tensor) else type(out.per_token).__name__
        raise ValueError(f"component {name!r} must return a per-token loss of shape [N]=({n},), got {shape}")


def _collect_metrics(
    name: str,
    out: ComponentOutput,
    masked: Tensor | None,
    inputs: ComponentInputs,
    metrics: dict[str, Tensor],
    counts: dict[str, Tensor],
) -> None:
    """The component's metrics under ``"{name}/"``, and ``"{name}/loss"``, the mean of its masked
    per-token loss ``masked [N]`` over its members."""
    m = inputs.loss_mask
    segments = inputs.segments
    if masked is None:
        loss, members = None, segments.count(m) if inputs.per_sequence_metrics else m.sum(dtype=torch.float32)
    elif inputs.per_sequence_metrics:
        loss, members = segments.mean(masked.detach(), m)  # [S] each, over the whole bin
    else:
        members = m.sum(dtype=torch.float32)
        loss = masked.detach().sum() / members.clamp_min(1)
    own = dict(out.metrics) if loss is None else {"loss": loss, **out.metrics}
    for key, value in own.items():
        full = f"{name}/{key}"
        metrics[full] = value
        counts[full] = out.counts.get(key, members)
