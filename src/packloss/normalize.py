"""Normalisation modes and the step-wide denominators (DESIGN.md §3).

===================  ====================================================  ==========================
mode                 loss of a component                                   from
===================  ====================================================  ==========================
``token``            ``Σ_t loss_t / (global member tokens)``               prime-rl, DAPO, TRL "dapo"
``position``         ``Σ_t loss_t / (global positions, masked included)``  Fast-LLM PR #430
``sequence_mean``    ``Σ_s (Σ_{t∈s} loss_t / n_s) / (global sequences)``   GRPO seq-mean-token-mean
``sequence_sum``     ``Σ_s Σ_{t∈s} loss_t / (global sequences)``           seq-mean-token-sum
``constant``         ``Σ_t loss_t / C``                                    Dr. GRPO (``C = L_max · G``)
===================  ====================================================  ==========================

"global sequences" counts the sequences with at least one member of the component; ``n_s`` is the
member count of sequence ``s``. Denominators summed over every micro-batch of a step and every
data-parallel rank make the step's gradient independent of how its sequences were packed and split:
:func:`count_denominators` counts them all with **one** ``all_reduce`` of one ``[3, 3]`` tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from packloss.batch import PackedBatch
from packloss.segments import segment_count

__all__ = ["NORMALIZE_MODES", "COMPONENTS", "StepDenominators", "count_denominators", "local_denominator"]

NORMALIZE_MODES = ("token", "position", "sequence_mean", "sequence_sum", "constant")
COMPONENTS = ("rl", "ce", "ref_kl")
_COUNTED = ("token", "position", "sequence")


def check_mode(component: str, mode: str) -> None:
    if mode not in NORMALIZE_MODES:
        raise ValueError(f"normalize[{component!r}] must be one of {NORMALIZE_MODES}, got {mode!r}")


def _sequences_with_members(batch: PackedBatch, mask: Tensor) -> Tensor:
    return (segment_count(mask, batch.seq_ids, batch.num_seqs) > 0).sum(dtype=torch.float32)


def local_denominator(batch: PackedBatch, mask: Tensor, mode: str) -> Tensor | float:
    """This bin's own denominator for ``mode`` (clamped to 1): a tensor, or ``N`` for ``position``."""
    if mode == "constant":
        raise ValueError("normalize='constant' needs an explicit scale (the constant C)")
    if mode == "token":
        return mask.sum(dtype=torch.float32).clamp_min(1)
    if mode == "position":
        return float(batch.num_tokens)
    return _sequences_with_members(batch, mask).clamp_min(1)


@dataclass(frozen=True)
class StepDenominators:
    """Counts of a whole step: ``counts[c, k]`` for component ``c`` in :data:`COMPONENTS` and
    ``k`` in (member tokens, positions, sequences with members)."""

    counts: Tensor  # [3, 3] float32

    def scale(self, component: str, mode: str) -> Tensor:
        """The denominator of ``component`` under ``mode`` (clamped to 1)."""
        check_mode(component, mode)
        if mode == "constant":
            raise ValueError("normalize='constant' needs an explicit scale (the constant C)")
        index = {"token": 0, "position": 1}.get(mode, 2)
        return self.counts[COMPONENTS.index(component), index].clamp_min(1)

    def scales(self, normalize: str | dict[str, str] = "token") -> dict[str, Tensor]:
        """``{"rl_scale": ..., "ce_scale": ..., "ref_kl_scale": ...}`` for :func:`~packloss.compute_loss`."""
        modes = normalize if isinstance(normalize, dict) else dict.fromkeys(COMPONENTS, normalize)
        return {f"{c}_scale": self.scale(c, modes.get(c, "token")) for c in COMPONENTS}


def count_denominators(
    batches: Sequence[PackedBatch],
    *,
    all_reduce: bool = False,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> StepDenominators:
    """Count every denominator of a step over ``batches`` (this rank's micro-batches) and, with
    ``all_reduce=True``, over the ranks of ``group`` (default: the world) with ONE ``all_reduce``.

    Positions count every token of every bin for every component. A rank with no micro-batch passes
    ``[]`` (and ``device``) and still joins the all-reduce. No device→host sync. Only the masks,
    weights and layout are read, so before the forward a trainer may build the batches with any
    placeholder for ``trainer_logprobs`` (e.g. the inference log-probs).
    """
    if device is None:
        device = batches[0].trainer_logprobs.device if batches else torch.device("cpu")
    total = torch.zeros(len(COMPONENTS), len(_COUNTED), dtype=torch.float32, device=device)
    for batch in batches:
        total[:, 1] += batch.num_tokens
        for name, mask in batch.component_masks().items():
            c = COMPONENTS.index(name)
            total[c, 0] += mask.sum(dtype=torch.float32)
            total[c, 2] += _sequences_with_members(batch, mask)
    if all_reduce:
        dist.all_reduce(total, group=group)
    return StepDenominators(counts=total)
