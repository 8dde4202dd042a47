"""The plan of a packed bin (built before the forward) and the forward's outputs.

* :class:`Component` — one loss component of a bin: its loss (an objective such as
  :data:`~packloss.DPPO`, :class:`~packloss.SFT`, :class:`~packloss.Entropy`,
  :class:`~packloss.VocabDistill` or any callable), its members (``mask``, ``weights``) and its
  normalisation (stated here, once).
* :class:`Plan` — the layout (``seq_lens``, optional prompt ``group_ids``), the components by name,
  and the streams known before the forward (inference / reference log-probs, advantages, teacher
  logits or hidden states). Step denominators are counted from plans
  (:func:`~packloss.count_denominators`).
* :class:`Outputs` — what the forward produced: trainer log-probs, entropy, student logits, or hidden
  states with the LM-head weight.

Construction runs cheap checks that read only shapes, dtypes and devices (no sync);
``Plan.validate(deep=True)`` also reads values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from packloss.core.components import ComponentLoss
from packloss.core.layout import Layout, check_seq_lens
from packloss.core.normalize import Normalize, as_normalize

__all__ = ["Component", "Plan", "Outputs"]

_LOGPROB_STREAMS = ("inference_logprobs", "old_logprobs", "ref_logprobs")
_TOKEN_STREAMS = ("inference_logprobs", "old_logprobs", "ref_logprobs", "advantages")


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


@dataclass(frozen=True, eq=False)
class Component:
    """One loss component of a bin.

    Args:
        loss: the component's loss, ``loss(ComponentInputs) -> ComponentOutput`` (see
            :mod:`packloss.core.components`): a :class:`~packloss.PolicyGradient` objective, ``SFT()``,
            ``Entropy(...)``, ``VocabDistill(...)`` or a function of your own.
        mask: ``[N]`` bool, the tokens the component trains on (None: every token with a non-zero
            weight).
        weights: ``[N]`` float per-token weights or None (1). Members are ``mask & (weights != 0)``.
        normalize: the mode (:class:`~packloss.Normalize` or its string), default ``"token"``.
        constant: ``C`` of ``normalize="constant"`` (and only there): a finite number > 0, or a 0-d
            tensor (e.g. a count all-reduced elsewhere; its value is checked by
            ``Plan.validate(deep=True)``, not on the hot path).
    """

    loss: ComponentLoss
    mask: Tensor | None = None
    weights: Tensor | None = None
    normalize: Normalize | str = Normalize.TOKEN
    constant: float | Tensor | None = None

    def __post_init__(self) -> None:
        if not callable(self.loss):
            raise TypeError(f"loss must be a callable component loss, got {type(self.loss).__name__}")
        object.__setattr__(self, "normalize", as_normalize(self.normalize))
        if self.normalize is Normalize.CONSTANT:
            if self.constant is None:
                raise ValueError("normalize='constant' needs constant= (the constant C)")
            if isinstance(self.constant, Tensor):
                if self.constant.dim() != 0 or self.constant.dtype == torch.bool or self.constant.is_complex():
                    raise ValueError(
                        f"constant must be a number or a 0-d real tensor, got shape {list(self.constant.shape)}"
                    )
            else:
                object.__setattr__(self, "constant", _check_number("constant", self.constant))
        elif self.constant is not None:
            raise ValueError(f"constant is only used with normalize='constant', got normalize={self.normalize.value!r}")
        if self.mask is None and self.weights is None:
            raise ValueError("a Component needs mask, weights or both")
        if self.mask is not None:
            if not isinstance(self.mask, Tensor):
                raise TypeError(f"mask must be a torch.Tensor, got {type(self.mask).__name__}")
            if self.mask.dtype != torch.bool:
                raise TypeError(f"mask must be a bool tensor, got {self.mask.dtype}")
        if self.weights is not None:
            if not isinstance(self.weights, Tensor):
                raise TypeError(f"weights must be a torch.Tensor, got {type(self.weights).__name__}")
            if not self.weights.is_floating_point():
                raise TypeError(f"weights must be a floating-point tensor, got {self.weights.dtype}")

    @property
    def mode(self) -> tuple[Normalize, float | None]:
        """``(normalize, constant)``, what step denominators must have been counted for."""
        return self.normalize, self.constant


def _first_tensor(components: Mapping[str, Component]) -> tuple[str, Tensor]:
    for name, comp in components.items():
        if comp.mask is not None:
            return f"components[{name!r}].mask", comp.mask
        return f"components[{name!r}].weights", comp.weights
    raise ValueError("components is empty: a plan needs at least one component")


@dataclass(frozen=True, eq=False)
class Plan:
    """A packed bin before its forward: layout, components and the pre-forward streams.

    Args:
        seq_lens: host ints, the lengths of the ``S`` packed sequences (each > 0, sum ``N``).
        components: ``{name: Component}``, at least one; names are free (``"rl"``, ``"sft"``, ...)
            and prefix the metrics (``"rl/is_masked"``).
        inference_logprobs: ``[N]``, log-probs under the rollout / behaviour policy that sampled
            (policy-gradient, sampled distillation).
        old_logprobs: ``[N]``, log-probs under the old / proximal policy the trust region is measured
            against (:class:`~packloss.PolicyGradient` with ``ratio="old"``); absent: on-policy.
        ref_logprobs: ``[N]``, reference / teacher log-probs of the sampled tokens.
        advantages: ``[N]`` float.
        teacher_logits: ``[N, V]`` teacher logits for full-vocabulary distillation, or
        teacher_hidden, teacher_weight: ``[N, H_t]`` and ``[V, H_t]``, a teacher head.
        group_ids: host ints, the prompt group of every sequence (``[S]``, ``≥ 0``), needed by
            ``normalize="group_mean"``; ids are global over the step.

    Derived: ``layout`` (:class:`~packloss.core.layout.Layout`), ``num_seqs``, ``num_tokens``,
    ``members[name]`` (``[N]`` bool), ``weights[name]`` (``[N]`` zero off the members, or None),
    ``group_index`` (``[N]`` long or None).
    """

    seq_lens: Sequence[int]
    components: Mapping[str, Component]
    inference_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    advantages: Tensor | None = None
    teacher_logits: Tensor | None = None
    teacher_hidden: Tensor | None = None
    teacher_weight: Tensor | None = None
    group_ids: Sequence[int] | None = None
    old_logprobs: Tensor | None = None
    layout: Layout = field(init=False, repr=False)
    members: dict[str, Tensor] = field(init=False, repr=False)
    weights: dict[str, Tensor | None] = field(init=False, repr=False)
    group_index: Tensor | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.components, Mapping):
            raise TypeError(f"components must be a mapping {{name: Component}}, got {type(self.components).__name__}")
        for name, comp in self.components.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"component names must be non-empty strings, got {name!r}")
            if not isinstance(comp, Component):
                raise TypeError(f"components[{name!r}] must be a Component, got {type(comp).__name__}")
        object.__setattr__(self, "components", dict(self.components))
        lens = check_seq_lens(self.seq_lens)
        object.__setattr__(self, "seq_lens", lens)
        first_name, first = _first_tensor(self.components)
        if first.dim() == 1 and first.shape[0] != sum(lens):
            raise ValueError(f"seq_lens sums to {sum(lens)} but {first_name} holds {first.shape[0]} tokens")
        device = first.device
        self._check_tensors(sum(lens), device)
        layout = Layout.build(lens, device)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "group_index", self._group_index(layout, device))
        members: dict[str, Tensor] = {}
        weights: dict[str, Tensor | None] = {}
        for name, comp in self.components.items():
            m = comp.mask
            if comp.weights is not None:
                nonzero = comp.weights != 0
                m = nonzero if m is None else m & nonzero
            members[name] = m
            weights[name] = None if comp.weights is None else torch.where(m, _upcast(comp.weights), 0.0)
            if comp.normalize is Normalize.GROUP_MEAN and self.group_ids is None:
                raise ValueError(f"components[{name!r}] uses normalize='group_mean', which needs the plan's group_ids")
            check = getattr(comp.loss, "check_plan", None)
            if check is not None:
                check(self, name)
        object.__setattr__(self, "members", members)
        object.__setattr__(self, "weights", weights)

    def _check_tensors(self, n: int, device: torch.device) -> None:
        def check(name: str, value: object, shape: tuple[int, ...] | None, floating: bool = True) -> None:
            if value is None:
                return
            if not isinstance(value, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(value).__name__}")
            if shape is not None and tuple(value.shape) != shape:
                raise ValueError(f"{name} must have shape {list(shape)}, got {list(value.shape)}")
            if value.device != device:
                raise ValueError(f"{name} is on {value.device} but the plan's other tensors are on {device}")
            if floating and not value.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")

        for cname, comp in self.components.items():
            check(f"components[{cname!r}].mask", comp.mask, (n,), floating=False)
            check(f"components[{cname!r}].weights", comp.weights, (n,))
        for name in _TOKEN_STREAMS:
            check(name, getattr(self, name), (n,))
        t = self.teacher_logits
        check("teacher_logits", t, None)
        if t is not None and (t.dim() != 2 or t.shape[0] != n):
            raise ValueError(f"teacher_logits must have shape [N, V] with N={n}, got {list(t.shape)}")
        check("teacher_hidden", self.teacher_hidden, None)
        check("teacher_weight", self.teacher_weight, None)
        if (self.teacher_hidden is None) != (self.teacher_weight is None):
            raise ValueError("teacher_hidden and teacher_weight go together: give both or neither")
        if self.teacher_hidden is not None:
            if t is not None:
                raise ValueError("give teacher_logits or teacher_hidden + teacher_weight, not both")
            th, tw = self.teacher_hidden, self.teacher_weight
            if th.dim() != 2 or th.shape[0] != n:
                raise ValueError(f"teacher_hidden must have shape [N, H_t] with N={n}, got {list(th.shape)}")
            if tw.dim() != 2 or tw.shape[1] != th.shape[1]:
                raise ValueError(f"teacher_weight must have shape [V, H_t={th.shape[1]}], got {list(tw.shape)}")

    def _group_index(self, layout: Layout, device: torch.device) -> Tensor | None:
        if self.group_ids is None:
            return None
        ids = check_group_ids(self.group_ids, layout.num_seqs)
        object.__setattr__(self, "group_ids", ids)
        return layout.broadcast_ints(ids, device)

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
        for name in _TOKEN_STREAMS:
            value = getattr(self, name)
            if value is None:
                continue
            v = torch.where(any_member, value.detach(), 0.0)
            if not bool(torch.isfinite(v).all()):  # sync-ok: opt-in deep validation
                raise ValueError(f"{name} holds a non-finite value on a member token")
            if name in _LOGPROB_STREAMS and bool((v > 1e-4).any()):  # sync-ok: opt-in deep validation
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


def check_group_ids(group_ids: Sequence[int], num_seqs: int) -> tuple[int, ...]:
    """``group_ids`` as a tuple of ``S`` non-negative host ints."""
    if isinstance(group_ids, Tensor):
        raise TypeError("group_ids must be host-side Python ints (a list or tuple), not a tensor")
    if isinstance(group_ids, str | bytes) or not isinstance(group_ids, Sequence):
        raise TypeError(f"group_ids must be a list or tuple of ints, got {type(group_ids).__name__}")
    ids = tuple(group_ids)
    if len(ids) != num_seqs:
        raise ValueError(f"group_ids holds {len(ids)} ids for S={num_seqs} sequences")
    for g in ids:
        if isinstance(g, bool) or not isinstance(g, int):
            raise TypeError(f"group_ids must hold Python ints, got {type(g).__name__}")
        if g < 0:
            raise ValueError(f"group_ids must be >= 0, got {g}")
    return ids


def _upcast(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


_OUTPUT_SHAPES = {"logprobs": 1, "entropy": 1, "logits": 2, "hidden": 2}


@dataclass(frozen=True, eq=False)
class Outputs:
    """What the forward produced for a bin (give what your components use).

    Args:
        logprobs: ``[N]`` trainer log-probs of the sampled tokens (gradients flow here).
        entropy: ``[N]`` per-token entropy of the trainer policy (the entropy component).
        logits: ``[N, V]`` student logits (full-vocabulary distillation from logits).
        hidden: ``[N, H]`` final hidden states and
        head_weight: ``[V, H]`` the LM-head weight (full-vocabulary distillation through the fused
            head; the ``N × V`` logits never exist).
    """

    logprobs: Tensor | None = None
    entropy: Tensor | None = None
    logits: Tensor | None = None
    hidden: Tensor | None = None
    head_weight: Tensor | None = None

    def __post_init__(self) -> None:
        for name in (*_OUTPUT_SHAPES, "head_weight"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, Tensor):
                raise TypeError(f"outputs.{name} must be a torch.Tensor or None, got {type(value).__name__}")
            if not value.is_floating_point():
                raise TypeError(f"outputs.{name} must be a floating-point tensor, got {value.dtype}")
        if (self.hidden is None) != (self.head_weight is None):
            raise ValueError("outputs.hidden and outputs.head_weight go together: give both or neither")
        if self.hidden is not None and (
            self.head_weight.dim() != 2 or self.head_weight.shape[1] != self.hidden.shape[-1]
        ):
            raise ValueError(
                f"outputs.head_weight must be [V, H] with H={self.hidden.shape[-1]}, got {list(self.head_weight.shape)}"
            )

    def check(self, plan: Plan) -> None:
        """Raise unless every given output is ``[N]`` / ``[N, ·]`` for the plan's N and on its device."""
        n = plan.num_tokens
        for name, dims in _OUTPUT_SHAPES.items():
            value = getattr(self, name)
            if value is None:
                continue
            if value.dim() != dims or value.shape[0] != n:
                want = "[N]" if dims == 1 else "[N, ·]"
                raise ValueError(f"outputs.{name} must have shape {want} with N={n}, got {list(value.shape)}")
            if value.device != plan.device:
                raise ValueError(f"outputs.{name} is on {value.device} but the plan is on {plan.device}")

    def require(self, name: str, component: str) -> Tensor:
        """The output ``name``, or a ``ValueError`` naming the component that needs it."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"component {component!r} needs outputs.{name}, got None")
        return value

    def anchor(self) -> Tensor | None:
        """A float32 zero attached to every given output's graph, reading no value (sums over empty
        slices): keeps the loss backward-able, on every rank, when no component's term is attached."""
        zero = None
        for name in (*_OUTPUT_SHAPES, "head_weight"):
            value = getattr(self, name)
            if value is not None and value.requires_grad:
                part = value[:0].sum(dtype=torch.float32)
                zero = part if zero is None else zero + part
        return zero
