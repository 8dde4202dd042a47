"""Normalisation: the modes, the step-wide denominators, and each component's :class:`Aggregation`.

For a component with members ``m``, weights ``w`` (1 when absent) and per-token loss ``ℓ``:

=================  ======================================================  ==============================
mode               term of the component                                   ``D`` (counted over the step)
=================  ======================================================  ==============================
``token``          ``Σ_t w_t ℓ_t / D``                                     member tokens
``position``       ``Σ_t w_t ℓ_t / D``                                     positions (every token of
                                                                           every bin, members or not)
``sequence_mean``  ``Σ_t w_t ℓ_t / n_{s(t)} / D``                          sequences with ≥ 1 member
``sequence_sum``   ``Σ_t w_t ℓ_t / D``                                     sequences with ≥ 1 member
``constant``       ``Σ_t w_t ℓ_t / C``                                     — (``Component(constant=C)``)
``group_mean``     ``Σ_t w_t ℓ_t / n_{g(t)} / D``                          prompt groups with ≥ 1 member
=================  ======================================================  ==============================

``n_s`` is the member count of sequence ``s`` (in its bin: a sequence is never split), ``n_g`` the
member count of prompt group ``g`` over the whole step (its sequences may sit in several bins and
ranks). So ``sequence_mean`` is the mean over sequences of each sequence's token mean (GRPO), and
``group_mean`` the mean over prompt groups of each group's token mean (DAPO per prompt). Every
count is clamped to at least 1.

Without step denominators each bin is normalised by its own counts. With them — counted by
:func:`count_denominators` over every micro-batch of the step and, with ``all_reduce=True``, over
every data-parallel rank with **one** ``all_reduce`` — the step's gradient does not depend on how
its sequences were packed, ordered or split. The denominators carry the modes they were counted for;
:func:`~packloss.compute_loss` raises a ``ValueError`` when a component's mode differs.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from packloss.core.agreement import check_agreement
from packloss.core.components import Aggregation
from packloss.core.segments import broadcast, segment_count
from packloss.core.selection import (
    StepSelection,
    check_max_rank_tokens,
    select_over_step,
    selection_spec,
    selection_sums,
    selector_of,
    step_selectors,
)

if TYPE_CHECKING:
    from packloss.core.plan import Plan

__all__ = ["Normalize", "StepDenominators", "count_denominators", "aggregation", "as_normalize"]


class Normalize(str, enum.Enum):
    """The normalisation modes (see the module table)."""

    TOKEN = "token"
    POSITION = "position"
    SEQUENCE_MEAN = "sequence_mean"
    SEQUENCE_SUM = "sequence_sum"
    CONSTANT = "constant"
    GROUP_MEAN = "group_mean"


def as_normalize(value: Normalize | str, name: str = "normalize") -> Normalize:
    """``value`` as a :class:`Normalize`; an unknown mode is a ``ValueError`` naming the choices."""
    if isinstance(value, Normalize):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a Normalize or a str, got {type(value).__name__}")
    try:
        return Normalize(value)
    except ValueError:
        choices = [m.value for m in Normalize]
        raise ValueError(f"{name} must be one of {choices}, got {value!r}") from None


Mode = tuple[Normalize, "float | None"]


def _count_size(mode: Normalize, num_groups: int) -> int:
    """How many numbers a component of this mode counts: 1, 0 (constant) or ``num_groups``."""
    if mode is Normalize.CONSTANT:
        return 0
    if mode is Normalize.GROUP_MEAN:
        return num_groups
    return 1


def _local_counts(plan: Plan, name: str, mode: Normalize, num_groups: int, dtype: torch.dtype) -> Tensor:
    """This bin's additive counts of component ``name`` under ``mode`` (see :func:`_count_size`)."""
    m = plan.members[name]
    if mode is Normalize.TOKEN:
        return m.sum(dtype=dtype).reshape(1)
    if mode is Normalize.POSITION:
        return torch.full((1,), float(plan.num_tokens), dtype=dtype, device=m.device)
    if mode in (Normalize.SEQUENCE_MEAN, Normalize.SEQUENCE_SUM):
        per_seq = segment_count(m, plan.layout.seq_ids, plan.num_seqs)  # [S]
        return (per_seq > 0).sum(dtype=dtype).reshape(1)
    if mode is Normalize.GROUP_MEAN:
        return torch.zeros(num_groups, dtype=dtype, device=m.device).index_add(0, plan.group_index, m.to(dtype))
    return torch.zeros(0, dtype=dtype, device=m.device)


def _denominator(mode: Normalize, constant: float | Tensor | None, counts: Tensor) -> Tensor | float:
    """``D`` of a mode from its additive counts (:func:`_local_counts`, summed), clamped to at least 1."""
    if mode is Normalize.CONSTANT:
        return constant
    if mode is Normalize.GROUP_MEAN:
        return (counts > 0).sum(dtype=counts.dtype).clamp_min(1)
    return counts[0].clamp_min(1)


@dataclass(frozen=True, eq=False)
class StepDenominators:
    """The counts of a whole step (every micro-batch, every rank), per component.

    ``modes[name]`` is ``(Normalize, constant)`` as counted; ``counts[name]`` the summed counts
    (``[1]``, ``[0]`` for ``constant``, ``[G]`` per-group member counts for ``group_mean``).
    ``selections[name]`` is the step-wide token selection of a component whose trust region selects
    tokens over the step (:mod:`packloss.core.selection`; Clip-Cov, KL-Cov, M2PO).
    """

    modes: dict[str, Mode]
    counts: dict[str, Tensor]
    num_groups: int
    selections: dict[str, StepSelection] = field(default_factory=dict)
    denominators: dict[str, Tensor | float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # D of every component, derived once here rather than in every compute_loss call.
        out = {name: _denominator(mode, constant, self.counts[name]) for name, (mode, constant) in self.modes.items()}
        object.__setattr__(self, "denominators", out)

    def denominator(self, name: str) -> Tensor | float:
        """``D`` of component ``name`` (clamped to at least 1)."""
        return self.denominators[name]

    def check(self, plan: Plan) -> None:
        """Raise a ``ValueError`` unless these denominators were counted for ``plan``'s modes."""
        for name, comp in plan.components.items():
            if name not in self.modes:
                raise ValueError(
                    f"the step denominators have no component {name!r} (counted: {sorted(self.modes)}); "
                    "count them from plans with the same components"
                )
            if not same_mode(self.modes[name], comp.mode):
                counted = _describe(self.modes[name])
                raise ValueError(
                    f"component {name!r} normalises with {_describe(comp.mode)} but the step denominators "
                    f"were counted for {counted}"
                )
        for name in step_selectors([plan]):
            got, want = self.selections.get(name), selection_spec(plan.components[name].loss)
            if got is None or got.spec != want:
                counted = "no selection" if got is None else got.spec
                raise ValueError(
                    f"component {name!r} selects tokens over the step with {want} but the step denominators "
                    f"hold {counted}; count them from the same plans"
                )
        if plan.group_ids is not None and plan.num_groups > self.num_groups and self.num_groups:
            raise ValueError(
                f"plan group_ids reach {plan.num_groups - 1} but the denominators count {self.num_groups} groups"
            )


def same_mode(a: Mode, b: Mode) -> bool:
    """Whether two ``(Normalize, constant)`` agree; tensor constants agree only when they are the same
    tensor (comparing their values would read the device)."""
    if a[0] is not b[0]:
        return False
    if isinstance(a[1], Tensor) or isinstance(b[1], Tensor):
        return a[1] is b[1]
    return a[1] == b[1]


def _describe(mode: Mode) -> str:
    m, c = mode
    return f"normalize={m.value!r}" + (f" (constant={c})" if c is not None else "")


def _step_modes(plans: Sequence[Plan], modes: Mapping[str, Normalize | str | Mode] | None) -> dict[str, Mode]:
    out: dict[str, Mode] = {}
    if modes is not None:
        for name, mode in modes.items():
            out[name] = mode if isinstance(mode, tuple) else (as_normalize(mode, f"modes[{name!r}]"), None)
            if out[name][0] is Normalize.CONSTANT and out[name][1] is None:
                raise ValueError(f"modes[{name!r}]: give constant modes as (Normalize.CONSTANT, C)")
    seen: dict[str, Mode] = {}
    for i, plan in enumerate(plans):
        for name, comp in plan.components.items():
            if name in seen and not same_mode(seen[name], comp.mode):
                raise ValueError(
                    f"component {name!r} normalises with {_describe(comp.mode)} in plans[{i}] but with "
                    f"{_describe(seen[name])} in an earlier plan"
                )
            seen[name] = comp.mode
            if modes is not None and (name not in out or not same_mode(out[name], comp.mode)):
                raise ValueError(f"plans[{i}] component {name!r} uses {_describe(comp.mode)}, not the given modes")
    return out if modes is not None else seen


def count_denominators(
    plans: Sequence[Plan],
    *,
    all_reduce: bool = False,
    group: dist.ProcessGroup | None = None,
    modes: Mapping[str, Normalize | str | Mode] | None = None,
    num_groups: int | None = None,
    device: torch.device | str | None = None,
    check: bool = True,
    objectives: Mapping[str, object] | None = None,
    max_rank_tokens: int | None = None,
) -> StepDenominators:
    """Count the denominators of a step over ``plans`` (this rank's micro-batches) and, with
    ``all_reduce=True``, over the ranks of ``group`` with ONE ``all_reduce`` of one flat tensor.

    The components and their modes come from the plans; a rank with no micro-batch passes ``[]``
    with ``modes`` (``{name: mode}``, constants as ``(Normalize.CONSTANT, C)``) and ``device``, and
    still joins the all-reduce. Every rank must have the same components and, for ``group_mean``,
    the same ``num_groups`` (required with ``all_reduce``; locally it defaults to the largest group
    id + 1). Counts are float64 so that they stay exact.

    With ``all_reduce`` and ``check`` (the default), a 2-number agreement check runs before the
    counts' all-reduce (:func:`~packloss.core.agreement.check_agreement`): ranks whose components,
    modes, constants or ``num_groups`` differ raise the same ``ValueError`` instead of hanging,
    aborting or mixing counts; it reads those two numbers on the host. Without ``all_reduce`` nothing
    is read on the host.

    Components whose trust region selects tokens over the step (Clip-Cov, KL-Cov, M2PO; see
    :mod:`packloss.core.selection`) add their additive statistics to the same flat tensor, so they
    travel in the same ``all_reduce``; their threshold then takes **one** more collective, an
    ``all_gather`` of each rank's ``K`` largest scores (``K`` a host int, the same on every rank,
    which needs ``max_rank_tokens=``: at least the tokens any rank's plans hold, the same on every
    rank). A rank without plans passes ``objectives={name: loss}`` for those components.
    """
    if isinstance(plans, Mapping) or not isinstance(plans, Sequence):
        raise TypeError(f"plans must be a list of Plan, got {type(plans).__name__}")
    from packloss.core.plan import Plan

    for i, plan in enumerate(plans):
        if not isinstance(plan, Plan):
            raise TypeError(f"plans[{i}] must be a Plan, got {type(plan).__name__}")
    step_modes = _step_modes(plans, modes)
    if not step_modes:
        raise ValueError("no components to count: pass the rank's plans, or modes= for a rank without any")
    needs_groups = any(m is Normalize.GROUP_MEAN for m, _ in step_modes.values())
    if needs_groups:
        if num_groups is None:
            if all_reduce:
                raise ValueError("group_mean across ranks needs num_groups= (the same on every rank)")
            num_groups = max((p.num_groups for p in plans), default=0)
        elif isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
            raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
        for i, plan in enumerate(plans):
            if plan.num_groups > num_groups:
                raise ValueError(f"plans[{i}] has group id {plan.num_groups - 1} >= num_groups={num_groups}")
    groups = num_groups or 0
    if device is None:
        device = plans[0].device if plans else torch.device("cpu")
    names = sorted(step_modes)
    sizes = [_count_size(step_modes[k][0], groups) for k in names]
    selectors = step_selectors(plans, objectives)  # {name: loss} of the step-wide selections
    for k in selectors:
        if k not in step_modes:
            raise ValueError(f"objectives[{k!r}] is not a component of the step (components: {names})")
    sums_sizes = [selector_of(loss).num_sums for loss in selectors.values()]
    flat = torch.zeros(sum(sizes) + sum(sums_sizes), dtype=torch.float64, device=device)
    for plan in plans:
        parts = []
        for k in names:
            mode = step_modes[k][0]
            if k in plan.members:
                parts.append(_local_counts(plan, k, mode, groups, torch.float64))
            else:
                parts.append(torch.zeros(_count_size(mode, groups), dtype=torch.float64, device=device))
        parts += [selection_sums(plan, k, loss, device) for k, loss in selectors.items()]
        flat = flat + torch.cat(parts)
    if all_reduce:
        if selectors:  # before any collective: a rank that raises later would leave the others waiting
            check_max_rank_tokens(plans, max_rank_tokens)
        if check:
            description = ";".join(f"{k}={step_modes[k][0].value}/{step_modes[k][1]}" for k in names)
            description += "".join(f";{k}:{selection_spec(loss)}" for k, loss in selectors.items())
            description += f";max_rank_tokens={max_rank_tokens}" if selectors else ""
            check_agreement(f"components {description}; num_groups={groups}", "step components or modes", device, group)
        dist.all_reduce(flat, group=group)
    pieces = torch.split(flat, sizes + sums_sizes)
    counts = dict(zip(names, pieces[: len(names)], strict=True))
    sums = dict(zip(selectors, pieces[len(names) :], strict=True))
    selections = select_over_step(
        plans, selectors, sums, gather=all_reduce, group=group, max_rank_tokens=max_rank_tokens, device=device
    )
    return StepDenominators(modes=step_modes, counts=counts, num_groups=groups, selections=selections)


def aggregation(plan: Plan, name: str, denominators: StepDenominators | None, dtype: torch.dtype) -> Aggregation:
    """The :class:`Aggregation` of component ``name`` of ``plan``: its members and weights, and the
    per-token divisor and denominator of its mode, from ``denominators`` or this bin alone."""
    comp = plan.components[name]
    mode = comp.normalize
    m = plan.members[name]
    weights = plan.weights[name]
    weights = None if weights is None else weights.to(dtype)
    if mode is Normalize.CONSTANT:
        counts, denominator = None, comp.constant
    elif denominators is not None:
        counts = denominators.counts[name]
        denominator = denominators.denominator(name).to(dtype)  # float64 counts → the compute dtype
    else:
        counts = _local_counts(plan, name, mode, plan.num_groups, dtype)
        denominator = _denominator(mode, None, counts)
    divisor: Tensor | None = None
    if mode is Normalize.SEQUENCE_MEAN:
        per_seq = segment_count(m, plan.layout.seq_ids, plan.num_seqs).to(dtype)  # [S]
        divisor = broadcast(per_seq.clamp_min(1), plan.layout.seq_ids)  # [N]
    elif mode is Normalize.GROUP_MEAN:
        divisor = counts.to(dtype).clamp_min(1).index_select(0, plan.group_index)  # [G] → [N]
    return Aggregation(mask=m, weights=weights, divisor=divisor, denominator=denominator)
