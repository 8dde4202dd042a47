"""Advantages, sync-free: group-normalised (GRPO and Dr. GRPO) by segment reductions over group ids,
and GAE over a packed bin (:func:`gae_advantages`) by a segmented reverse scan.

For ``M`` samples with rewards ``r`` and group ids ``g`` (the samples of one prompt share a group),
with ``n_g`` samples, mean ``μ_g`` and standard deviation ``σ_g`` per group::

    A_i = (r_i − μ_{g_i}) / (σ_{g_i} + eps)     # GRPO (scale_by_std=True)
    A_i =  r_i − μ_{g_i}                         # Dr. GRPO (scale_by_std=False)

``σ_g`` is the unbiased (``n_g − 1``) standard deviation by default, as ``torch.std`` and TRL's GRPO;
``unbiased=False`` divides by ``n_g``. A group of one sample has advantage 0 (and ``σ = 0``). The
number of groups is a host int, so every shape is known without reading the device: no sync, and the
number of tensor operations does not depend on ``M`` or the number of groups.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from packloss.core import checks
from packloss.core.layout import check_seq_lens
from packloss.core.segments import broadcast, segment_sum

__all__ = ["group_advantages", "gae_advantages"]


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    num_groups: int,
    *,
    scale_by_std: bool = True,
    unbiased: bool = True,
    eps: float = 1e-6,
    check_ids: bool = False,
) -> Tensor:
    """Advantages ``[M]`` of rewards ``[M]`` normalised within their groups.

    Args:
        rewards: ``[M]`` float rewards.
        group_ids: ``[M]`` long, in ``[0, num_groups)``; groups may be of any size, in any order.
        num_groups: host int ``G``, the number of groups.
        scale_by_std: divide by ``σ_g + eps`` (GRPO); ``False`` only centres (Dr. GRPO).
        unbiased: ``σ_g`` with the ``n_g − 1`` (True) or ``n_g`` (False) denominator.
        eps: added to ``σ_g``, so a group whose rewards are all equal gets advantage 0.
        check_ids: raise ``ValueError`` for an id outside ``[0, num_groups)`` (one host read; off by
            default: unchecked, such an id is torch's ``IndexError``, on CUDA a device-side assert).

    Returns:
        ``[M]`` advantages in the rewards' floating dtype (float32 for integer rewards).
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [M], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if group_ids.dtype != torch.long:
        raise TypeError(f"group_ids must be a long tensor, got {group_ids.dtype}")
    if num_groups <= 0:
        raise ValueError(f"num_groups must be positive, got {num_groups}")
    if check_ids and group_ids.numel() > 0:
        low, high = (int(v) for v in torch.stack(group_ids.aminmax()).tolist())  # sync-ok: opt-in check
        if low < 0 or high >= num_groups:
            raise ValueError(f"group_ids must lie in [0, num_groups={num_groups}), got ids from {low} to {high}")
    r = rewards if rewards.is_floating_point() else rewards.to(torch.float32)
    count = segment_sum(torch.ones_like(r), group_ids, num_groups)  # [G]
    mean = segment_sum(r, group_ids, num_groups) / count.clamp_min(1)  # [G]
    centred = r - broadcast(mean, group_ids)  # [M]
    if not scale_by_std:
        return centred
    dof = (count - 1) if unbiased else count
    var = segment_sum(centred * centred, group_ids, num_groups) / dof.clamp_min(1)  # [G]
    return centred / (broadcast(var.sqrt(), group_ids) + eps)


def _reverse_scan(a: Tensor, b: Tensor) -> Tensor:
    """``x [N]`` with ``x_t = a_t + b_t · x_{t+1}`` and ``x_N = 0``, by recursive doubling: after the
    step of offset ``d``, ``(a_t, b_t)`` compose positions ``[t, t + 2d)``. ``⌈log₂ N⌉`` steps whatever
    the values; the products of ``b`` only shrink when ``|b| ≤ 1``, so the scan is stable where a
    closed form ``(γλ)^{−t} Σ (γλ)^k δ_k`` overflows. A zero ``b_t`` cuts the recurrence after ``t``."""
    d = 1
    while d < a.numel():
        a = a + b * F.pad(a[d:], (0, d))  # [N]
        b = b * F.pad(b[d:], (0, d))  # [N]
        d *= 2
    return a


def gae_advantages(
    rewards: Tensor,
    values: Tensor,
    seq_lens: Sequence[int],
    mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = False,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimates and returns ``([N], [N])`` over a packed bin, without gradient.

    Within each sequence, over its members only (a non-member, such as a tool's observation token, is
    skipped: its reward and value are never read)::

        δ_t = r_t + γ · V_{n(t)} − V_t,    A_t = δ_t + γ λ · A_{n(t)},    R_t = A_t + V_t

    where ``n(t)`` is the sequence's next member after ``t`` (``V`` and ``A`` are 0 past its last). A
    non-member holds the advantage of the sequence's next member (0 after its last), as verl's
    ``compute_gae_advantage_return``. ``whiten``: ``(A − mean) / sqrt(var + 1e-8)`` with the members'
    mean and unbiased variance (verl's ``masked_whiten``); returns keep the raw ``A``. Sync-free; the op
    count depends on ``N`` only (``⌈log₂ N⌉`` doubling steps), not on the number of sequences.

    Args:
        rewards: ``[N]`` per-token rewards (an outcome reward sits on a sequence's last member).
        values: ``[N]`` the critic's values (detached here).
        seq_lens: host ints, the bin's sequence lengths (sum ``N``).
        mask: ``[N]`` bool, the members (response tokens that are actions).
        gamma: discount ``γ`` in ``[0, 1]``.
        lam: GAE ``λ`` in ``[0, 1]``.
        whiten: normalise the advantages over the members (needs at least two).

    Returns:
        ``(advantages, returns)``, ``[N]`` each, in the promoted floating dtype of rewards and values
        (at least float32).
    """
    for name, x in (("rewards", rewards), ("values", values), ("mask", mask)):
        if not isinstance(x, Tensor) or x.dim() != 1:
            raise ValueError(f"{name} must be a [N] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    lens = check_seq_lens(seq_lens, rewards.numel())
    if values.shape != rewards.shape or mask.shape != rewards.shape:
        raise ValueError(f"rewards, values and mask must share one [N] shape, got {tuple(rewards.shape)}, "
                         f"{tuple(values.shape)} and {tuple(mask.shape)}")  # fmt: skip
    checks.mask_dtype("mask", mask)
    checks.same_device("rewards", rewards.device, values=values, mask=mask)
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= x <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {x}")
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    r, v, m = rewards.detach().to(dtype), values.detach().to(dtype), mask != 0
    ends = torch.tensor(list(itertools.accumulate(lens)), device=r.device) - 1  # [S] each sequence's last position
    open_ = torch.ones_like(r).index_fill_(0, ends, 0.0)  # [N] 0 where the recurrence stops
    zero = torch.zeros((), dtype=dtype, device=r.device)
    carried = _reverse_scan(torch.where(m, v, zero), torch.where(m, zero, open_))  # [N] V of the first member ≥ t
    next_value = F.pad(carried[1:], (0, 1)) * open_  # [N] V_{n(t)}
    delta = torch.where(m, r + gamma * next_value - v, zero)  # [N]
    advantages = _reverse_scan(delta, torch.where(m, gamma * lam * open_, open_))  # [N]
    returns = advantages + v
    if whiten:
        count = m.sum()
        mean = torch.where(m, advantages, zero).sum() / count
        var = torch.where(m, (advantages - mean) ** 2, zero).sum() / (count - 1)
        advantages = (advantages - mean) * torch.rsqrt(var + 1e-8)
    return advantages, returns
