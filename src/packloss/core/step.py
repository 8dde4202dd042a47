"""Everything counted over a training step, before the forward: the denominators of every
normalisation mode (:func:`count_denominators`, one flat ``all_reduce`` across ranks), each
component's :func:`aggregation`, and the step-wide token selection of the selecting trust regions
(their additive sums travel in the same ``all_reduce``; their threshold takes one ``all_gather``).
The engine hands each bin what the step computed. The contract: ``docs/design.md``, section 5."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from packloss.core.agreement import check_agreement, raised_on_every_rank
from packloss.core.bin import Aggregation, Normalize, Objective, Plan, Selection
from packloss.core.trust_regions.base import StepSelector

__all__ = ["Mode", "StepSelection", "StepDenominators", "count_denominators", "aggregation", "bin_selection"]

Mode = tuple[Normalize, "float | Tensor | None"]
_F64 = torch.float64


def _count_size(mode: Normalize, num_groups: int) -> int:
    """How many numbers a component of this mode counts: 1, 0 (constant) or ``num_groups``."""
    if mode is Normalize.CONSTANT:
        return 0
    if mode is Normalize.GROUP_MEAN:
        return num_groups
    return 1


def _local_counts(
    plan: Plan, name: str, mode: Normalize, num_groups: int, dtype: torch.dtype, seen: dict | None = None
) -> Tensor:
    """This bin's additive counts of component ``name`` under ``mode`` (see :func:`_count_size`); a
    bin counts its positions for ``position`` whether it has the component or not. A context-parallel
    shard counts its own tokens and the sequences it reports (:meth:`Segments.reported`), whose
    member counts take one ``all_reduce`` over its group: the shards' counts sum to the bin's. Those
    whole-bin counts ``[S]`` go into ``seen[name]`` (the engine's ``sequence_mean`` divisor reuses them)."""
    if mode is Normalize.POSITION:
        return torch.full((1,), float(plan.num_tokens), dtype=dtype, device=plan.device)
    if name not in plan.members:
        return torch.zeros(_count_size(mode, num_groups), dtype=dtype, device=plan.device)
    m = plan.members[name]
    if mode is Normalize.TOKEN:
        return m.sum(dtype=dtype).reshape(1)
    if mode in (Normalize.SEQUENCE_MEAN, Normalize.SEQUENCE_SUM):
        segments = plan.layout.segments
        per_seq = segments.count(m)  # [S], the whole bin's
        if seen is not None and segments.sharded:
            seen[name] = per_seq
        return segments.reported(per_seq > 0).sum(dtype=dtype).reshape(1)
    if mode is Normalize.GROUP_MEAN:
        return torch.zeros(num_groups, dtype=dtype, device=m.device).index_add(0, plan.group_index, m.to(dtype))
    return torch.zeros(0, dtype=dtype, device=m.device)


def _denominator(mode: Normalize, constant: float | Tensor | None, counts: Tensor) -> Tensor | float:
    """``D`` of a mode from its summed counts, clamped to at least 1."""
    if mode is Normalize.CONSTANT:
        return constant
    if mode is Normalize.GROUP_MEAN:
        return (counts > 0).sum(dtype=counts.dtype).clamp_min(1)
    return counts[0].clamp_min(1)


_SPARSE_SLACK, _SPARSE_FLOOR = 8, 1 << 16


def _dense_group_count(plans: Sequence[Plan]) -> int:
    """``max(group_ids) + 1`` over ``plans``: the size of their ``group_mean`` counts. Ids must be dense
    (``0 … G−1``, a few unused allowed), or the counts would be sized by the largest id instead of the
    number of groups: a ``ValueError`` when the id space exceeds 8× the distinct ids (and 65,536)."""
    ids = {g for p in plans if p.group_ids is not None for g in p.group_ids}
    space = max(ids, default=-1) + 1
    if space > max(_SPARSE_SLACK * len(ids), _SPARSE_FLOOR):
        raise ValueError(
            f"group_ids reach {space - 1} for {len(ids)} distinct groups: the group_mean counts would hold "
            f"{space} numbers; renumber the groups 0..{len(ids) - 1} (e.g. torch.unique(ids, return_inverse=True)) "
            "or pass num_groups= to count_denominators"
        )
    return space


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


# ---------------------------------------------------------------------------------------------------
# Step-wide token selection
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class StepSelection:
    """The selection of one component over a step: ``objective`` (the one it was made for), the
    step's ``sums`` (float64 ``[num_sums]``) and the score ``threshold`` (0-d float64)."""

    objective: Objective
    sums: Tensor
    threshold: Tensor

    def made_for(self, objective: object) -> bool:
        """Whether this selection was made for ``objective`` (the same one, or an equal one)."""
        return objective is self.objective or objective == self.objective

    def of(self, selector: StepSelector, objective: Objective, plan: Plan, name: str) -> Selection:
        """The :class:`~packloss.core.bin.Selection` of component ``name`` in ``plan``."""
        scores = selector.scores(objective.selection_streams(plan, name), self.sums)  # [N]
        return Selection((scores >= self.threshold) & (scores > float("-inf")), scores)


def _selector(loss: object) -> StepSelector | None:
    return loss.step_selector() if isinstance(loss, Objective) else None


def _step_selectors(plans: Sequence[Plan], objectives: Mapping[str, object] | None) -> dict[str, Objective]:
    """``{name: objective}`` of every component that selects over the step (one spec per name)."""
    found: dict[str, Objective] = {}
    sources = [(f"objectives[{k!r}]", k, v) for k, v in (objectives or {}).items()]
    for i, plan in enumerate(plans):
        sources += [(f"plans[{i}] component {k!r}", k, c.loss) for k, c in plan.components.items()]
    for where, name, loss in sources:
        if _selector(loss) is None:
            continue
        if name in found and repr(found[name]) != repr(loss):
            raise ValueError(
                f"{where} selects tokens with {loss!r} but an earlier plan with {found[name]!r}: every "
                "micro-batch of a step must select the same way"
            )
        found[name] = loss
    return {k: found[k] for k in sorted(found)}


def _sums(plan: Plan, name: str, objective: Objective, device: torch.device | str) -> Tensor:
    """This bin's additive selection sums of component ``name`` (zeros without the component)."""
    selector = objective.step_selector()
    if name not in plan.components:
        return torch.zeros(selector.num_sums, dtype=_F64, device=device)
    return selector.sums(objective.selection_streams(plan, name))


def _check_max_rank_tokens(plans: Sequence[Plan], max_rank_tokens: object) -> None:
    if isinstance(max_rank_tokens, bool) or not isinstance(max_rank_tokens, int) or max_rank_tokens < 1:
        raise ValueError(
            "a step-wide token selection across ranks needs max_rank_tokens= (a positive int, the same on every "
            f"rank, at least the tokens any rank's plans hold), got {max_rank_tokens!r}"
        )
    n_local = sum(p.num_tokens for p in plans)
    if n_local > max_rank_tokens:
        raise ValueError(f"this rank's plans hold {n_local} tokens > max_rank_tokens={max_rank_tokens}")


def _top(values: Tensor, k: int) -> Tensor:
    """The ``k`` largest of ``values`` (descending), ``−inf``-padded when there are fewer.  ``[k]``."""
    if values.numel() < k:
        pad = torch.full((k - values.numel(),), float("-inf"), dtype=_F64, device=values.device)
        values = torch.cat([values, pad])
    return values.topk(k).values


def _select(
    plans: Sequence[Plan],
    objectives: Mapping[str, Objective],
    sums: Mapping[str, Tensor],
    *,
    gather: bool,
    group: dist.ProcessGroup | None,
    max_rank_tokens: int | None,
    device: torch.device | str,
) -> dict[str, StepSelection]:
    """Every selecting component's :class:`StepSelection` from the step's ``sums``. With ``gather``,
    ONE ``all_gather`` of each rank's ``K = min(bound(W · max_rank_tokens), max_rank_tokens)`` largest
    scores per component (a host int, equal on every rank); without, ``K = bound(Σ tokens)``."""
    if not objectives:
        return {}
    names = list(objectives)
    selectors = {k: objectives[k].step_selector() for k in names}
    if gather:
        world = dist.get_world_size(group)
        sizes = [min(selectors[k].bound(world * max_rank_tokens), max_rank_tokens) for k in names]
    else:
        sizes = [selectors[k].bound(sum(p.num_tokens for p in plans)) for k in names]
    tops = []
    for k, size in zip(names, sizes, strict=True):
        streams = [objectives[k].selection_streams(p, k) for p in plans if k in p.components]
        scores = [selectors[k].scores(s, sums[k]) for s in streams]
        tops.append(_top(torch.cat(scores) if scores else torch.zeros(0, dtype=_F64, device=device), size))
    if gather:
        local = torch.cat(tops)  # [Σ K]
        every = torch.empty(world * local.numel(), dtype=_F64, device=local.device)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        all_gather(every, local, group=group)
        rows = every.reshape(world, -1)  # [W, Σ K]
        tops = [part.reshape(-1).sort(descending=True).values for part in torch.split(rows, sizes, dim=1)]
    return {
        k: StepSelection(objectives[k], sums[k], selectors[k].threshold(top, sums[k]))
        for k, top in zip(names, tops, strict=True)
    }


def bin_selection(plan: Plan, name: str, denominators: StepDenominators | None) -> Selection | None:
    """The selection of component ``name`` in ``plan``: from the step's denominators, or over the bin
    alone without them; None when its objective does not select over the step."""
    objective = plan.components[name].loss
    selector = _selector(objective)
    if selector is None:
        return None
    if denominators is not None:
        return denominators.selections[name].of(selector, objective, plan, name)
    sums = {name: _sums(plan, name, objective, plan.device)}
    step = _select([plan], {name: objective}, sums, gather=False, group=None, max_rank_tokens=None, device=plan.device)
    return step[name].of(selector, objective, plan, name)


# ---------------------------------------------------------------------------------------------------
# Denominators
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class StepDenominators:
    """The counts of a whole step (every micro-batch, every rank), per component: ``modes[name]``
    as counted, ``counts[name]`` the summed counts (``[1]``; ``[0]`` for ``constant``; ``[G]`` per-group
    member counts for ``group_mean``), and ``selections[name]`` of the step-wide selections.
    ``sequence_counts`` keeps, for each context-parallel shard counted, its plan and the whole bin's
    members per sequence of its sequence-mode components, so that ``compute_loss`` does not reduce
    them again."""

    modes: dict[str, Mode]
    counts: dict[str, Tensor]
    num_groups: int
    selections: dict[str, StepSelection] = field(default_factory=dict)
    sequence_counts: dict[int, tuple[Plan, dict[str, Tensor]]] = field(default_factory=dict, repr=False)
    denominators: dict[str, Tensor | float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        out = {name: _denominator(mode, constant, self.counts[name]) for name, (mode, constant) in self.modes.items()}
        object.__setattr__(self, "denominators", out)

    def denominator(self, name: str) -> Tensor | float:
        """``D`` of component ``name`` (clamped to at least 1)."""
        if name not in self.denominators:
            raise ValueError(f"name {name!r} is not a component of these denominators: {sorted(self.denominators)}")
        return self.denominators[name]

    def replaced(self, counts: Mapping[str, Tensor]) -> StepDenominators:
        """These denominators with the counts of the named components replaced (a trainer adapter
        gives its peer's own global counts this way)."""
        merged = {**self.counts, **counts}
        return StepDenominators(self.modes, merged, self.num_groups, self.selections, self.sequence_counts)

    def member_counts(self, plan: Plan, name: str) -> Tensor | None:
        """The whole bin's members per sequence of component ``name`` of shard ``plan``, if counted."""
        entry = self.sequence_counts.get(id(plan))
        return None if entry is None or entry[0] is not plan else entry[1].get(name)

    def check(self, plan: Plan) -> None:
        """Raise a ``ValueError`` unless these denominators were counted for ``plan``'s components."""
        for name, comp in plan.components.items():
            if name not in self.modes:
                raise ValueError(
                    f"the step denominators have no component {name!r} (counted: {sorted(self.modes)}); "
                    "count them from plans with the same components"
                )
            if not same_mode(self.modes[name], comp.mode):
                raise ValueError(
                    f"component {name!r} normalises with {_describe(comp.mode)} but the step denominators "
                    f"were counted for {_describe(self.modes[name])}"
                )
            if _selector(comp.loss) is not None:
                got = self.selections.get(name)
                if got is None or not got.made_for(comp.loss):
                    counted = "no selection" if got is None else repr(got.objective)
                    raise ValueError(
                        f"component {name!r} selects tokens over the step with {comp.loss!r} but the step "
                        f"denominators hold {counted}; count them from the same plans"
                    )
        if plan.group_ids is not None and plan.num_groups > self.num_groups and self.num_groups:
            raise ValueError(
                f"plan group_ids reach {plan.num_groups - 1} but the denominators count {self.num_groups} groups"
            )


def _step_modes(plans: Sequence[Plan], modes: Mapping[str, Normalize | str | Mode] | None) -> dict[str, Mode]:
    out: dict[str, Mode] = {}
    if modes is not None:
        for name, mode in modes.items():
            out[name] = mode if isinstance(mode, tuple) else (Normalize.of(mode, f"modes[{name!r}]"), None)
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


@dataclass(frozen=True, eq=False)
class _LocalCounts:
    """What one rank counts before any collective: the step's modes, the components' names (sorted),
    their count sizes, the selecting components and their sums' sizes."""

    modes: dict[str, Mode]
    names: list[str]
    sizes: list[int]
    selecting: dict[str, Objective]
    sums_sizes: list[int]
    num_groups: int
    device: torch.device | str

    def description(self, max_rank_tokens: int | None) -> str:
        """What every rank must agree on, as text."""
        text = ";".join(f"{k}={self.modes[k][0].value}/{self.modes[k][1]}" for k in self.names)
        text += "".join(f";{k}:{obj!r}" for k, obj in self.selecting.items())
        text += f";max_rank_tokens={max_rank_tokens}" if self.selecting else ""
        return f"components {text}; num_groups={self.num_groups}"


def _count_local(
    plans: Sequence[Plan],
    modes: Mapping[str, Normalize | str | Mode] | None,
    num_groups: int | None,
    device: torch.device | str | None,
    objectives: Mapping[str, object] | None,
    max_rank_tokens: int | None,
    across_ranks: bool,
) -> _LocalCounts:
    """This rank's checks and counts (:func:`count_denominators` before its collectives)."""
    if isinstance(plans, Mapping) or not isinstance(plans, Sequence):
        raise TypeError(f"plans must be a list of Plan, got {type(plans).__name__}")
    for i, plan in enumerate(plans):
        if not isinstance(plan, Plan):
            raise TypeError(f"plans[{i}] must be a Plan, got {type(plan).__name__}")
    step_modes = _step_modes(plans, modes)
    if not step_modes:
        raise ValueError("no components to count: pass the rank's plans, or modes= for a rank without any")
    if any(m is Normalize.GROUP_MEAN for m, _ in step_modes.values()):
        if num_groups is None:
            if across_ranks:
                raise ValueError("group_mean across ranks needs num_groups= (the same on every rank)")
            num_groups = _dense_group_count(plans)
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
    selecting = _step_selectors(plans, objectives)
    for k in selecting:
        if k not in step_modes:
            raise ValueError(f"objectives[{k!r}] is not a component of the step (components: {names})")
    if selecting and across_ranks:
        _check_max_rank_tokens(plans, max_rank_tokens)
    sums_sizes = [obj.step_selector().num_sums for obj in selecting.values()]
    return _LocalCounts(step_modes, names, sizes, selecting, sums_sizes, groups, device)


def _flat_counts(plans: Sequence[Plan], local: _LocalCounts) -> tuple[Tensor, dict]:
    """This rank's counts and selection sums as one flat float64 tensor, and the shards' whole-bin
    sequence counts. Run after the checks: a shard's sequence counts take a collective over its group."""
    flat = torch.zeros(sum(local.sizes) + sum(local.sums_sizes), dtype=_F64, device=local.device)
    sequence_counts = {}
    for plan in plans:
        seen: dict[str, Tensor] = {}
        parts = [_local_counts(plan, k, local.modes[k][0], local.num_groups, _F64, seen) for k in local.names]
        parts += [_sums(plan, k, obj, local.device) for k, obj in local.selecting.items()]
        flat = flat + torch.cat(parts)
        if seen:
            sequence_counts[id(plan)] = (plan, seen)
    return flat, sequence_counts


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
    ``all_reduce=True``, over the ranks of ``group`` with ONE ``all_reduce`` of one flat float64 tensor.

    A rank with no micro-batch passes ``[]`` with ``modes`` (``{name: mode}``, constants as
    ``(Normalize.CONSTANT, C)``), ``device`` and, for selecting components, ``objectives={name:
    loss}``; it still joins the collectives. Every rank must have the same components and, for
    ``group_mean``, the same ``num_groups`` (required with ``all_reduce``; locally it defaults to the
    largest group id + 1). With ``all_reduce`` and ``check``, a 3-number agreement check runs first
    (``docs/design.md``): ranks that disagree, or a rank whose own checks fail, raise the same
    ``ValueError`` on every rank; it is the one host read. A step-wide selection across ranks takes
    one more collective and needs ``max_rank_tokens`` (at least the tokens any rank's plans hold, the
    same on every rank). Context-parallel shards (plans with ``shard=``) count their sequences with
    one more ``all_reduce`` per sequence-mode component and shard, over their CP group; ``group`` is
    then the whole data × context-parallel group.
    """
    agree = all_reduce and check
    with raised_on_every_rank("step components or modes", group, device, enabled=agree):
        local = _count_local(plans, modes, num_groups, device, objectives, max_rank_tokens, all_reduce)
    if agree:
        check_agreement(local.description(max_rank_tokens), "step components or modes", local.device, group)
    flat, sequence_counts = _flat_counts(plans, local)
    if all_reduce:
        dist.all_reduce(flat, group=group)
    pieces = torch.split(flat, local.sizes + local.sums_sizes)
    names = local.names
    counts = dict(zip(names, pieces[: len(names)], strict=True))
    sums = dict(zip(local.selecting, pieces[len(names) :], strict=True))
    selections = _select(
        plans, local.selecting, sums, gather=all_reduce, group=group, max_rank_tokens=max_rank_tokens,
        device=local.device,
    )  # fmt: skip
    return StepDenominators(
        modes=local.modes, counts=counts, num_groups=local.num_groups, selections=selections,
        sequence_counts=sequence_counts,
    )  # fmt: skip


def aggregation(plan: Plan, name: str, denominators: StepDenominators | None, dtype: torch.dtype) -> Aggregation:
    """The :class:`~packloss.core.bin.Aggregation` of component ``name``: its members and weights, and
    the per-token divisor and denominator of its mode, from ``denominators`` or this bin alone."""
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
        groups = _dense_group_count([plan]) if mode is Normalize.GROUP_MEAN else plan.num_groups
        counts = plan.layout.segments.across(_local_counts(plan, name, mode, groups, dtype))
        denominator = _denominator(mode, None, counts)
    divisor: Tensor | None = None
    member_counts = None if denominators is None else denominators.member_counts(plan, name)  # shards only
    if mode is Normalize.SEQUENCE_MEAN:
        segments = plan.layout.segments
        if member_counts is None:
            member_counts = segments.count(m)  # [S], over the whole bin
        divisor = segments.broadcast(member_counts.to(dtype).clamp_min(1))  # [N]
    elif mode is Normalize.GROUP_MEAN:
        divisor = counts.to(dtype).clamp_min(1).index_select(0, plan.group_index)  # [G] → [N]
    return Aggregation(mask=m, weights=weights, divisor=divisor, denominator=denominator, member_counts=member_counts)
