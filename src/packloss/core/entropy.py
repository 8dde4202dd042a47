"""The entropy term, with a fixed or an adaptive coefficient.

``Entropy(coef)`` is a component whose per-token loss is ``ℓ_t = −coef · H_t`` with ``H_t`` the
forward's per-token entropy (``outputs.entropy``): ``coef > 0`` is a bonus (minimising the loss
raises the entropy, as verl's ``entropy_coeff``), ``coef < 0`` a regulariser that lowers it.

The coefficient may be a 0-d tensor that changes between steps without a recompile or a host read:
:class:`AdaptiveEntropy` owns one and moves it towards a target entropy (the automatic temperature
of SAC, used for LLM RL by e.g. Skywork-OR1's adaptive entropy control)::

    control = AdaptiveEntropy(target=0.3, lr=0.01)
    component = Component(control.entropy, mask)                   # Entropy(coef=control.coef)
    ... result = compute_loss(plan, outputs, denominators) ...
    control.update(result.metrics["entropy/entropy"])              # coef += lr · (target − H), clamped

``update`` runs on the device (in place, no sync); give it the step's entropy (merged over
micro-batches and ranks with :func:`~packloss.merge_metrics` / :func:`~packloss.all_reduce_metrics`)
so every rank moves the coefficient the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from packloss.core.components import ComponentInputs, ComponentOutput, upcast

__all__ = ["Entropy", "AdaptiveEntropy"]


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


@dataclass(frozen=True, eq=False)
class Entropy:
    """An entropy term ``ℓ_t = −coef · H_t`` (module doc). ``coef``: a finite number or a 0-d
    floating-point tensor (read on the device at every call). Metric ``entropy``: the mean of ``H``
    over the members."""

    coef: float | Tensor = 1e-3

    def __post_init__(self) -> None:
        if isinstance(self.coef, Tensor):
            if self.coef.dim() != 0 or not self.coef.is_floating_point():
                raise ValueError(f"coef must be a number or a 0-d floating-point tensor, got {self.coef.dtype} "
                                 f"of shape {list(self.coef.shape)}")  # fmt: skip
        else:
            _finite("coef", self.coef)

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        h = upcast(inputs.outputs.require("entropy", inputs.name))  # [N]
        value, count = inputs.mean(h, inputs.loss_mask)
        coef = self.coef.to(h.dtype) if isinstance(self.coef, Tensor) else self.coef
        return ComponentOutput(per_token=-coef * h, metrics={"entropy": value}, counts={"entropy": count})


@dataclass(eq=False)
class AdaptiveEntropy:
    """An entropy coefficient driven towards ``target``: after each step,
    ``coef ← clamp(coef + lr · (target − H), min_coef, max_coef)`` with ``H`` the step's mean entropy.

    Args:
        target: the entropy to hold (nats per token), ``>= 0``.
        lr: the step size, ``> 0``.
        coef: the initial coefficient.
        min_coef, max_coef: the clamp (default ``[0, 1]``: a bonus only, never a regulariser).
        device: where the coefficient lives.
    """

    target: float
    lr: float = 1e-2
    coef: float = 0.0
    min_coef: float = 0.0
    max_coef: float = 1.0
    device: torch.device | str = "cpu"
    entropy: Entropy = field(init=False)

    def __post_init__(self) -> None:
        for name in ("target", "lr", "coef", "min_coef", "max_coef"):
            setattr(self, name, _finite(f"AdaptiveEntropy.{name}", getattr(self, name)))
        if self.target < 0:
            raise ValueError(f"AdaptiveEntropy.target must be >= 0, got {self.target}")
        if not self.lr > 0:
            raise ValueError(f"AdaptiveEntropy.lr must be > 0, got {self.lr}")
        if not self.min_coef <= self.coef <= self.max_coef:
            raise ValueError(f"AdaptiveEntropy needs min_coef <= coef <= max_coef, got "
                             f"{self.min_coef}, {self.coef}, {self.max_coef}")  # fmt: skip
        value = torch.tensor(self.coef, dtype=torch.float32, device=self.device)
        self.entropy = Entropy(value)

    @property
    def value(self) -> Tensor:
        """The current coefficient, a 0-d float32 tensor (the one :attr:`entropy` reads)."""
        return self.entropy.coef

    def update(self, entropy: Tensor) -> Tensor:
        """Move the coefficient by ``lr · (target − entropy)`` and clamp it, in place on the device.
        ``entropy``: the step's mean entropy, a 0-d tensor. Returns the new coefficient."""
        if not isinstance(entropy, Tensor) or entropy.dim() != 0:
            raise TypeError("entropy must be a 0-d tensor (the step's mean entropy, e.g. the 'entropy' metric)")
        coef = self.value
        step = (self.target - entropy.detach().to(coef)) * self.lr
        coef.add_(step).clamp_(self.min_coef, self.max_coef)
        return coef
