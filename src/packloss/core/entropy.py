"""The entropy term ``ℓ_t = −coef · H_t`` (:class:`Entropy`; ``coef > 0`` is a bonus), with a fixed
coefficient or one driven towards a target entropy on the device (:class:`AdaptiveEntropy`, SAC's
automatic temperature). Usage and the update rule: ``docs/objectives.md``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from packloss.core import checks
from packloss.core.bin import ComponentInputs, ComponentOutput, Objective, Plan
from packloss.core.dtypes import upcast

__all__ = ["Entropy", "AdaptiveEntropy"]


@dataclass(frozen=True, eq=False)
class Entropy(Objective):
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
            checks.number("coef", self.coef)

    def token_local(self, plan: Plan) -> bool:
        return True

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
            setattr(self, name, checks.number(f"AdaptiveEntropy.{name}", getattr(self, name)))
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
