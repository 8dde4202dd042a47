"""Paired preference losses on packed bins: :class:`DPO` (sigmoid / cDPO, robust, hinge, IPO),
:class:`SimPO` and :class:`ORPO`. A pair is a prompt group (``Plan.group_ids``) holding one chosen
and one rejected sequence (``Plan.chosen``) of the same bin; its log-probabilities are segment sums
over the component's members, so padding and member-less pairs never become a pair. The pair's loss
``L_g`` is every member token's loss, and ``normalize="group_mean"`` makes the term the mean over the
step's pairs. KTO (unpaired): :mod:`packloss.core.kto`. Layout and peer names: ``docs/preference.md``."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from packloss.core import checks
from packloss.core.bin import ComponentInputs, ComponentOutput, Normalize, Objective, Plan
from packloss.core.dtypes import upcast

__all__ = ["DPO", "SimPO", "ORPO", "DPO_LOSS_TYPES", "PairTerms", "PairedObjective"]

DPO_LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo")
PAIR_MODES = (Normalize.GROUP_MEAN, Normalize.SEQUENCE_MEAN)

_TABLES: weakref.WeakKeyDictionary[Plan, dict[str, Tensor]] = weakref.WeakKeyDictionary()
"""Per plan, the device tensors its preference components read, built from the host ``group_ids`` /
``chosen`` at plan construction (``check_plan``), so ``__call__`` copies nothing from the host."""


def require_mode(plan: Plan, name: str, allowed: tuple[Normalize, ...], what: str) -> None:
    """A ``ValueError`` unless component ``name`` normalises with one of ``allowed``: ``what`` (e.g.
    "DPO's loss per pair") is given to each member token, and another mode weights it by its tokens."""
    mode = plan.components[name].normalize
    if mode not in allowed:
        choices = " or ".join(repr(m.value) for m in allowed)
        raise ValueError(
            f"component {name!r}: {what} is given to each of its member tokens, so normalize={mode.value!r} "
            f"would weight it by its token count; use normalize={choices}"
        )


def table(plan: Plan, key: str, build: Callable[[Plan], Tensor]) -> Tensor:
    """The cached device tensor ``key`` of ``plan`` (``build(plan)`` on a miss)."""
    tables = _TABLES.setdefault(plan, {})
    if key not in tables:
        tables[key] = build(plan)
    return tables[key]


def pair_order(plan: Plan, name: str) -> list[int]:
    """The bin's sequences ordered chosen, rejected of pair 0, then of pair 1, …: each group id of the
    bin must hold exactly one chosen and one rejected sequence (host ints, checked at plan time)."""
    groups: dict[int, list[int]] = {}
    for s, g in enumerate(plan.group_ids):
        groups.setdefault(g, []).append(s)
    order: list[int] = []
    for g, seqs in groups.items():
        if len(seqs) != 2:
            raise ValueError(
                f"component {name!r}: group {g} holds {len(seqs)} sequence(s) {seqs} in this bin; a pair is one "
                "chosen and one rejected sequence of the same bin, with a group id of its own"
            )
        a, b = seqs
        if plan.chosen[a] == plan.chosen[b]:
            kind = "chosen" if plan.chosen[a] else "rejected"
            raise ValueError(
                f"component {name!r}: group {g} holds two {kind} sequences ({a} and {b}); a pair is one chosen "
                "and one rejected sequence"
            )
        order += [a, b] if plan.chosen[a] else [b, a]
    return order


def _build_pairs(plan: Plan, name: str) -> Tensor:
    order = pair_order(plan, name)
    pair_of = [0] * len(order)
    for k, s in enumerate(order):
        pair_of[s] = k // 2
    return torch.tensor([order, pair_of], dtype=torch.long).to(plan.device)  # [2, S]: one host→device copy


def sequence_sums(inputs: ComponentInputs, with_ref: bool) -> Tensor:
    """``[S, 3]``: per sequence, over the component's members, ``Σ trn`` (differentiable), ``Σ ref``
    (detached; 0 without ``with_ref``) and the member count, in the compute dtype. One segment sum
    (one ``all_reduce`` over a context-parallel group)."""
    m = inputs.loss_mask  # [N]
    trn = upcast(inputs.trainer_logprobs)  # [N]
    ref = upcast(inputs.plan.require("ref_logprobs", inputs.name).detach()) if with_ref else None
    dtype = trn.dtype if ref is None else torch.promote_types(trn.dtype, ref.dtype)
    zero = torch.zeros((), dtype=dtype, device=trn.device)
    cols = [
        torch.where(m, trn.to(dtype), zero),
        zero.expand(m.shape) if ref is None else torch.where(m, ref.to(dtype), zero),
        m.to(dtype),
    ]
    return inputs.segments.sum(torch.stack(cols, dim=1))  # [S, 3]


def scalar_means(named: dict[str, tuple[Tensor, Tensor]]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``{name: (values [K], counted [K] bool)}`` → the means over the counted entries and their counts."""
    metrics, counts = {}, {}
    for key, (values, counted) in named.items():
        n = counted.sum(dtype=torch.float32)
        metrics[key] = torch.where(counted, values.detach(), 0.0).sum() / n.clamp_min(1)
        counts[key] = n
    return metrics, counts


class PairTerms(NamedTuple):
    """A bin's pairs ``[P]`` each, index 0 chosen, 1 rejected on the last axis: ``policy [P, 2]`` the
    sequences' summed trainer log-probs, ``ref [P, 2]`` the reference's (zeros for reference-free
    losses), ``count [P, 2]`` their members."""

    policy: Tensor
    ref: Tensor
    count: Tensor

    @property
    def logratio(self) -> Tensor:
        """``Σ (trn − ref)`` per sequence.  ``[P, 2]``."""
        return self.policy - self.ref

    def mean(self, x: Tensor) -> Tensor:
        """``x / max(count, 1)``: a sequence's per-token mean (0 without members, as TRL's clamp).  ``[P, 2]``."""
        return x / self.count.clamp_min(1)


class PairedObjective(Objective):
    """The pair machinery of the paired losses: ``check_plan`` (group ids, chosen flags, the reference
    where read, the mode, one chosen + one rejected per group of the bin) and ``__call__``, which hands
    :meth:`pair_loss` the bin's :class:`PairTerms` and spreads each pair's loss to its member tokens.
    Metrics (TRL's names), each over the bin's pairs with members (counts: pairs): ``loss`` (the mean
    pair loss), ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``
    (``reward_c > reward_r``), ``logps/chosen``, ``logps/rejected``, and the loss's own."""

    uses_reference = True

    def pair_loss(self, t: PairTerms) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
        """``(L [P], rewards [P, 2], logps [P, 2], extra metrics {name: [P]})``."""
        raise NotImplementedError

    def check_plan(self, plan: Plan, name: str) -> None:
        what = type(self).__name__
        if plan.group_ids is None:
            raise ValueError(f"component {name!r} ({what}) needs the plan's group_ids: one group id per pair")
        if plan.chosen is None:
            raise ValueError(f"component {name!r} ({what}) needs the plan's chosen flags (True = chosen)")
        if self.uses_reference:
            plan.require("ref_logprobs", name)
        require_mode(plan, name, PAIR_MODES, f"{what}'s loss per pair")
        table(plan, "pairs", lambda p: _build_pairs(p, name))

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        order, pair_of = table(inputs.plan, "pairs", lambda p: _build_pairs(p, inputs.name))  # [S] each
        stats = sequence_sums(inputs, self.uses_reference)  # [S, 3]
        p = inputs.num_seqs // 2
        ordered = stats.index_select(0, order).view(p, 2, 3)  # [P, 2, 3]
        terms = PairTerms(ordered[..., 0], ordered[..., 1], ordered[..., 2])
        loss, rewards, logps, extra = self.pair_loss(terms)
        seg = inputs.segments
        per_token = seg.broadcast(loss.index_select(0, pair_of))  # [N]
        active = terms.count.sum(1) > 0  # [P]: a pair without members is no pair
        rewards, logps = rewards.detach(), logps.detach()
        named = {
            "loss": loss,
            "rewards/chosen": rewards[:, 0],
            "rewards/rejected": rewards[:, 1],
            "rewards/margins": rewards[:, 0] - rewards[:, 1],
            "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).to(rewards.dtype),
            "logps/chosen": logps[:, 0],
            "logps/rejected": logps[:, 1],
            **extra,
        }
        active_seq = active.index_select(0, pair_of)  # [S]
        if inputs.per_sequence_metrics:
            count = active_seq.to(torch.float32)
            metrics = {k: v.detach().index_select(0, pair_of) for k, v in named.items()}  # [S] each
            return ComponentOutput(per_token, metrics, dict.fromkeys(metrics, count))
        # a context-parallel bin's pair is reported by the rank that reports its chosen sequence
        reported = seg.reported(active_seq).index_select(0, order).view(p, 2)[:, 0]  # [P]
        metrics, counts = scalar_means({k: (v, reported) for k, v in named.items()})
        return ComponentOutput(per_token, metrics, counts)


def _smoothed_logistic(u: Tensor, eps: float) -> Tensor:
    """``−(1 − ε) log σ(u) − ε log σ(−u)`` (cDPO's label smoothing; ``ε = 0``: the logistic loss)."""
    loss = -F.logsigmoid(u)
    return loss if eps == 0 else (1 - eps) * loss - eps * F.logsigmoid(-u)


@dataclass(frozen=True)
class DPO(PairedObjective):
    """Direct preference optimisation and its reference-based variants. Per pair ``g`` (chosen ``c``,
    rejected ``r``) with ``ρ_i = Σ_{t∈i} (trn_t − ref_t)`` over the members, ``ρ̄_i = ρ_i / n_i`` with
    ``average_log_prob``, ``Δ = ρ̄_c − ρ̄_r`` and ``u = β Δ``::

        sigmoid  L_g = −(1 − ε) log σ(u) − ε log σ(−u)                  (DPO; ε > 0: cDPO)
        robust   L_g = (−(1 − ε) log σ(u) + ε log σ(−u)) / (1 − 2ε)     (Chowdhury et al. 2024)
        hinge    L_g = max(0, 1 − u)                                    (SLiC)
        ipo      L_g = (Δ − 1 / (2β))²                                  (IPO, Azar et al. 2023, eq. 17)

    Args:
        beta: ``β > 0``.
        loss_type: one of :data:`DPO_LOSS_TYPES`.
        label_smoothing: ``ε``, in ``[0, 0.5]`` (sigmoid) or ``[0, 0.5)`` (robust); 0 for hinge and ipo.
        average_log_prob: divide each sequence's ``ρ`` by its members (TRL's ``ipo`` and ``sigmoid_norm``);
            None: True for ipo (TRL), False otherwise. OpenRLHF's ``ipo=True`` sums: ``False``.

    Reads trainer and reference log-probs. Metrics (:class:`PairedObjective`): rewards ``β ρ_i`` (sums,
    as TRL also for ipo), logps ``Σ trn``.
    """

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    average_log_prob: bool | None = None

    def __post_init__(self) -> None:
        checks.positive("DPO.beta", self.beta)
        checks.choice("DPO.loss_type", self.loss_type, DPO_LOSS_TYPES)
        eps = checks.nonnegative("DPO.label_smoothing", self.label_smoothing)
        if self.loss_type in ("hinge", "ipo") and eps != 0:
            raise ValueError(
                f"DPO.label_smoothing applies to 'sigmoid' and 'robust', not {self.loss_type!r}: got {eps}"
            )
        if self.loss_type == "sigmoid" and eps > 0.5:
            raise ValueError(f"DPO.label_smoothing must be in [0, 0.5] for 'sigmoid', got {eps}")
        if self.loss_type == "robust" and not eps < 0.5:
            raise ValueError(f"DPO.label_smoothing must be in [0, 0.5) for 'robust', got {eps}")
        if self.average_log_prob is not None:
            checks.flag("DPO.average_log_prob", self.average_log_prob)

    @property
    def length_normalized(self) -> bool:
        """Whether ``ρ`` is divided by the members (``average_log_prob``, or its default)."""
        return self.loss_type == "ipo" if self.average_log_prob is None else self.average_log_prob

    def pair_loss(self, t: PairTerms) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
        rho = t.logratio  # [P, 2]
        score = t.mean(rho) if self.length_normalized else rho
        delta = score[:, 0] - score[:, 1]  # [P]
        u = self.beta * delta
        eps = self.label_smoothing
        if self.loss_type == "sigmoid":
            loss = _smoothed_logistic(u, eps)
        elif self.loss_type == "robust":
            loss = (-(1 - eps) * F.logsigmoid(u) + eps * F.logsigmoid(-u)) / (1 - 2 * eps)
        elif self.loss_type == "hinge":
            loss = torch.relu(1 - u)
        else:
            loss = (delta - 1 / (2 * self.beta)) ** 2
        return loss, self.beta * rho, t.policy, {}


@dataclass(frozen=True)
class SimPO(PairedObjective):
    """SimPO (Meng et al. 2024), reference-free and length-normalised: with the mean log-probs
    ``ā_i = Σ_{t∈i} trn_t / n_i`` over the members and ``γ = gamma_beta_ratio · β``::

        u = β (ā_c − ā_r) − γ,   L_g = −(1 − ε) log σ(u) − ε log σ(−u)

    TRL: ``CPOTrainer`` with ``loss_type="simpo"``, ``simpo_gamma = γ``, ``cpo_alpha = 0`` (CPO-SimPO's
    NLL on the chosen sequences is an :class:`~packloss.SFT` component beside it). Reads trainer
    log-probs only. Metrics as TRL's CPO: rewards ``β ā_i``, logps ``ā_i``.
    """

    beta: float = 2.0
    gamma_beta_ratio: float = 0.25
    label_smoothing: float = 0.0

    uses_reference = False

    def __post_init__(self) -> None:
        checks.positive("SimPO.beta", self.beta)
        checks.number("SimPO.gamma_beta_ratio", self.gamma_beta_ratio)
        if not 0 <= checks.number("SimPO.label_smoothing", self.label_smoothing) <= 0.5:
            raise ValueError(f"SimPO.label_smoothing must be in [0, 0.5], got {self.label_smoothing}")

    def pair_loss(self, t: PairTerms) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
        mean = t.mean(t.policy)  # [P, 2]
        u = self.beta * (mean[:, 0] - mean[:, 1]) - self.gamma_beta_ratio * self.beta
        return _smoothed_logistic(u, self.label_smoothing), self.beta * mean, mean, {}


_LN_HALF = -math.log(2)


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 − eˣ)`` for ``x ≤ 0`` without cancellation: ``log1p(−eˣ)`` below ``−ln 2``, ``log(−expm1(x))``
    above (Mächler 2012). Both branches are finite for ``x < 0``; at ``x = 0`` the value is ``−∞``."""
    return torch.where(x < _LN_HALF, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@dataclass(frozen=True)
class ORPO(PairedObjective):
    """ORPO's odds-ratio term (Hong et al. 2024), reference-free, on the mean log-probs
    ``ā_i = Σ_{t∈i} trn_t / n_i`` over the members (so ``P_i = e^{ā_i}``)::

        log OR = (ā_c − ā_r) − (log(1 − e^{ā_c}) − log(1 − e^{ā_r})),   L_g = −β log σ(log OR)

    ORPO's NLL on the chosen sequence is not in this objective: compose an :class:`~packloss.SFT`
    component on the chosen sequences' tokens with ``normalize="token"`` (TRL's ``ORPOTrainer``
    averages it over every chosen token of the batch, prompt included: a token mean over other
    tokens than the pair mean, so it cannot share this component's normalisation). Both sequences
    of a pair need members: an empty one has ``ā = 0``, probability 1 and infinite odds. Reads
    trainer log-probs only. Metrics as TRL: rewards ``β ā_i``, logps ``ā_i``, ``log_odds_ratio`` (the
    mean ``log σ(log OR)``), ``log_odds_chosen`` (the mean ``log OR``).
    """

    beta: float = 0.1

    uses_reference = False

    def __post_init__(self) -> None:
        checks.positive("ORPO.beta", self.beta)

    def pair_loss(self, t: PairTerms) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
        mean = t.mean(t.policy)  # [P, 2]
        log_odds = (mean[:, 0] - mean[:, 1]) - (log1mexp(mean[:, 0]) - log1mexp(mean[:, 1]))  # [P]
        ratio = F.logsigmoid(log_odds)
        extra = {"log_odds_ratio": ratio, "log_odds_chosen": log_odds}
        return -self.beta * ratio, self.beta * mean, mean, extra
