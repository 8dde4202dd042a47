"""The supervised objective: masked negative log-likelihood (SFT)."""

from __future__ import annotations

from dataclasses import dataclass

from packloss.core.bin import ComponentInputs, ComponentOutput, Objective, Plan
from packloss.core.dtypes import upcast

__all__ = ["SFT"]


@dataclass(frozen=True)
class SFT(Objective):
    """Negative log-likelihood of the sampled tokens: ``ℓ_t = −trn_t`` (SFT, ECHO observation tokens).

    Reads ``outputs.logprobs``. Its mean NLL over the members is the engine's ``{name}/loss`` metric.
    """

    def token_local(self, plan: Plan) -> bool:
        return True

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        return ComponentOutput(per_token=-upcast(inputs.trainer_logprobs))  # [N]
