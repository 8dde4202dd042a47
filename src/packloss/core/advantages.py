"""Group-normalised advantages (GRPO and Dr. GRPO), sync-free with segment reductions over group ids.

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

import torch
from torch import Tensor

from packloss.core.segments import broadcast, segment_sum

__all__ = ["group_advantages"]


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
