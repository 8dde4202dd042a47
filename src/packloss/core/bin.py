"""The data model of a packed bin, below everything that computes on it: the normalisation modes
(:class:`Normalize`), a loss :class:`Component`, the :class:`Plan` (before the forward), the
:class:`Outputs` (after it), and what an objective sees (:class:`ComponentInputs`) and returns
(:class:`ComponentOutput`), with the :class:`Objective` base class and the one :class:`Aggregation`.
Construction reads shapes, dtypes and devices only (no sync). ``docs/design.md`` tells the story."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from torch import Tensor

from packloss.core import checks
from packloss.core.context_parallel import ContextShard
from packloss.core.dtypes import upcast
from packloss.core.layout import Layout, check_seq_lens
from packloss.core.metrics import masked_mean
from packloss.core.outputs import Outputs
from packloss.core.segments import Segments
from packloss.core.trust_regions.base import SelectionStreams, StepSelector

__all__ = [
    "Normalize",
    "Objective",
    "Component",
    "Plan",
    "Aggregation",
    "Selection",
    "ComponentInputs",
    "ComponentOutput",
    "ComponentLoss",
]

LOGPROB_STREAMS = ("rollout_logprobs", "old_logprobs", "ref_logprobs")
TOKEN_STREAMS = (*LOGPROB_STREAMS, "advantages", "returns", "old_values")


class Normalize(str, enum.Enum):
    """The normalisation modes (``docs/design.md``, section 5): the term of a component is
    ``Σ_t m_t w_t ℓ_t / d_t / D`` with ``d`` and ``D`` given by the mode."""

    TOKEN = "token"
    POSITION = "position"
    SEQUENCE_MEAN = "sequence_mean"
    SEQUENCE_SUM = "sequence_sum"
    CONSTANT = "constant"
    GROUP_MEAN = "group_mean"

    @classmethod
    def of(cls, value: Normalize | str, name: str = "normalize") -> Normalize:
        """``value`` as a mode; an unknown one is a ``ValueError`` naming the choices."""
        if isinstance(value, Normalize):
            return value
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a Normalize or a str, got {type(value).__name__}")
        return cls(checks.choice(name, value, [m.value for m in cls]))


class Objective:
    """Base class of the built-in objectives (any callable ``ComponentInputs -> ComponentOutput`` is a
    component loss too). The hooks are optional: :meth:`check_plan` at plan construction, and for an
    objective whose trust region selects tokens over the step, :meth:`step_selector` and
    :meth:`selection_streams` (read by ``count_denominators`` and ``compute_loss``)."""

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        raise NotImplementedError

    def check_plan(self, plan: Plan, name: str) -> None:
        """Raise a ``ValueError`` naming component ``name`` when ``plan`` lacks a stream it reads."""

    def step_selector(self) -> StepSelector | None:
        """The region that selects this objective's tokens over the step, or None."""
        return None

    def token_local(self, plan: Plan) -> bool:
        """Whether, on ``plan``, the gradient of this objective's term with respect to token ``t``'s
        log-prob and entropy reads the outputs at ``t`` only (given the pre-forward streams and the
        step's selection): what lets ``packloss.vocab.FusedObjective`` take its one pass. False unless
        the objective says so."""
        return False

    def selection_streams(self, plan: Plan, name: str) -> SelectionStreams:
        """The pre-forward streams of component ``name`` that :meth:`step_selector` reads."""
        raise NotImplementedError(f"{type(self).__name__} has no step-wide selection")


ComponentLoss = Callable[["ComponentInputs"], "ComponentOutput"]


@dataclass(frozen=True, eq=False)
class Component:
    """One loss component: its loss, members and normalisation (stated here, once).

    Args:
        loss: ``loss(ComponentInputs) -> ComponentOutput``: ``PolicyGradient(...)``, ``SFT()``,
            ``Entropy(...)``, ``VocabDistill(...)`` or a function of your own.
        mask: ``[N]`` bool, the tokens it trains on (None: every token with a non-zero weight).
        weights: ``[N]`` float per-token weights or None (1). Members are ``mask & (weights != 0)``.
        normalize: the mode (:class:`Normalize` or its string), default ``"token"``.
        constant: ``C`` of ``normalize="constant"`` (only there): a finite number > 0 or a 0-d tensor
            (its value is checked by ``Plan.validate(deep=True)``, not on the hot path).
        weights_select: False keeps the members ``mask`` whatever the weights (importance weights, as
            verl's ``rollout_is_weights``: a zero weight scales a token's loss to 0 but it still counts).

    A component without ``mask`` and ``weights`` is a template (a :class:`~packloss.Recipe`'s);
    ``Plan`` needs one or both.
    """

    loss: ComponentLoss
    mask: Tensor | None = None
    weights: Tensor | None = None
    normalize: Normalize | str = Normalize.TOKEN
    constant: float | Tensor | None = None
    weights_select: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.loss, type):
            raise TypeError(f"loss must be an objective instance, got the class {self.loss.__name__}: call it first")
        if not callable(self.loss):
            raise TypeError(f"loss must be a callable component loss, got {type(self.loss).__name__}")
        object.__setattr__(self, "normalize", Normalize.of(self.normalize))
        if self.normalize is Normalize.CONSTANT:
            if self.constant is None:
                raise ValueError("normalize='constant' needs constant= (the constant C)")
            if isinstance(self.constant, Tensor):
                if self.constant.dim() != 0 or self.constant.dtype == torch.bool or self.constant.is_complex():
                    raise ValueError(
                        f"constant must be a number or a 0-d real tensor, got shape {list(self.constant.shape)}"
                    )
            else:
                object.__setattr__(self, "constant", checks.positive("constant", self.constant))
        elif self.constant is not None:
            raise ValueError(f"constant is only used with normalize='constant', got normalize={self.normalize.value!r}")
        if self.mask is not None:
            checks.tensor("mask", self.mask, boolean=True)
        if self.weights is not None:
            checks.tensor("weights", self.weights, floating=True)
        checks.flag("weights_select", self.weights_select)
        if not self.weights_select and self.mask is None and self.weights is not None:
            raise ValueError("weights_select=False needs a mask: the weights do not choose the members")

    @property
    def mode(self) -> tuple[Normalize, float | Tensor | None]:
        """``(normalize, constant)``, what step denominators must have been counted for."""
        return self.normalize, self.constant


def check_group_ids(group_ids: object, num_seqs: int) -> tuple[int, ...]:
    """``group_ids`` as a tuple of ``S`` non-negative host ints."""
    ids = checks.host_sequence("group_ids", group_ids, num_seqs, "ints")
    for g in ids:
        if isinstance(g, bool) or not isinstance(g, int):
            raise TypeError(f"group_ids must hold Python ints, got {type(g).__name__}")
        if g < 0:
            raise ValueError(f"group_ids must be >= 0, got {g}")
    return ids


@dataclass(frozen=True, eq=False)
class Plan:
    """A packed bin before its forward: layout, components and the pre-forward streams.

    Args:
        seq_lens: host ints, the lengths of the ``S`` packed sequences (each > 0, sum ``N``).
        components: ``{name: Component}``, at least one; the names prefix the metrics (``"pg/is_masked"``).
        rollout_logprobs: ``[N]``, log-probs under the rollout policy that sampled the tokens.
        ref_logprobs: ``[N]``, reference / teacher log-probs of the sampled tokens.
        advantages: ``[N]`` float.
        teacher_logits: ``[N, V]`` teacher logits for full-vocabulary distillation, or
        teacher_hidden, teacher_weight: ``[N, H_t]`` and ``[V, H_t]``, a teacher head.
        group_ids: host ints, the prompt group of every sequence (``[S]``, ``≥ 0``, global over the
            step), for ``normalize="group_mean"``.
        old_logprobs: ``[N]``, log-probs under the old / proximal policy (absent: on-policy).
        returns, old_values: ``[N]``, the critic's targets and its values at the rollout (value losses).
        teacher_topk_ids, teacher_topk_logprobs: ``[N, K]`` a teacher's top-k token ids (long, ``-1`` =
            absent) and their log-probs, for top-k distillation (the tail mass is what they leave).
        rollout_topk_ids, rollout_topk_logprobs: ``[N, K]`` the sampler's top-k ids (``-1`` = absent) and
            its log-probs there, for the sampler-aware objectives (with ``Outputs(topk_logprobs=)``).
        chosen: host bools, per sequence: chosen / desirable (True) or rejected / undesirable (False), for
            preference losses; their pairs are the ``group_ids``.
        shard: a :class:`~packloss.ContextShard` when the bin is split across context-parallel ranks:
            ``seq_lens`` is then the whole bin's and every stream holds the shard's ``N_r`` tokens.

    Derived: ``layout``, ``num_seqs``, ``num_tokens``, ``members[name]`` (``[N]`` bool),
    ``weights[name]`` (``[N]`` zero off the members, or None), ``group_index`` (``[N]`` long or None).
    """

    seq_lens: Sequence[int]
    components: Mapping[str, Component]
    rollout_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    advantages: Tensor | None = None
    teacher_logits: Tensor | None = None
    teacher_hidden: Tensor | None = None
    teacher_weight: Tensor | None = None
    group_ids: Sequence[int] | None = None
    old_logprobs: Tensor | None = None
    returns: Tensor | None = None
    old_values: Tensor | None = None
    teacher_topk_ids: Tensor | None = None
    teacher_topk_logprobs: Tensor | None = None
    rollout_topk_ids: Tensor | None = None
    rollout_topk_logprobs: Tensor | None = None
    chosen: Sequence[bool] | None = None
    shard: ContextShard | None = None
    layout: Layout = field(init=False, repr=False)
    members: dict[str, Tensor] = field(init=False, repr=False)
    weights: dict[str, Tensor | None] = field(init=False, repr=False)
    group_index: Tensor | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.components, Mapping):
            raise TypeError(f"components must be a mapping {{name: Component}}, got {type(self.components).__name__}")
        if not self.components:
            raise ValueError("components is empty: a plan needs at least one component")
        for name, comp in self.components.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"component names must be non-empty strings, got {name!r}")
            if not isinstance(comp, Component):
                raise TypeError(f"components[{name!r}] must be a Component, got {type(comp).__name__}")
            if comp.mask is None and comp.weights is None:
                raise ValueError(f"components[{name!r}] needs mask, weights or both")
        object.__setattr__(self, "components", dict(self.components))
        lens = check_seq_lens(self.seq_lens)
        object.__setattr__(self, "seq_lens", lens)
        n = sum(lens)
        if self.shard is not None:
            if not isinstance(self.shard, ContextShard):
                raise TypeError(f"shard must be a ContextShard or None, got {type(self.shard).__name__}")
            if self.shard.seq_lens != lens:
                raise ValueError("seq_lens must be the whole bin's, as the shard's: they differ")
            n = self.shard.num_tokens
        first_name, first = next(
            (f"components[{k!r}].mask", c.mask) if c.mask is not None else (f"components[{k!r}].weights", c.weights)
            for k, c in self.components.items()
        )
        if first.dim() == 1 and first.shape[0] != n:
            held = f"the shard holds {n} tokens" if self.shard is not None else f"seq_lens sums to {n}"
            raise ValueError(f"{held} but {first_name} holds {first.shape[0]}")
        self._check_tensors(n, first.device)
        layout = Layout.build(lens, first.device) if self.shard is None else self.shard.layout(first.device)
        object.__setattr__(self, "layout", layout)
        group_index = None
        if self.group_ids is not None:
            object.__setattr__(self, "group_ids", check_group_ids(self.group_ids, layout.num_seqs))
            group_index = layout.broadcast_ints(self.group_ids, first.device)
        object.__setattr__(self, "group_index", group_index)
        if self.chosen is not None:
            object.__setattr__(self, "chosen", checks.host_flags("chosen", self.chosen, layout.num_seqs))
        members: dict[str, Tensor] = {}
        weights: dict[str, Tensor | None] = {}
        for name, comp in self.components.items():
            m = comp.mask
            if comp.weights is not None and comp.weights_select:
                nonzero = comp.weights != 0
                m = nonzero if m is None else m & nonzero
            members[name] = m
            weights[name] = None if comp.weights is None else torch.where(m, upcast(comp.weights), 0.0)
            if comp.normalize is Normalize.GROUP_MEAN and self.group_ids is None:
                raise ValueError(f"components[{name!r}] uses normalize='group_mean', which needs the plan's group_ids")
            if isinstance(comp.loss, Objective):
                comp.loss.check_plan(self, name)
        object.__setattr__(self, "members", members)
        object.__setattr__(self, "weights", weights)

    def _check_tensors(self, n: int, device: torch.device) -> None:
        def check(name: str, value: object, dims: int, boolean: bool = False) -> None:
            if value is None:
                return
            checks.tensor(name, value, floating=not boolean, boolean=boolean)
            if value.dim() != dims or value.shape[0] != n:
                width = "V" if name == "teacher_logits" else "K" if "topk" in name else "H_t"
                want = f"[{n}]" if dims == 1 else f"[N, {width}] with N={n}"
                raise ValueError(f"{name} must have shape {want}, got {list(value.shape)}")
            if value.device != device:
                raise ValueError(f"{name} is on {value.device} but the plan's other tensors are on {device}")

        for cname, comp in self.components.items():
            check(f"components[{cname!r}].mask", comp.mask, 1, boolean=True)
            check(f"components[{cname!r}].weights", comp.weights, 1)
        for name in TOKEN_STREAMS:
            check(name, getattr(self, name), 1)
        check("teacher_logits", self.teacher_logits, 2)
        for source in ("teacher", "rollout"):
            ids_name, lp_name = f"{source}_topk_ids", f"{source}_topk_logprobs"
            ids, logprobs = getattr(self, ids_name), getattr(self, lp_name)
            check(lp_name, logprobs, 2)
            if (ids is None) != (logprobs is None):
                raise ValueError(f"{ids_name} and {lp_name} go together: give both or neither")
            if ids is not None:
                checks.tensor(ids_name, ids)
                if ids.dtype not in (torch.int32, torch.int64) or ids.shape != logprobs.shape:
                    raise ValueError(
                        f"{ids_name} must be int32/int64 of the shape of {lp_name} {list(logprobs.shape)}, "
                        f"got {ids.dtype} {list(ids.shape)}"
                    )
                checks.same_device("the plan", device, **{ids_name: ids})
        check("teacher_hidden", self.teacher_hidden, 2)
        if (self.teacher_hidden is None) != (self.teacher_weight is None):
            raise ValueError("teacher_hidden and teacher_weight go together: give both or neither")
        if self.teacher_hidden is not None:
            if self.teacher_logits is not None:
                raise ValueError("give teacher_logits or teacher_hidden + teacher_weight, not both")
            tw, h = checks.tensor("teacher_weight", self.teacher_weight, floating=True), self.teacher_hidden.shape[1]
            if tw.dim() != 2 or tw.shape[1] != h:
                raise ValueError(f"teacher_weight must have shape [V, H_t={h}], got {list(tw.shape)}")
            if tw.device != device:
                raise ValueError(f"teacher_weight is on {tw.device} but the plan's other tensors are on {device}")

    @property
    def num_seqs(self) -> int:
        return self.layout.num_seqs

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens

    @property
    def device(self) -> torch.device:
        return self.layout.seq_ids.device

    @property
    def num_groups(self) -> int:
        """``max(group_ids) + 1`` (0 without group ids): the group-id space this plan needs."""
        return 0 if self.group_ids is None else max(self.group_ids) + 1

    def require(self, stream: str, component: str) -> Tensor:
        """The pre-forward stream ``stream``, or a ``ValueError`` naming the component that needs it."""
        value = getattr(self, stream)
        if value is None:
            raise ValueError(f"component {component!r} needs the plan's {stream}, got None")
        return value

    def validate(self, deep: bool = False) -> Plan:
        """Return ``self``; with ``deep=True`` read values (one sync per check) and raise a
        ``ValueError`` naming the stream: on the members of any component, log-probs finite and
        ≤ 0 and advantages finite; weights finite everywhere; teacher logits not NaN on members."""
        if not deep:
            return self
        any_member = torch.zeros(self.num_tokens, dtype=torch.bool, device=self.device)
        for m in self.members.values():
            any_member = any_member | m
        for name in TOKEN_STREAMS:
            value = getattr(self, name)
            if value is None:
                continue
            v = torch.where(any_member, value.detach(), 0.0)
            if not bool(torch.isfinite(v).all()):  # sync-ok: opt-in deep validation
                raise ValueError(f"{name} holds a non-finite value on a member token")
            if name in LOGPROB_STREAMS and bool((v > 1e-4).any()):  # sync-ok: opt-in deep validation
                raise ValueError(f"{name} holds a positive log-probability on a member token")
        for cname, comp in self.components.items():
            c = comp.constant
            if isinstance(c, Tensor) and not bool(torch.isfinite(c) & (c > 0)):  # sync-ok: opt-in
                raise ValueError(f"components[{cname!r}].constant must be finite and > 0, got {c}")
            if comp.weights is not None and not bool(torch.isfinite(comp.weights).all()):  # sync-ok: opt-in
                raise ValueError(f"components[{cname!r}].weights holds a non-finite value")
        if self.teacher_logits is not None:
            rows = torch.isnan(self.teacher_logits.detach()).any(-1) & any_member
            if bool(rows.any()):  # sync-ok: opt-in deep validation
                raise ValueError("teacher_logits holds NaN on a member token")
        return self


@dataclass(frozen=True, eq=False)
class Aggregation:
    """How a component's per-token loss becomes its term: ``Σ_t m_t · w_t · ℓ_t / d_t / D`` with
    ``mask [N]`` bool, ``weights [N]`` (zero off the members) or None, ``divisor [N]`` (≥ 1) or
    None, and ``denominator`` a number or a 0-d tensor; ``member_counts [S]`` the whole bin's
    members per sequence when the mode counted them (``sequence_mean``), else None."""

    mask: Tensor
    weights: Tensor | None
    divisor: Tensor | None
    denominator: Tensor | float
    member_counts: Tensor | None = None

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


class Selection(NamedTuple):
    """The step-wide selection of one component in one bin: ``selected [N]`` bool, ``scores [N]`` float64."""

    selected: Tensor
    scores: Tensor


@dataclass(frozen=True, eq=False)
class ComponentInputs:
    """What a component loss sees: the plan (pre-forward streams, layout), the forward's outputs, its
    name, its aggregation (members, weights, divisor, denominator), the metrics mode, and the
    step-wide selection when its objective selects over the step (else None)."""

    plan: Plan
    outputs: Outputs
    name: str
    aggregation: Aggregation
    per_sequence_metrics: bool = False
    selection: Selection | None = None

    @property
    def loss_mask(self) -> Tensor:
        """``[N]`` bool, this component's members."""
        return self.aggregation.mask

    @property
    def trainer_logprobs(self) -> Tensor:
        return self.outputs.require("logprobs", self.name)

    @property
    def rollout_logprobs(self) -> Tensor | None:
        return self.plan.rollout_logprobs

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
    def segments(self) -> Segments:
        """The bin's per-sequence reductions (exact across context-parallel ranks), knowing this
        component's member counts when its aggregation has them."""
        segments, counts = self.plan.layout.segments, self.aggregation.member_counts
        if counts is None or not segments.sharded:
            return segments
        return replace(segments, known=(self.aggregation.mask, counts))

    @property
    def num_seqs(self) -> int:
        return self.plan.num_seqs

    def mean(self, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`masked_mean` with this bin's layout and metrics mode."""
        return masked_mean(values, mask, self.segments, self.per_sequence_metrics)


@dataclass
class ComponentOutput:
    """A component's per-token loss ``[N]`` and metrics. ``counts`` maps a metric to the member count
    it was taken over (default: the component's members). ``loss`` is set only by fused components,
    which apply ``inputs.aggregation`` themselves; ``per_token`` is then for metrics only."""

    per_token: Tensor | None
    metrics: dict[str, Tensor] = field(default_factory=dict)
    counts: dict[str, Tensor] = field(default_factory=dict)
    loss: Tensor | None = None
