"""The interface every component loss implements: ``LossInputs`` in, ``LossOutputs`` out.

A component loss (the built-in policy-gradient skeleton, the masked NLL, or a custom function)
receives the **whole concatenated bin once** together with its sequence layout, so a loss that is
not additive over tokens (a per-sequence mean, a sequence-level ratio) can stay exact with segment
reductions instead of a Python loop. The field names and order of ``LossInputs``/``LossOutputs``
follow prime-rl's trainer loss module, so a prime-rl custom loss runs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from packloss.segments import segment_mean

__all__ = ["LossInputs", "LossOutputs", "LossFn", "make_outputs", "upcast"]


def upcast(x: Tensor) -> Tensor:
    """``x`` in the compute dtype: at least float32 (bf16/fp16 are promoted, float64 stays)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@dataclass
class LossInputs:
    """What a component loss sees, every stream ``[N]`` over the concatenated bin.

    ``loss_mask`` already selects the component's member tokens; ``loss_weights`` is the component's
    weight stream (None means 1 on every member). ``seq_ids [N]``, ``cu_seqlens [S+1]`` and
    ``num_seqs`` describe the packing; they default to one sequence spanning all tokens (what a
    per-sequence caller passes). With ``per_sequence_metrics`` the loss reports ``[S]`` metrics.
    """

    trainer_logprobs: Tensor
    inference_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor | None
    loss_mask: Tensor
    loss_weights: Tensor | None = None
    seq_ids: Tensor | None = None
    cu_seqlens: Tensor | None = None
    num_seqs: int = 1
    per_sequence_metrics: bool = False

    def __post_init__(self) -> None:
        n = self.trainer_logprobs.shape[0]
        device = self.trainer_logprobs.device
        if self.seq_ids is None:
            self.seq_ids = torch.zeros(n, dtype=torch.long, device=device)
            self.cu_seqlens = torch.tensor([0, n], dtype=torch.int32, device=device)
            self.num_seqs = 1

    def mean(self, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Sync-free mean of ``values`` over ``mask`` and the member count it was taken over.

        Returns scalars ``(Σ_{mask} values / max(count, 1), count)``, or ``([S], [S])`` per sequence
        when ``per_sequence_metrics`` is set. Values outside ``mask`` never enter (inf/NaN safe).
        """
        values = upcast(values.detach())
        if self.per_sequence_metrics:
            return segment_mean(values, mask, self.seq_ids, self.num_seqs)
        count = mask.sum(dtype=torch.float32)
        return torch.where(mask, values, 0.0).sum() / count.clamp_min(1), count


@dataclass
class LossOutputs:
    """A component's summed loss (a scalar, not yet divided by any scale) and its metrics.

    ``counts`` maps a metric name to the member count it was taken over; a metric without an entry
    counts the component's members. Custom functions may leave ``counts`` empty.
    """

    loss: Tensor
    metrics: dict[str, Tensor]
    counts: dict[str, Tensor] = field(default_factory=dict)


LossFn = Callable[[LossInputs], LossOutputs]


def make_outputs(
    inputs: LossInputs, loss: Tensor, named: dict[str, tuple[Tensor, Tensor]], prefix: str = ""
) -> LossOutputs:
    """Build ``LossOutputs`` from ``{name: (values [N], mask [N])}``: each metric is the mean of its
    values over its mask (see :meth:`LossInputs.mean`), with the count it was taken over."""
    metrics, counts = {}, {}
    for name, (values, mask) in named.items():
        metrics[prefix + name], counts[prefix + name] = inputs.mean(values, mask)
    return LossOutputs(loss=loss, metrics=metrics, counts=counts)
