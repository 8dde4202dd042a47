"""Step-wide token selection: trust regions that choose their tokens over the whole training step.

Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models"; verl's ``clip_cov`` / ``kl_cov`` loss modes) and M2PO (Zheng et al. 2025, "Prosperity
before Collapse"; the second-moment trust region) pick tokens by a statistic of the *batch*. verl
takes the batch to be the micro-batch, so which tokens are picked depends on how the step was split.
Here the batch is the **step**: every micro-batch of every data-parallel rank, whatever the packing.

The statistic is known **before the forward**: it reads only the plan's pre-forward streams. With the
component's members ``m`` over the step and ``M = Σ m``::

    p_t = old_t  (old_logprobs; inference_logprobs when the plan has no old stream)
    A_t = adv_t  (advantages, raw: adv_coef is not applied)

On the first PPO epoch ``π_old = π_θ``, so ``p`` is the ``log π_θ`` that verl's per-micro-batch
computation reads. Clip-Cov and KL-Cov (verl's config fields, 1:1)::

    cov_t = (A_t − Ā)(p_t − p̄),   Ā = Σ_m A / M,   p̄ = Σ_m p / M           (exact means)
    Clip-Cov  candidates  m ∩ {clip_cov_lb < cov < clip_cov_ub} ∩ {not clipped at r̂}
              k = max(1, ⌊clip_cov_ratio · M⌋); selected: the k candidates of largest cov
              J_t = 0 if selected, else min(r A', clip(r, 1 − clip_low, 1 + clip_high) A')
    KL-Cov    candidates  m;  k = max(1, ⌊kl_cov_ratio · M⌋) (none when M = 0)
              J_t = r A' − ppo_kl_coef · |log r| · [t selected]          (no clip, as verl)

``r̂ = exp(p − b̂)`` is the ratio before the forward (``b̂``: ``inference_logprobs`` for
``ratio="rollout"``, else ``p`` itself, so ``r̂ = 1``): as verl on the first epoch, tokens the PPO clip
already zeroes are not candidates. M2PO::

    x_t = (old_t − inf_t)²        squared log-ratio of π_θ (at the start of the step) to the behaviour policy
    drop the members of largest x, the fewest such that the mean of x over the kept members is ≤ τ
    (an empty rest counts as 0: when even the smallest x exceeds τ every member is dropped)
    J_t = [t kept] · r A'                                                 (no clip, as the paper)

**Differences from verl, on purpose.** (1) The step, not the micro-batch. (2) Clip-Cov is
deterministic: verl draws ``k`` band tokens uniformly at random (``torch.randperm``); here the ``k``
of largest covariance are taken. (3) Ties at the ``k``-th value are all selected (``score ≥ θ``), so
slightly more than ``k`` tokens may be selected; breaking a tie by position would make the choice
depend on the packing. (4) ``Ā``, ``p̄`` are exact means (verl divides by ``M + 1e-8``). (5) The
statistic reads the pre-forward streams, so on a later PPO epoch the selection is the first epoch's
(verl re-selects with the live log-probs). (6) Members are ``mask & (weights ≠ 0)`` and the
statistics are unweighted (verl has no weights).

**How the selection is shared** (see ``docs/design.md``, "Step-wide token selection"). A selecting
region implements four hooks (:class:`StepSelector`): additive ``sums`` (``[Σ_m A, Σ_m p, M]`` or
``[Σ_m x, M]``, float64), per-token ``scores`` (−inf off the candidates) computed from a token's own
streams and the step's sums, a host ``bound`` on how many tokens a step of ``n`` tokens can select,
and the ``threshold`` from the step's largest scores. :func:`~packloss.count_denominators` adds the
sums to the flat tensor of its **one** ``all_reduce``; each rank then takes the ``K`` largest scores
of its plans (``K`` a host int) and **one** ``all_gather`` of ``[K]`` per rank (every selecting
component in one tensor) gives every rank the same candidate values, from which each computes the
same threshold. :func:`~packloss.compute_loss` recomputes the bin's scores (the same function of the
same numbers: the same bits) and selects ``score ≥ θ``. Nothing is read on the host. Between
packings only the summation order of the float64 sums differs, which moves a token only when two
scores agree to ~1e-16.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from packloss.core.trust_regions import PolicyTerms, PPOClip, Surrogate, TrustRegion, register_trust_region

if TYPE_CHECKING:
    from packloss.core.plan import Plan

__all__ = [
    "StepSelector",
    "StepSelection",
    "ClipCov",
    "KLCov",
    "M2PO",
    "selector_of",
    "step_selectors",
    "selection_sums",
    "select_over_step",
    "bin_selection",
    "check_max_rank_tokens",
]

_F64 = torch.float64


# ---------------------------------------------------------------------------------------------------
# The hook and the step's result
# ---------------------------------------------------------------------------------------------------


class StepSelector(TrustRegion):
    """A trust region whose surrogate reads a token selection made over the whole step.

    Subclasses set ``num_sums`` and implement :meth:`sums`, :meth:`scores`, :meth:`bound` and
    :meth:`threshold`; the engine selects the members with ``scores ≥ threshold``.
    """

    num_sums: ClassVar[int] = 0

    def sums(self, plan: Plan, name: str) -> Tensor:
        """This bin's additive statistics of component ``name``, float64 ``[num_sums]``."""
        raise NotImplementedError

    def scores(self, plan: Plan, name: str, sums: Tensor) -> Tensor:
        """Per-token scores ``[N]`` float64 from the token's own streams and the step's ``sums``;
        ``−inf`` off the candidates (non-members included)."""
        raise NotImplementedError

    def bound(self, num_tokens: int) -> int:
        """A host upper bound (≥ 1) on how many tokens a step of ``num_tokens`` tokens selects,
        monotone in ``num_tokens``."""
        raise NotImplementedError

    def threshold(self, top: Tensor, sums: Tensor) -> Tensor:
        """The 0-d float64 score threshold from the step's largest scores ``top`` (descending, at
        least ``bound`` long, ``−inf``-padded) and its ``sums``; ``+inf`` selects nothing."""
        raise NotImplementedError


def selector_of(loss: object) -> StepSelector | None:
    """The :class:`StepSelector` of a component loss: the loss itself, or its ``trust_region``."""
    if isinstance(loss, StepSelector):
        return loss
    region = getattr(loss, "trust_region", None)
    return region if isinstance(region, StepSelector) else None


def selection_spec(loss: object) -> str:
    """What a step selection was made for: the selector and the objective fields its scores read."""
    selector = selector_of(loss)
    ratio, adv_coef, advantage = (getattr(loss, k, None) for k in ("ratio", "adv_coef", "advantage"))
    return f"{selector!r};ratio={ratio};adv_coef={adv_coef};advantage={advantage}"


@dataclass(frozen=True, eq=False)
class StepSelection:
    """The selection of one component over a step: ``spec`` (what it was made for), the step's
    ``sums`` (float64 ``[num_sums]``) and the score ``threshold`` (0-d float64)."""

    spec: str
    sums: Tensor
    threshold: Tensor

    def selected(self, selector: StepSelector, plan: Plan, name: str) -> tuple[Tensor, Tensor]:
        """``(selected [N] bool, scores [N] float64)`` of component ``name`` in ``plan``."""
        scores = selector.scores(plan, name, self.sums)  # [N]
        return (scores >= self.threshold) & (scores > float("-inf")), scores


# ---------------------------------------------------------------------------------------------------
# The step machinery (count_denominators calls these)
# ---------------------------------------------------------------------------------------------------


def step_selectors(plans: Sequence[Plan], objectives: Mapping[str, object] | None = None) -> dict[str, object]:
    """``{name: loss}`` of every component with a :class:`StepSelector`, from ``plans`` and, for a
    rank without plans, ``objectives`` (``{name: loss}``); one ``selection_spec`` per name."""
    found: dict[str, object] = {}
    sources = [(f"objectives[{k!r}]", k, v) for k, v in (objectives or {}).items()]
    for i, plan in enumerate(plans):
        sources += [(f"plans[{i}] component {k!r}", k, c.loss) for k, c in plan.components.items()]
    for where, name, loss in sources:
        if selector_of(loss) is None:
            continue
        if name in found and selection_spec(found[name]) != selection_spec(loss):
            raise ValueError(
                f"{where} selects tokens with {selection_spec(loss)} but an earlier plan with "
                f"{selection_spec(found[name])}: every micro-batch of a step must select the same way"
            )
        found[name] = loss
    return {k: found[k] for k in sorted(found)}


def selection_sums(plan: Plan, name: str, loss: object, device: torch.device | str) -> Tensor:
    """This bin's additive sums of component ``name`` (zeros when the bin lacks the component)."""
    selector = selector_of(loss)
    if name not in plan.components:
        return torch.zeros(selector.num_sums, dtype=_F64, device=device)
    return selector.sums(plan, name)


def check_max_rank_tokens(plans: Sequence[Plan], max_rank_tokens: object) -> None:
    """Raise a ``ValueError`` unless ``max_rank_tokens`` is a positive int ≥ the tokens of ``plans``."""
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


def _local_top(plans: Sequence[Plan], name: str, selector: StepSelector, sums: Tensor, k: int, device) -> Tensor:
    """The ``k`` largest scores of component ``name`` over this rank's plans.  ``[k]``."""
    scores = [selector.scores(p, name, sums) for p in plans if name in p.components]
    flat = torch.cat(scores) if scores else torch.zeros(0, dtype=_F64, device=device)
    return _top(flat, k)


def select_over_step(
    plans: Sequence[Plan],
    selectors: Mapping[str, object],
    sums: Mapping[str, Tensor],
    *,
    gather: bool = False,
    group: dist.ProcessGroup | None = None,
    max_rank_tokens: int | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, StepSelection]:
    """Every selecting component's :class:`StepSelection` from the step's ``sums`` (already summed
    over the ranks). With ``gather``, ONE ``all_gather`` of each rank's ``K`` largest scores per
    component, ``K = min(bound(W · max_rank_tokens), max_rank_tokens)`` (``W`` ranks): a rank holds
    at most ``min(k, n_r)`` of the step's ``k`` selected tokens, and its ``K`` largest scores hold
    them, so the gathered values hold the step's ``k`` largest and the threshold is exact. Without
    ``gather``, ``K = bound(Σ tokens of plans)``. No host read."""
    if not selectors:
        return {}
    n_local = sum(p.num_tokens for p in plans)
    if gather:
        check_max_rank_tokens(plans, max_rank_tokens)
        world = dist.get_world_size(group)
    names = list(selectors)
    regions = {k: selector_of(selectors[k]) for k in names}
    if gather:
        sizes = [min(regions[k].bound(world * max_rank_tokens), max_rank_tokens) for k in names]
    else:
        sizes = [regions[k].bound(n_local) for k in names]
    tops = [_local_top(plans, k, regions[k], sums[k], size, device) for k, size in zip(names, sizes, strict=True)]
    if gather:
        local = torch.cat(tops)  # [Σ K]
        every = torch.empty(world * local.numel(), dtype=_F64, device=local.device)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        all_gather(every, local, group=group)
        rows = every.reshape(world, -1)  # [W, Σ K]
        tops = [part.reshape(-1).sort(descending=True).values for part in torch.split(rows, sizes, dim=1)]
    out = {}
    for k, top in zip(names, tops, strict=True):
        out[k] = StepSelection(selection_spec(selectors[k]), sums[k], regions[k].threshold(top, sums[k]))
    return out


def bin_selection(plan: Plan, name: str) -> StepSelection:
    """The selection of component ``name`` over ``plan`` alone (no step denominators)."""
    loss = plan.components[name].loss
    sums = {name: selection_sums(plan, name, loss, plan.device)}
    return select_over_step([plan], {name: loss}, sums, device=plan.device)[name]


# ---------------------------------------------------------------------------------------------------
# Shared pieces of the regions
# ---------------------------------------------------------------------------------------------------


def _objective(plan: Plan, name: str) -> object:
    return plan.components[name].loss


def _stream(plan: Plan, stream: str, m: Tensor) -> Tensor | None:
    """A pre-forward stream in float64, zero off the members (which may hold inf or NaN)."""
    value = getattr(plan, stream)
    return None if value is None else torch.where(m, value.detach().to(_F64), 0.0)


def _advantages(region: TrustRegion, plan: Plan, name: str, m: Tensor) -> Tensor:
    if getattr(_objective(plan, name), "advantage", "shipped") != "shipped":
        raise ValueError(
            f"{type(region).__name__} reads the advantages before the forward: component {name!r} needs "
            "advantage='shipped'"
        )
    return _stream(plan, "advantages", m)


def _logprobs(region: TrustRegion, plan: Plan, m: Tensor) -> Tensor:
    """``p``: old_logprobs, else inference_logprobs (π_θ before the forward).  ``[N]``."""
    for stream in ("old_logprobs", "inference_logprobs"):
        value = _stream(plan, stream, m)
        if value is not None:
            return value
    raise ValueError(f"{type(region).__name__} reads old_logprobs (else inference_logprobs); the plan has neither")


def _selection(region: StepSelector, t: PolicyTerms) -> tuple[Tensor, Tensor]:
    """``(selected [N], scores [N])`` of the bin: from the step's selection when the engine passes
    one (``inputs.selection``), else over the bin alone."""
    plan, name = getattr(t.inputs, "plan", None), getattr(t.inputs, "name", None)
    if plan is None or name is None:
        raise ValueError(
            f"{type(region).__name__} selects tokens over the step: it needs the engine's ComponentInputs "
            f"(plan and name), got {type(t.inputs).__name__}"
        )
    selection = getattr(t.inputs, "selection", None)
    if selection is None:
        selection = bin_selection(plan, name)
    selected, scores = selection.selected(region, plan, name)
    return selected & t.m, scores


def _check_ratio(region: TrustRegion, name: str) -> None:
    value = getattr(region, name)
    if not 0 < value <= 1:
        raise ValueError(f"{type(region).__name__}.{name} must be in (0, 1], got {value}")


class _Covariance(StepSelector):
    """Clip-Cov and KL-Cov: sums ``[Σ_m A, Σ_m p, M]``, top-``k`` covariance with ``k = max(1, ⌊ρ M⌋)``."""

    num_sums: ClassVar[int] = 3

    @property
    def ratio(self) -> float:
        raise NotImplementedError

    def sums(self, plan: Plan, name: str) -> Tensor:
        m = plan.members[name]
        adv, p = _advantages(self, plan, name, m), _logprobs(self, plan, m)  # [N], [N]
        return torch.stack([adv.sum(), p.sum(), m.sum(dtype=_F64)])

    def covariance(self, plan: Plan, name: str, sums: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(cov [N], A [N], p [N])`` float64, zero off the members."""
        m = plan.members[name]
        adv, p = _advantages(self, plan, name, m), _logprobs(self, plan, m)
        count = sums[2].clamp_min(1)
        cov = (adv - sums[0] / count) * (p - sums[1] / count)  # [N]
        return torch.where(m, cov, 0.0), adv, p

    def bound(self, num_tokens: int) -> int:
        return max(1, math.floor(self.ratio * num_tokens))

    def threshold(self, top: Tensor, sums: Tensor) -> Tensor:
        count = sums[2]
        k = torch.where(count > 0, torch.floor(self.ratio * count).clamp_min(1), 0.0).clamp_max(top.numel())
        kth = top.gather(0, (k - 1).clamp_min(0).long().reshape(1)).squeeze(0)  # the k-th largest score
        return torch.where(k > 0, kth, float("inf"))


# ---------------------------------------------------------------------------------------------------
# The regions
# ---------------------------------------------------------------------------------------------------


@register_trust_region("clip_cov")
@dataclass(frozen=True)
class ClipCov(_Covariance):
    """Clip-Cov (Cui et al. 2025; verl ``clip_cov``) over the step, deterministic (module doc).

    PPO clip on the live ratio, and the policy gradient of the ``k = max(1, ⌊clip_cov_ratio · M⌋)``
    band tokens (``clip_cov_lb < cov < clip_cov_ub``, not already clipped) of **largest** covariance
    is zeroed (verl zeroes ``k`` band tokens drawn at random). Defaults are verl's
    (``clip_ratio_low``/``_high`` = ``clip_low``/``clip_high``). Metrics ``cov_selected`` (the
    zeroed tokens), ``clip_frac_low``/``_high`` and ``is_masked`` (either).
    """

    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    clip_low: float = 0.2
    clip_high: float = 0.2

    @property
    def ratio(self) -> float:
        return self.clip_cov_ratio

    def check(self) -> None:
        super().check()
        _check_ratio(self, "clip_cov_ratio")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"ClipCov needs clip_cov_lb < clip_cov_ub, got {self.clip_cov_lb}, {self.clip_cov_ub}")
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"ClipCov.clip_low must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0:
            raise ValueError(f"ClipCov.clip_high must be >= 0, got {self.clip_high}")

    def scores(self, plan: Plan, name: str, sums: Tensor) -> Tensor:
        m = plan.members[name]
        cov, adv, p = self.covariance(plan, name, sums)
        objective = _objective(plan, name)
        # r̂: the ratio before the forward; ≠ 1 only for ratio="rollout" with an old stream.
        base = _stream(plan, "inference_logprobs", m) if getattr(objective, "ratio", "old") == "rollout" else p
        r_hat = torch.exp(p - base)  # [N]; both zero off the members
        a = getattr(objective, "adv_coef", 1.0) * adv
        clipped = -a * r_hat.clamp(1 - self.clip_low, 1 + self.clip_high) > -a * r_hat  # verl's clip_by_origin
        band = m & (cov > self.clip_cov_lb) & (cov < self.clip_cov_ub) & ~clipped
        return torch.where(band, cov, float("-inf"))

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        selected, _ = _selection(self, t)
        surrogate, metrics = PPOClip(self.clip_low, self.clip_high).clipped(t.r, t.a)
        metrics["is_masked"] = metrics["is_masked"] | selected
        metrics["cov_selected"] = selected
        return Surrogate(torch.where(t.m & ~selected, surrogate, 0.0), metrics)


@register_trust_region("kl_cov")
@dataclass(frozen=True)
class KLCov(_Covariance):
    """KL-Cov (Cui et al. 2025; verl ``kl_cov``) over the step (module doc).

    ``J_t = r A' − ppo_kl_coef · |log r| · [t among the k = max(1, ⌊kl_cov_ratio · M⌋) members of
    largest covariance]``, no clip. Defaults are verl's config (``ppo_kl_coef = 0.1``; verl's function
    falls back to 1.0 only when the field is None). Metrics ``cov_selected`` and ``abs_log_ratio``
    (mean ``|log r|``, verl's ``ppo_kl``).
    """

    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1

    @property
    def ratio(self) -> float:
        return self.kl_cov_ratio

    def check(self) -> None:
        super().check()
        _check_ratio(self, "kl_cov_ratio")
        if not self.ppo_kl_coef >= 0:
            raise ValueError(f"KLCov.ppo_kl_coef must be >= 0, got {self.ppo_kl_coef}")

    def scores(self, plan: Plan, name: str, sums: Tensor) -> Tensor:
        cov, _, _ = self.covariance(plan, name, sums)
        return torch.where(plan.members[name], cov, float("-inf"))

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        selected, _ = _selection(self, t)
        abs_log_r = t.log_r.abs()  # [N]; log_r is zero off the members
        objective = t.a * t.r - self.ppo_kl_coef * torch.where(selected, abs_log_r, 0.0)
        metrics = {"cov_selected": selected, "abs_log_ratio": abs_log_r.detach()}
        return Surrogate(torch.where(t.m, objective, 0.0), metrics)


@register_trust_region("m2po")
@dataclass(frozen=True)
class M2PO(StepSelector):
    """M2PO (Zheng et al. 2025), the second-moment trust region, over the step (module doc).

    Drops the members of largest ``x = (old − inf)²``, the fewest such that the mean ``x`` of the kept
    members is ``≤ m2_threshold`` (AReaL's ``m2_threshold``, default 0.04), and keeps ``J = r A'`` on
    the rest (no clip). Needs ``old_logprobs`` and ``inference_logprobs``. The number of dropped
    tokens has no bound below the step's token count, so the selection gathers every member's ``x``
    (exact; ``W · max_rank_tokens`` numbers across ranks). Metrics ``is_masked`` (dropped), ``m2``
    (mean ``x`` over the members) and ``m2_kept`` (over the kept members; ``≤ m2_threshold`` over the
    step once merged).
    """

    m2_threshold: float = 0.04
    num_sums: ClassVar[int] = 2

    def check(self) -> None:
        super().check()
        if not self.m2_threshold >= 0:
            raise ValueError(f"M2PO.m2_threshold must be >= 0, got {self.m2_threshold}")

    def _x(self, plan: Plan, name: str) -> Tensor:
        """``x = (old − inf)²`` float64, zero off the members.  ``[N]``."""
        m = plan.members[name]
        old, inf = _stream(plan, "old_logprobs", m), _stream(plan, "inference_logprobs", m)
        if old is None or inf is None:
            raise ValueError(
                f"M2PO measures log(π_old / π_rollout) before the forward: component {name!r} needs the plan's "
                "old_logprobs and inference_logprobs"
            )
        return (old - inf) ** 2

    def sums(self, plan: Plan, name: str) -> Tensor:
        m = plan.members[name]
        return torch.stack([self._x(plan, name).sum(), m.sum(dtype=_F64)])

    def scores(self, plan: Plan, name: str, sums: Tensor) -> Tensor:
        return torch.where(plan.members[name], self._x(plan, name), float("-inf"))

    def bound(self, num_tokens: int) -> int:
        return max(1, num_tokens)

    def threshold(self, top: Tensor, sums: Tensor) -> Tensor:
        total, count = sums[0], sums[1]
        kept_sum = total - torch.cat([top.new_zeros(1), torch.where(top > float("-inf"), top, 0.0).cumsum(0)])
        j = torch.arange(top.numel() + 1, dtype=_F64, device=top.device)  # tokens dropped  [K+1]
        # mean of the kept ≤ τ, without dividing; dropping every member always satisfies it
        ok = (kept_sum <= self.m2_threshold * (count - j)) | (j >= count)
        first = ok.to(torch.int8).argmax()  # the fewest dropped (argmax returns the first maximum)
        kth = top.gather(0, (first - 1).clamp_min(0).reshape(1)).squeeze(0)
        return torch.where(first > 0, kth, float("inf"))

    def surrogate(self, t: PolicyTerms) -> Surrogate:
        dropped, scores = _selection(self, t)
        keep = t.m & ~dropped
        x = torch.where(t.m, scores, 0.0).to(t.r.dtype)  # [N]
        return Surrogate(keep * t.a * t.r, {"is_masked": dropped, "m2": (x, t.m), "m2_kept": (x, keep)})
