"""The strongest simple baseline of the RL rows of ``packloss bench peers``: each peer's policy loss
written plainly on the padded ``[B, T]`` batch, from its formula, returning the metrics the peer logs.
Timed eager and ``torch.compile``'d, after a check against the peer's own value, gradient and metrics.

Each function takes ``(logp, old, adv, mask, n)``: log-probs ``[B, T]``, old log-probs ``[B, T]``,
advantages broadcastable to ``[B, T]``, member mask ``[B, T]`` (bool), the token-mean denominator
``n`` (0-d); and returns ``(loss, metrics)``. Non-members may hold any finite value."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ppo_clip", "dual_clip", "dppo_tv"]


def _token_mean(x: Tensor, mask: Tensor, n: Tensor) -> Tensor:
    """``Σ_members x / n``."""
    return torch.where(mask, x, 0.0).sum() / n


def _fraction(flag: Tensor, mask: Tensor) -> Tensor:
    """The fraction of members where ``flag`` holds."""
    return torch.where(mask, flag, False).sum() / mask.sum()


def ppo_clip(
    logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, n: Tensor, *, eps_low: float, eps_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """TRL's ``dapo``: ``Σ_members −min(r A, clip(r, 1 − ε_low, 1 + ε_high) A) / n``, ``r = exp(logp − old)``.
    Metrics as TRL names them: the members' fraction with ``r < 1 − ε_low`` and ``A < 0`` (low), with
    ``r > 1 + ε_high`` and ``A > 0`` (high), either (region)."""
    r = torch.exp(logp - old)  # [B, T]
    per_token = -torch.minimum(r * adv, r.clamp(1 - eps_low, 1 + eps_high) * adv)  # [B, T]
    low, high = (r < 1 - eps_low) & (adv < 0), (r > 1 + eps_high) & (adv > 0)
    metrics = {
        "clip_ratio/low_mean": _fraction(low, mask),
        "clip_ratio/high_mean": _fraction(high, mask),
        "clip_ratio/region_mean": _fraction(low | high, mask),
    }
    return _token_mean(per_token, mask, n), metrics


def _clamped_log_ratio(logp: Tensor, old: Tensor) -> Tensor:
    return (logp - old).clamp(-20.0, 20.0)  # verl's bound on log r


def _kl_metric(log_r: Tensor, mask: Tensor) -> Tensor:
    return _token_mean(-log_r.detach(), mask, mask.sum())


def dual_clip(
    logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, n: Tensor, *, eps_low: float, eps_high: float, c: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """verl's ``vanilla``: PPO clip ``ℓ = max(−A r, −A clip(r, 1 − ε_low, 1 + ε_high))``, capped at
    ``−A c`` where ``A < 0``, token mean over ``n``; ``log r`` clamped to ``±20``. Metrics as verl names
    them: fraction clipped, the members' mean ``−log r``, fraction capped by ``c``."""
    log_r = _clamped_log_ratio(logp, old)  # [B, T]
    r = torch.exp(log_r)
    unclipped, clipped = -adv * r, -adv * r.clamp(1 - eps_low, 1 + eps_high)
    pessimistic = torch.maximum(unclipped, clipped)  # [B, T]
    cap = -adv * c
    per_token = torch.where(adv < 0, torch.minimum(pessimistic, cap), pessimistic)
    metrics = {
        "actor/pg_clipfrac": _fraction(clipped > unclipped, mask),
        "actor/ppo_kl": _kl_metric(log_r, mask),
        "actor/pg_clipfrac_lower": _fraction((pessimistic > cap) & (adv < 0), mask),
    }
    return _token_mean(per_token, mask, n), metrics


def dppo_tv(
    logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, n: Tensor, *, eps_low: float, eps_high: float, c: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """verl's ``dppo_tv``: ``−A · sg(min(r, c)) · logp`` on the tokens whose probability moved at most
    ``ε_high`` up (``A > 0``) or ``ε_low`` down (``A ≤ 0``), token mean over ``n``. Metrics as verl
    names them: fraction masked, the members' mean ``−log r``, fraction kept with ``r > c``."""
    log_r = _clamped_log_ratio(logp, old)  # [B, T]
    r = torch.exp(log_r)
    moved = torch.exp(logp) - torch.exp(old)  # [B, T]
    keep = torch.where(adv > 0, moved <= eps_high, moved >= -eps_low)
    per_token = torch.where(keep, -adv * r.clamp(max=c).detach() * logp, 0.0)
    metrics = {
        "actor/pg_clipfrac": _fraction(~keep, mask),
        "actor/ppo_kl": _kl_metric(log_r, mask),
        "actor/pg_clipfrac_lower": _fraction((r > c) & keep, mask),
    }
    return _token_mean(per_token, mask, n), metrics
