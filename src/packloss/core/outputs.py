"""What the forward produced for a bin: :class:`Outputs` (checked against the plan, no sync)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from packloss.core import checks

__all__ = ["Outputs", "OUTPUT_DIMS"]

OUTPUT_DIMS = {"logprobs": 1, "entropy": 1, "values": 1, "topk_logprobs": 2, "logits": 2, "hidden": 2}


@dataclass(frozen=True, eq=False)
class Outputs:
    """What the forward produced for a bin (give what the components use): ``logprobs [N]`` the
    trainer's log-probs of the sampled tokens, ``entropy [N]``, ``values [N]`` a critic's values,
    ``topk_logprobs [N, K]`` the trainer's log-probs at the plan's ``rollout_topk_ids``,
    ``logits [N, V]`` student logits, or ``hidden [N, H]`` with ``head_weight [V, H]`` (the fused head:
    the ``N × V`` logits never exist) and ``labels [N]`` the sampled token ids (integer) for a component
    that computes its log-probs from them (``packloss.vocab.FusedObjective``)."""

    logprobs: Tensor | None = None
    entropy: Tensor | None = None
    values: Tensor | None = None
    topk_logprobs: Tensor | None = None
    logits: Tensor | None = None
    hidden: Tensor | None = None
    head_weight: Tensor | None = None
    labels: Tensor | None = None

    def __post_init__(self) -> None:
        for name in (*OUTPUT_DIMS, "head_weight"):
            value = getattr(self, name)
            if value is not None:
                checks.tensor(f"outputs.{name}", value, floating=True)
        if self.labels is not None:
            checks.tensor("outputs.labels", self.labels, integer=True)
        if (self.hidden is None) != (self.head_weight is None):
            raise ValueError("outputs.hidden and outputs.head_weight go together: give both or neither")
        if self.hidden is not None and (
            self.head_weight.dim() != 2 or self.head_weight.shape[1] != self.hidden.shape[-1]
        ):
            raise ValueError(
                f"outputs.head_weight must be [V, H] with H={self.hidden.shape[-1]}, got {list(self.head_weight.shape)}"
            )

    def check(self, plan: Any) -> None:
        """Raise unless every given output is ``[N]`` / ``[N, ·]`` for the plan's N and on its device."""
        n = plan.num_tokens
        for name, dims in OUTPUT_DIMS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if value.dim() != dims or value.shape[0] != n:
                want = "[N]" if dims == 1 else "[N, ·]"
                raise ValueError(f"outputs.{name} must have shape {want} with N={n}, got {list(value.shape)}")
            if value.device != plan.device:
                raise ValueError(f"outputs.{name} is on {value.device} but the plan is on {plan.device}")
        if self.labels is not None and tuple(self.labels.shape) != (n,):
            raise ValueError(f"outputs.labels must have shape [N] with N={n}, got {list(self.labels.shape)}")
        checks.same_device(
            "the plan", plan.device, **{"outputs.head_weight": self.head_weight, "outputs.labels": self.labels}
        )

    def require(self, name: str, component: str) -> Tensor:
        """The output ``name``, or a ``ValueError`` naming the component that needs it."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"component {component!r} needs outputs.{name}, got None")
        return value

    def anchor(self) -> Tensor | None:
        """A float32 zero attached to every given output's graph, reading no value (sums over empty
        slices): keeps the loss backward-able on every rank when no component's term is attached."""
        zero = None
        for name in (*OUTPUT_DIMS, "head_weight"):
            value = getattr(self, name)
            if value is not None and value.requires_grad:
                part = value[:0].sum(dtype=torch.float32)
                zero = part if zero is None else zero + part
        return zero
