"""The component interface: what a loss component sees (``ComponentInputs``) and returns
(``ComponentOutput``), and the one aggregation (``Aggregation``) that turns per-token losses into a
component's term of the total.

A component loss is any callable ``loss(inputs: ComponentInputs) -> ComponentOutput``. It sees the
**whole packed bin once** with its layout, and returns its **per-token** loss ``ℓ [N]`` (unweighted,
unnormalised; non-member values are ignored) and metrics. The engine applies the component's
weights and normalisation (:class:`Aggregation`), so no component can bypass or repeat them::

    term = Σ_t m_t · w_t · ℓ_t / d_t / D

with members ``m``, weights ``w`` (1 when absent), a per-token divisor ``d`` (``n_s`` for
``sequence_mean``, ``n_g`` for ``group_mean``, else 1) and the denominator ``D`` of the mode (see
:mod:`packloss.core.normalize`). A *fused* component (the full-vocabulary distillation from hidden
states, which computes its gradient in the forward) takes the coefficients ``m·w/(d·D)`` from
``inputs.aggregation`` and returns the term itself in ``ComponentOutput.loss``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from packloss.core.segments import segment_mean

if TYPE_CHECKING:
    from packloss.core.plan import Outputs, Plan
    from packloss.core.selection import StepSelection

__all__ = ["Aggregation", "ComponentInputs", "ComponentOutput", "ComponentLoss", "upcast", "masked_mean"]


def upcast(x: Tensor) -> Tensor:
    """``x`` in the compute dtype: at least float32 (bf16/fp16 are promoted, float64 stays)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_mean(
    values: Tensor,
    mask: Tensor,
    seq_ids: Tensor | None = None,
    num_seqs: int = 1,
    per_sequence: bool = False,
    count: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Sync-free mean of ``values [N]`` over ``mask [N]`` and the member count it was taken over.

    Returns scalars ``(Σ_{mask} values / max(count, 1), count)``, or ``([S], [S])`` per sequence.
    Values outside ``mask`` never enter (inf/NaN safe); bool values count as 0/1. ``count`` (scalar
    mode only) is ``mask.sum()`` when the caller already has it.
    """
    if per_sequence:
        return segment_mean(upcast(values.detach()), mask, seq_ids, num_seqs)
    if count is None:
        count = mask.sum(dtype=torch.float32)
    if values.dtype == torch.bool:  # a fraction: count the members where it holds, no float copy
        total = (values & mask).sum(dtype=torch.float32)
    else:
        total = torch.where(mask, upcast(values.detach()), 0.0).sum()
    return total / count.clamp_min(1), count


@dataclass(frozen=True, eq=False)
class Aggregation:
    """How a component's per-token loss becomes its term: ``Σ_t m_t · w_t · ℓ_t / d_t / D``.

    ``mask [N]`` bool members; ``weights [N]`` (zero off the members) or None; ``divisor [N]``
    (at least 1) or None; ``denominator`` a number or a 0-d tensor.
    """

    mask: Tensor
    weights: Tensor | None
    divisor: Tensor | None
    denominator: Tensor | float

    def mask_tokens(self, per_token: Tensor) -> Tensor:
        """``ℓ`` in the compute dtype with exact zeros off the members (whatever they held).  ``[N]``."""
        return torch.where(self.mask, upcast(per_token), 0.0)

    def reduce(self, per_token: Tensor) -> Tensor:
        """The component's term, a 0-d tensor in at least float32. ``per_token [N]``."""
        return self.reduce_masked(self.mask_tokens(per_token))

    def reduce_masked(self, x: Tensor) -> Tensor:
        """:meth:`reduce` of a per-token loss already passed through :meth:`mask_tokens`."""
        if self.weights is not None:
            x = x * self.weights
        if self.divisor is not None:
            x = x / self.divisor
        return x.sum() / self.denominator

    def coefficients(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``m_t · w_t / d_t / D`` as a ``[N]`` tensor of ``dtype`` (zero off the members)."""
        c = self.mask.to(dtype) if self.weights is None else self.weights.to(dtype)  # [N]
        if self.divisor is not None:
            c = c / self.divisor
        return c / self.denominator


@dataclass(frozen=True, eq=False)
class ComponentInputs:
    """What a component loss sees: the plan (pre-forward streams, layout), the forward's outputs,
    its member mask and its aggregation. The properties use prime-rl's field names. ``selection`` is
    the step-wide token selection of a component whose trust region selects over the step
    (:class:`~packloss.core.selection.StepSelection`, from the step denominators), or None: such a
    region then selects over this bin alone."""

    plan: Plan
    outputs: Outputs
    name: str
    aggregation: Aggregation
    per_sequence_metrics: bool = False
    selection: StepSelection | None = None

    @property
    def loss_mask(self) -> Tensor:
        """``[N]`` bool, this component's members."""
        return self.aggregation.mask

    @property
    def trainer_logprobs(self) -> Tensor:
        return self.outputs.require("logprobs", self.name)

    @property
    def inference_logprobs(self) -> Tensor:
        return self.plan.require("inference_logprobs", self.name)

    @property
    def ref_logprobs(self) -> Tensor | None:
        return self.plan.ref_logprobs

    @property
    def old_logprobs(self) -> Tensor | None:
        return self.plan.old_logprobs

    @property
    def advantages(self) -> Tensor | None:
        return self.plan.advantages

    @property
    def seq_ids(self) -> Tensor:
        return self.plan.layout.seq_ids

    @property
    def cu_seqlens(self) -> Tensor:
        return self.plan.layout.cu_seqlens

    @property
    def num_seqs(self) -> int:
        return self.plan.num_seqs

    def mean(self, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`masked_mean` with this bin's layout and metrics mode."""
        return masked_mean(values, mask, self.seq_ids, self.num_seqs, self.per_sequence_metrics)


@dataclass
class ComponentOutput:
    """A component's per-token loss ``[N]`` and metrics.

    ``counts`` maps a metric name to the member count it was taken over (a metric without an entry
    counts the component's members). ``loss`` is set only by fused components, which apply
    ``inputs.aggregation`` themselves; the engine then uses it as the component's term and
    ``per_token`` (which such a component may leave None) for metrics only.
    """

    per_token: Tensor | None
    metrics: dict[str, Tensor] = field(default_factory=dict)
    counts: dict[str, Tensor] = field(default_factory=dict)
    loss: Tensor | None = None


ComponentLoss = Callable[[ComponentInputs], ComponentOutput]


def outputs_from_named(
    inputs: ComponentInputs, per_token: Tensor, named: dict[str, tuple[Tensor, Tensor]]
) -> ComponentOutput:
    """``ComponentOutput`` with each metric the mean of ``values`` over ``mask`` for
    ``{name: (values [N], mask [N])}``, and its count."""
    metrics, counts = {}, {}
    seen: list[tuple[Tensor, Tensor]] = []  # (mask, count): metrics over the same mask share one count
    per_sequence = inputs.per_sequence_metrics
    for key, (values, mask) in named.items():
        count = None if per_sequence else next((c for m, c in seen if m is mask), None)
        metrics[key], counts[key] = masked_mean(values, mask, inputs.seq_ids, inputs.num_seqs, per_sequence, count)
        seen.append((mask, counts[key]))
    return ComponentOutput(per_token=per_token, metrics=metrics, counts=counts)
