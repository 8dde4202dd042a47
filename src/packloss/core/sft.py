"""The supervised objectives: masked negative log-likelihood (SFT) and the entropy term."""

from __future__ import annotations

from dataclasses import dataclass

from packloss.core.components import ComponentInputs, ComponentOutput, upcast

__all__ = ["SFT", "Entropy"]


@dataclass(frozen=True)
class SFT:
    """Negative log-likelihood of the sampled tokens: ``ℓ_t = −trn_t`` (SFT, ECHO observation tokens).

    Reads ``outputs.logprobs``. Its mean NLL over the members is the engine's ``{name}/loss`` metric.
    """

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        return ComponentOutput(per_token=-upcast(inputs.trainer_logprobs))  # [N]


@dataclass(frozen=True)
class Entropy:
    """An entropy term from the forward's per-token entropy ``H_t`` (``outputs.entropy``):
    ``ℓ_t = −coef · H_t``.

    ``coef > 0`` is a bonus (minimising the loss raises the entropy, as verl's ``entropy_coeff``);
    ``coef < 0`` a regulariser that lowers it. Metric ``entropy``: the mean of ``H`` over the members.
    """

    coef: float = 1e-3

    def __post_init__(self) -> None:
        if isinstance(self.coef, bool) or not isinstance(self.coef, int | float):
            raise TypeError(f"coef must be a number, got {type(self.coef).__name__}")
        if self.coef != self.coef or abs(self.coef) == float("inf"):
            raise ValueError(f"coef must be finite, got {self.coef}")

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        h = upcast(inputs.outputs.require("entropy", inputs.name))  # [N]
        value, count = inputs.mean(h, inputs.loss_mask)
        return ComponentOutput(per_token=-self.coef * h, metrics={"entropy": value}, counts={"entropy": count})
