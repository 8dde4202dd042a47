"""OpenRLHF 0.11.2's ``openrlhf.models.loss.PolicyLoss`` on packloss: its constructor arguments, its
``forward`` signature and return value, the padded batch packed as one bin. The mapping onto packloss
and every difference from OpenRLHF: ``docs/integrations/openrlhf.md``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from packloss.core import checks
from packloss.core.bin import Component, ComponentLoss, Normalize, Plan
from packloss.core.corrections import GatedCorrection, RolloutCorrection
from packloss.core.dtypes import upcast
from packloss.core.engine import compute_loss
from packloss.core.pg import PolicyGradient
from packloss.core.recipe import POLICY
from packloss.core.trust_regions import ClampedPPOClip, SequenceRatioClip
from packloss.integrations.common.padded import PACKINGS, PaddedBatch, check_padded, log_ratio_mean

__all__ = ["OPENRLHF_VERSION", "PolicyLoss", "policy_gradient", "aggregate_component"]

OPENRLHF_VERSION = "0.11.2"
"""The OpenRLHF release whose ``PolicyLoss`` this module reproduces (and its tests run against)."""

POLICY_LOSS_TYPES = ("ppo", "gspo")
IS_LEVELS = ("off", "token", "seq")
IS_MODES = ("mask", "clip")
IS_GATINGS = ("ratio", "binary_kl", "tv")
_OWNER = "PolicyLoss"


def _threshold(threshold: object) -> tuple[float, float]:
    name = f"{_OWNER}.is_correction_threshold"
    if isinstance(threshold, str | bytes) or not isinstance(threshold, Sequence) or len(threshold) != 2:
        raise ValueError(f"{name} must be (low, high), got {threshold!r}")
    low, high = (checks.number(name, v) for v in threshold)
    if not low < high:
        raise ValueError(f"{name} must have low < high, got {tuple(threshold)}")
    if not high > 0:
        raise ValueError(f"{name} high must be > 0, got {high}")
    return low, high


def _correction(level: str, mode: str, gating: str, threshold: tuple[float, float]) -> RolloutCorrection:
    """The correction of OpenRLHF's ``is_correction_*`` (``level != "off"``, ``policy_loss_type="ppo"``)."""
    low, high = threshold
    low_or_none = low if low > 0 else None  # ρ and the divergences are ≥ 0: a lower bound ≤ 0 never binds
    if gating == "ratio" and level == "token":
        return RolloutCorrection("token", "truncate" if mode == "clip" else "mask", high, low_or_none)
    level = "sequence" if level == "seq" else "token"
    return GatedCorrection(level=level, mode="mask", high=high, low=low_or_none, gating=gating)


def policy_gradient(
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip: float | None = None,
    policy_loss_type: str = "ppo",
    is_correction_level: str = "off",
    is_correction_mode: str = "mask",
    is_correction_gating: str = "ratio",
    is_correction_threshold: Sequence[float] = (0.5, 5.0),
) -> PolicyGradient:
    """The :class:`~packloss.PolicyGradient` of OpenRLHF's ``PolicyLoss`` settings, validated in
    OpenRLHF's argument names (``ValueError``; OpenRLHF asserts ``dual_clip > 1``)."""
    checks.choice(f"{_OWNER}.policy_loss_type", policy_loss_type, POLICY_LOSS_TYPES)
    level = checks.choice(f"{_OWNER}.is_correction_level", is_correction_level, IS_LEVELS)
    mode = checks.choice(f"{_OWNER}.is_correction_mode", is_correction_mode, IS_MODES)
    gating = checks.choice(f"{_OWNER}.is_correction_gating", is_correction_gating, IS_GATINGS)
    low = checks.number(f"{_OWNER}.clip_eps_low", clip_eps_low)
    high = checks.number(f"{_OWNER}.clip_eps_high", clip_eps_high)
    if not 0 <= low < 1:
        raise ValueError(f"{_OWNER}.clip_eps_low must be in [0, 1), got {low}")
    if not high >= 0:
        raise ValueError(f"{_OWNER}.clip_eps_high must be >= 0, got {high}")
    if dual_clip is not None and not checks.number(f"{_OWNER}.dual_clip", dual_clip) > 1:
        raise ValueError(f"{_OWNER}.dual_clip must be > 1.0, got {dual_clip}")
    if mode == "clip" and (level == "seq" or gating != "ratio"):
        raise ValueError(f"{_OWNER}: is_correction_mode=clip requires is_correction_level=token and gating=ratio")
    threshold = (0.5, 5.0)
    if level != "off":
        threshold = _threshold(is_correction_threshold)
        if gating != "ratio" and threshold[0] > 0:
            raise ValueError(
                f"{_OWNER}.is_correction_gating={gating!r} takes an upper bound only: is_correction_threshold "
                f"low must be <= 0, got {threshold[0]}"
            )
    dual = None if dual_clip is None else float(dual_clip)
    if policy_loss_type == "gspo":
        # OpenRLHF's gspo measures its ratio against π_rollout when a correction is on, and applies none
        return PolicyGradient(SequenceRatioClip(low, high, dual), ratio="rollout" if level != "off" else "old")
    correction = None if level == "off" else _correction(level, mode, gating, threshold)
    return PolicyGradient(ClampedPPOClip(low, high, dual), ratio="old", correction=correction)


def _per_rank(value: float | Tensor, dp_size: int, name: str, dtype: torch.dtype, device: torch.device):
    """``value / dp_size``: OpenRLHF's ``Σ ℓ / value · dp_size`` as a constant denominator (a number, or
    a 0-d tensor in the compute dtype; a tensor's value is not read)."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"{_OWNER}.forward {name} must be a number or a one-element real tensor")
        return value.detach().reshape(()).to(device=device, dtype=dtype) / dp_size
    return checks.positive(f"{_OWNER}.forward {name}", value) / dp_size


def aggregate_component(
    loss: ComponentLoss,
    members: Tensor,
    batch: PaddedBatch,
    token_level_loss: bool = True,
    dp_size: int = 1,
    batch_num_tokens: float | Tensor | None = None,
    global_batch_size: float | Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Component:
    """OpenRLHF's ``aggregate_loss`` as a :class:`~packloss.Component` of ``batch`` (``members [B, T]``
    bool, the action mask; ``dtype`` the compute dtype)::

        token-level:  Σ ℓ / n_members                     | Σ ℓ / batch_num_tokens · dp_size
        seq-level:    Σ_s (Σ_{t∈s} ℓ_t / n_s) / S_members | Σ_s (Σ_{t∈s} ℓ_t / n_s) / global_batch_size · dp_size

    OpenRLHF's actor reduces its KL and entropy terms with the same function.
    """
    checks.integer(f"{_OWNER}.forward dp_size", dp_size, minimum=1)
    m = batch.members
    if token_level_loss:
        if batch_num_tokens is None:
            return Component(loss, mask=m, normalize=Normalize.TOKEN)
        constant = _per_rank(batch_num_tokens, dp_size, "batch_num_tokens", dtype, m.device)
        return Component(loss, mask=m, normalize=Normalize.CONSTANT, constant=constant)
    if global_batch_size is None:
        return Component(loss, mask=m, normalize=Normalize.SEQUENCE_MEAN)
    # Σ_s (Σ_{t∈s} ℓ_t / n_s) / G · dp_size: each row's token mean through weights 1/n_s
    row_count = members.sum(dim=1, keepdim=True, dtype=dtype).clamp_min(1)  # [B, 1]
    weights = batch.pack(torch.where(members, 1 / row_count, 0.0), "weights")  # [N]
    constant = _per_rank(global_batch_size, dp_size, "global_batch_size", dtype, m.device)
    return Component(loss, mask=m, weights=weights, normalize=Normalize.CONSTANT, constant=constant)


def _members(action_mask: Tensor | None, like: Tensor) -> Tensor:
    """The ``[B, T]`` bool members (every position when ``action_mask`` is None, as OpenRLHF's means)."""
    if action_mask is None:
        return torch.ones(like.shape, dtype=torch.bool, device=like.device)
    checks.tensor(f"{_OWNER}.forward action_mask", action_mask, shape=tuple(like.shape))
    if action_mask.is_floating_point() or action_mask.is_complex():
        raise NotImplementedError(
            f"{_OWNER}.forward action_mask of dtype {action_mask.dtype}: OpenRLHF would weight tokens by a "
            "floating-point mask (and add 1e-8 to its row counts), which is not mapped; pass action_mask.bool()"
        )
    return action_mask.bool()  # != 0, as one conversion (no copy of a bool mask)


class PolicyLoss(nn.Module):
    """OpenRLHF 0.11.2's ``PolicyLoss`` computed by packloss.

    Args (OpenRLHF's): ``clip_eps_low``, ``clip_eps_high``, ``dual_clip``, ``token_level_loss``,
    ``policy_loss_type`` (``"ppo"``, ``"gspo"``; ``"gspo"`` forces ``token_level_loss=False``),
    ``is_correction_level`` (``"off"``, ``"token"``, ``"seq"``), ``is_correction_mode`` (``"mask"``,
    ``"clip"``), ``is_correction_gating`` (``"ratio"``, ``"binary_kl"``, ``"tv"``),
    ``is_correction_threshold`` (``(low, high)``). ``packing``: ``"members"`` (default; one
    device→host read per call) or ``"rows"`` (none). ``objective`` is the mapped :class:`~packloss.PolicyGradient`.
    """

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float | None = None,
        token_level_loss: bool = True,
        policy_loss_type: str = "ppo",
        is_correction_level: str = "off",
        is_correction_mode: str = "mask",
        is_correction_gating: str = "ratio",
        is_correction_threshold: Sequence[float] = (0.5, 5.0),
        *,
        packing: Literal["members", "rows"] = "members",
    ) -> None:
        super().__init__()
        checks.flag(f"{_OWNER}.token_level_loss", token_level_loss)
        self.objective = policy_gradient(
            clip_eps_low,
            clip_eps_high,
            dual_clip,
            policy_loss_type,
            is_correction_level,
            is_correction_mode,
            is_correction_gating,
            is_correction_threshold,
        )
        self.packing = checks.choice(f"{_OWNER}.packing", packing, PACKINGS)
        self.clip_eps_low = clip_eps_low
        self.clip_eps_high = clip_eps_high
        self.dual_clip = dual_clip
        self.token_level_loss = token_level_loss and policy_loss_type != "gspo"  # as OpenRLHF overrides it
        self.policy_loss_type = policy_loss_type
        self.is_correction_level = is_correction_level
        self.is_correction_mode = is_correction_mode
        self.is_correction_gating = is_correction_gating
        self.is_correction_threshold = is_correction_threshold

    def forward(
        self,
        log_probs: Tensor,
        old_log_probs: Tensor,
        advantages: Tensor,
        action_mask: Tensor | None = None,
        rollout_log_probs: Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens: float | Tensor | None = None,
        global_batch_size: float | Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
        """``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)`` as OpenRLHF's ``forward``: shapes
        ``[B, T]``, the loss ``Σ ℓ / count · dp_size``; ``vllm_kl`` (mean ``log π_rollout − log π_old``)
        and ``is_filter_ratio`` are None unless a ``ppo`` correction is on."""
        if not isinstance(log_probs, Tensor) or log_probs.dim() != 2:
            shape = list(log_probs.shape) if isinstance(log_probs, Tensor) else type(log_probs).__name__
            raise ValueError(f"{_OWNER}.forward log_probs must be a [B, T] tensor, got {shape}")
        if 0 in log_probs.shape:
            raise ValueError(f"{_OWNER}.forward log_probs must have B >= 1 and T >= 1, got {list(log_probs.shape)}")
        streams = dict(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages)
        check_padded({**streams, "rollout_log_probs": rollout_log_probs}, tuple(log_probs.shape), f"{_OWNER}.forward ")
        needs_rollout = self.is_correction_level != "off"
        if rollout_log_probs is None and needs_rollout:
            raise ValueError(f"{_OWNER}.forward rollout_log_probs is required with "
                             f"is_correction_level={self.is_correction_level!r}")  # fmt: skip
        members = _members(action_mask, log_probs)  # [B, T]
        batch = PaddedBatch.of(members, self.packing)
        dtype = torch.promote_types(log_probs.dtype, torch.float32)  # the engine's compute dtype
        component = aggregate_component(
            self.objective, members, batch, self.token_level_loss, dp_size, batch_num_tokens, global_batch_size, dtype
        )
        plan = batch.plan(
            {POLICY: component},
            rollout_logprobs=rollout_log_probs if needs_rollout else None,
            old_logprobs=old_log_probs,
            advantages=advantages,
        )
        outputs = batch.outputs(logprobs=log_probs)
        result = compute_loss(plan, outputs)
        m, trn, old = batch.members, outputs.logprobs, plan.old_logprobs
        count = result.counts[f"{POLICY}/loss"]  # the members' count, which the means below share
        ppo_kl = log_ratio_mean(m, old, trn, count)
        clip_ratio = result.metrics[f"{POLICY}/clip_ratio"]
        vllm_kl = is_filter_ratio = None
        correction = self.objective.correction
        if correction is not None:
            vllm_kl = log_ratio_mean(m, plan.rollout_logprobs, old, count)
            is_filter_ratio = _filter_ratio(
                correction, result.metrics, upcast(old), upcast(plan.rollout_logprobs), plan
            )
        return result.loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio


def _filter_ratio(
    correction: RolloutCorrection, metrics: dict[str, Tensor], old: Tensor, rollout: Tensor, plan: Plan
) -> Tensor:
    """OpenRLHF's ``is_filter_ratio``: dropped (or clamped) members over the members per token; per
    sequence, dropped rows over all ``B`` rows, a row without members counting as dropped."""
    if isinstance(correction, GatedCorrection) and correction.level == "sequence":
        m, segments = plan.members[POLICY], plan.layout.segments
        kept = correction.keep(correction.statistic(old, rollout, m, segments))  # [S]
        has_members = segments.count(m) > 0  # [S]
        return (~(kept & has_members)).sum(dtype=torch.float32) / plan.num_seqs
    key = "rollout_is_truncated" if correction.mode == "truncate" else "rollout_is_masked"
    return metrics[f"{POLICY}/{key}"]
