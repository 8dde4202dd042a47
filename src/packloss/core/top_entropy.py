"""The high-entropy minority (Wang et al. 2025, "Beyond the 80/20 rule"; TRL's ``top_entropy_quantile``):
:class:`TopEntropy`, a :class:`~packloss.PolicyGradient` option that keeps the policy gradient of the member
tokens whose entropy is at or above the ``(1 − q)`` quantile of the entropies of every member token of the
step, and :func:`entropy_threshold`, that quantile over a step's bins and ranks. The entropy is a forward
output, so the threshold is computed after the forward (unlike the trust regions' step-wide selection,
which ``count_denominators`` makes before it). The math and the collectives: ``docs/integrations/trl.md``,
"The high-entropy minority"."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor

from packloss.core import checks

__all__ = ["TopEntropy", "entropy_threshold"]

_F64 = torch.float64
# positions kept beyond q·N: the float32 rank q·(n − 1) of torch.quantile is off by at most ~n·2⁻²⁴
_SLACK, _SLACK_SHIFT = 8, 20


def _check_quantile(quantile: object) -> float:
    q = checks.number("TopEntropy.quantile", quantile)
    if not 0 <= q <= 1:
        raise ValueError(f"TopEntropy.quantile must be in [0, 1], got {q}")
    return q


def _candidates(quantile: float, num_tokens: int) -> int:
    """A host bound (≥ 1) on how many of the largest entropies of ``num_tokens`` tokens the quantile
    reads: the ``(1 − q)`` quantile of ``n ≤ num_tokens`` sorted values interpolates the values at
    ranks ``⌊r⌋`` and ``⌈r⌉``, ``r = (1 − q)(n − 1)``, which are among the ``n − ⌊r⌋ < q·n + 3``
    largest (a margin covers ``r``'s float32 rounding)."""
    bound = math.ceil(quantile * num_tokens) + _SLACK + (num_tokens >> _SLACK_SHIFT)
    return max(1, min(num_tokens, bound))


def _top(values: Tensor, k: int) -> Tensor:
    """The ``k`` largest of ``values`` (descending), ``−inf``-padded when there are fewer.  ``[k]``."""
    if values.numel() < k:
        values = torch.cat([values, values.new_full((k - values.numel(),), float("-inf"))])
    return values.topk(k).values


def _quantile(top: Tensor, count: Tensor, nans: Tensor, quantile: float) -> Tensor:
    """The ``(1 − q)`` quantile, by ``torch.quantile``'s linear rule in ``top``'s dtype, of ``count`` values
    whose largest are ``top`` (descending, at least :func:`_candidates` long): rank ``r = (1 − q)(n − 1)``,
    ``lerp(v_⌊r⌋, v_⌈r⌉, r − ⌊r⌋)``; ``+inf`` (nothing kept) without values, NaN with a NaN among them
    (``torch.quantile``'s). 0-d, no host read."""
    dtype = top.dtype
    last = (count - 1).clamp_min(0)  # float64, exact
    rank = torch.full((), 1.0 - quantile, dtype=dtype, device=top.device) * last.to(dtype)
    below, above = rank.floor(), rank.ceil()
    # ascending rank i is descending position n − 1 − i
    at = torch.stack([last - below.to(_F64), last - above.to(_F64)]).clamp(0, top.numel() - 1).long()  # [2]
    low, high = top.gather(0, at)
    theta = torch.lerp(low, high, rank - below)
    theta = torch.where(count > 0, theta, float("inf"))
    return torch.where(nans > 0, float("nan"), theta)


def _rank_bound(n_local: int, device: torch.device, group: dist.ProcessGroup | None) -> int:
    """The largest token count of the ranks of ``group``: one ``all_reduce`` (MAX) and one host read."""
    size = torch.tensor([n_local], dtype=torch.int64, device=device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group)
    return int(size.item())  # sync-ok: the ranks' token counts size the all_gather (max_rank_tokens=None)


def entropy_threshold(
    quantile: float,
    entropies: Sequence[Tensor],
    members: Sequence[Tensor],
    *,
    all_gather: bool = False,
    group: dist.ProcessGroup | None = None,
    max_rank_tokens: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """``θ = Q_{1−q}({H_t : t a member of any bin of the step})``, ``torch.quantile``'s linear
    interpolation in the entropies' compute dtype (at least float32), 0-d; ``+inf`` without members.

    Args:
        quantile: ``q`` in ``[0, 1]``, the fraction kept (1 keeps every member, 0 those at the largest).
        entropies, members: this rank's bins, ``[N_i]`` floating and ``[N_i]`` bool each (non-members'
            entropies may hold anything); a rank without bins passes ``[]`` and ``device``.
        all_gather: the step spans the ranks of ``group``: each rank's largest member entropies cross
            in ONE ``all_gather`` (with their member and NaN counts) and every rank gets the same ``θ``.
        max_rank_tokens: a host bound on any rank's tokens (``Σ N_i``), the same on every rank; None
            measures it with one ``all_reduce`` and one host read (the only one).
        device: where a rank without bins computes.

    No host read for one process (or with ``max_rank_tokens``): the quantile's ranks are computed on
    the device from the member count.
    """
    q = _check_quantile(quantile)
    checks.flag("all_gather", all_gather)
    entropies, members = list(entropies), list(members)
    if len(entropies) != len(members):
        raise ValueError(f"entropies and members must have one tensor per bin, got {len(entropies)} and {len(members)}")
    dtype = torch.float32
    for i, (h, m) in enumerate(zip(entropies, members, strict=True)):
        checks.tensor(f"entropies[{i}]", h, floating=True)
        checks.tensor(f"members[{i}]", m, shape=tuple(h.shape), boolean=True, device=h.device)
        if h.dim() != 1:
            raise ValueError(f"entropies[{i}] must have shape [N], got {list(h.shape)}")
        dtype = torch.promote_types(dtype, h.dtype)
    if entropies:
        device = entropies[0].device
    elif device is None:
        raise ValueError("a rank without bins passes device= (where its share of the collectives runs)")
    # non-members to −inf before anything reads them (they may hold NaN or ±inf)
    values = [torch.where(m, h.detach().to(dtype), float("-inf")) for h, m in zip(entropies, members, strict=True)]
    flat = torch.cat(values) if values else torch.zeros(0, dtype=dtype, device=device)  # [Σ N_i]
    mask = torch.cat(members) if members else torch.zeros(0, dtype=torch.bool, device=device)
    count, nans = mask.sum(dtype=_F64), torch.isnan(flat).sum(dtype=_F64)
    if not all_gather:
        return _quantile(_top(flat, _candidates(q, flat.numel())), count, nans, q)
    if max_rank_tokens is None:
        max_rank_tokens = _rank_bound(flat.numel(), flat.device, group)
    elif isinstance(max_rank_tokens, bool) or not isinstance(max_rank_tokens, int) or max_rank_tokens < flat.numel():
        raise ValueError(
            f"max_rank_tokens must be an int >= this rank's {flat.numel()} tokens (the same on every rank), "
            f"got {max_rank_tokens!r}"
        )
    world = dist.get_world_size(group)
    k = min(_candidates(q, world * max_rank_tokens), max(max_rank_tokens, 1))
    # a rank holds at most min(k, its tokens) of the step's k largest: its own k largest contain them
    local = torch.cat([_top(flat, k).to(_F64), torch.stack([count, nans])])  # [k + 2], float64 holds both exactly
    every = torch.empty(world * (k + 2), dtype=_F64, device=local.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(every, local, group=group)
    rows = every.reshape(world, k + 2)  # [W, k + 2]
    top = rows[:, :k].reshape(-1).sort(descending=True).values.to(dtype)  # [W·k]
    return _quantile(top, rows[:, k].sum(), rows[:, k + 1].sum(), q)


@dataclass(frozen=True)
class TopEntropy:
    """``PolicyGradient(top_entropy=TopEntropy(q))``: the policy-gradient term (not the KL penalties) of
    the members with ``H_t < θ`` is zeroed, ``θ = Q_{1−q}(H over the step's members)``
    (:func:`entropy_threshold`); the normalisation still counts every member (TRL's ``per_token_loss *
    entropy_mask``). Reads ``Outputs.entropy``, detached. Metric ``high_entropy``: the fraction kept.

    Args:
        quantile: ``q`` in ``[0, 1]``.
        threshold: the step's ``θ`` (0-d), from :meth:`over`; None selects over the bin alone.
    """

    quantile: float
    threshold: Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "quantile", _check_quantile(self.quantile))
        if self.threshold is not None:
            checks.tensor("TopEntropy.threshold", self.threshold, shape=(), floating=True)

    def over(
        self,
        entropies: Sequence[Tensor],
        members: Sequence[Tensor],
        *,
        all_gather: bool = False,
        group: dist.ProcessGroup | None = None,
        max_rank_tokens: int | None = None,
        device: torch.device | str | None = None,
    ) -> TopEntropy:
        """This filter with the threshold of a step (:func:`entropy_threshold`'s arguments)."""
        theta = entropy_threshold(
            self.quantile, entropies, members, all_gather=all_gather, group=group,
            max_rank_tokens=max_rank_tokens, device=device,
        )  # fmt: skip
        return replace(self, threshold=theta)

    def keep(self, entropy: Tensor, members: Tensor) -> Tensor:
        """The kept members ``m_t ∧ H_t ≥ θ`` of a bin (``[N]`` each; the bin's own ``θ`` without a
        threshold).  ``[N]`` bool."""
        theta = self.threshold
        if theta is None:
            theta = entropy_threshold(self.quantile, [entropy], [members])
        h = entropy.detach()
        h = h.to(torch.promote_types(torch.promote_types(h.dtype, torch.float32), theta.dtype))
        return members & (h >= theta)
