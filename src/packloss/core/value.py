"""The critic's objective :class:`ValueLoss`: the (optionally clipped) regression of the critic's values
on their targets, PPO's value loss (verl's ``compute_value_loss``, OpenRLHF's ``ValueLoss``), squared or
Huber. It reads ``outputs.values`` and the plan's ``returns`` (and ``old_values`` when clipped); targets
can come from :func:`~packloss.core.advantages.gae_advantages`. Usage and peer mapping: ``docs/critic.md``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from packloss.core import checks
from packloss.core.bin import ComponentInputs, ComponentOutput, Objective, Plan
from packloss.core.dtypes import upcast
from packloss.core.metrics import metric_means

__all__ = ["ValueLoss", "VALUE_LOSSES"]

VALUE_LOSSES = ("squared", "huber")


@dataclass(frozen=True)
class ValueLoss(Objective):
    """PPO's value loss on the critic's values ``v = outputs.values`` against the targets ``R = returns``::

        ℓ_t = coef · ρ(v_t − R_t)                                        (clip=None)
        ℓ_t = coef · max(ρ(v_t − R_t), ρ(clip(v_t, o_t − ε, o_t + ε) − R_t))   (clip=ε, o = old_values)

        ρ(x) = x² / 2                                                    (loss="squared")
        ρ(x) = x² / 2 if |x| ≤ δ else δ · (|x| − δ / 2)                  (loss="huber", δ = huber_delta)

    The ½ is in ``ρ`` (verl's and OpenRLHF's ``0.5 ·``; the standard Huber's quadratic part), so
    ``coef=1`` is both peers' loss and Huber tends to the squared loss as ``δ → ∞``. ``R`` and ``o`` are
    constants (detached). Where the clipped branch is the larger, the gradient is that of the clipped
    value: zero outside ``[o − ε, o + ε]``.

    Args:
        clip: ``ε > 0`` (verl's ``cliprange_value``, OpenRLHF's ``value_clip`` / ``clip_eps``), or None.
        loss: ``"squared"`` or ``"huber"``.
        huber_delta: ``δ > 0``, only with ``loss="huber"``.
        coef: ``≥ 0``, a multiplier (a shared actor-critic's ``vf_coef``).

    Metrics: ``vpred_mean`` (the mean of ``v`` over the members) and, with ``clip``, ``vf_clipfrac``
    (the fraction of members where the clipped branch is strictly larger); the engine's ``loss`` is the
    mean ``ℓ`` (verl's ``vf_loss`` under token-mean).
    """

    clip: float | None = None
    loss: Literal["squared", "huber"] = "squared"
    huber_delta: float = 1.0
    coef: float = 1.0

    def __post_init__(self) -> None:
        if self.clip is not None:
            clip = checks.number("ValueLoss.clip", self.clip)
            if not clip > 0:
                raise ValueError(f"ValueLoss.clip must be > 0 (None: no clipping), got {clip}")
            object.__setattr__(self, "clip", clip)
        checks.choice("ValueLoss.loss", self.loss, VALUE_LOSSES)
        object.__setattr__(self, "huber_delta", checks.positive("ValueLoss.huber_delta", self.huber_delta))
        if self.loss != "huber" and self.huber_delta != 1.0:
            raise ValueError(f"ValueLoss.huber_delta is only used with loss='huber', got loss={self.loss!r}")
        object.__setattr__(self, "coef", checks.nonnegative("ValueLoss.coef", self.coef))

    def token_local(self, plan: Plan) -> bool:
        return True

    def check_plan(self, plan: Plan, name: str) -> None:
        plan.require("returns", name)
        if self.clip is not None:
            if plan.old_values is None:
                raise ValueError(
                    f"component {name!r} needs the plan's old_values (the critic's values at the rollout) "
                    f"for ValueLoss(clip={self.clip}), got None"
                )

    def _rho(self, pred: Tensor, target: Tensor) -> Tensor:
        """``ρ(pred − target)``, ``[N]``."""
        if self.loss == "huber":
            return F.huber_loss(pred, target, reduction="none", delta=self.huber_delta)
        return 0.5 * (pred - target) ** 2

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        m = inputs.loss_mask  # [N]
        plan, name = inputs.plan, inputs.name
        # Non-members may hold NaN / inf in any stream: zero them before any arithmetic.
        v = torch.where(m, upcast(inputs.outputs.require("values", name)), 0.0)  # [N]
        target = torch.where(m, upcast(plan.require("returns", name).detach()), 0.0)  # [N]
        per_token = self._rho(v, target)  # [N]
        named = {"vpred_mean": (v, m)}
        if self.clip is not None:
            old = torch.where(m, upcast(plan.require("old_values", name).detach()), 0.0)  # [N]
            clipped = self._rho(torch.clamp(v, old - self.clip, old + self.clip), target)  # [N]
            took_clip = clipped > per_token  # [N] bool
            per_token = torch.where(took_clip, clipped, per_token)
            named["vf_clipfrac"] = (took_clip, m)
        metrics, counts = metric_means(named, inputs.segments, inputs.per_sequence_metrics)
        return ComponentOutput(self.coef * per_token, metrics, counts)
