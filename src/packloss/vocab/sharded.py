"""The fused head on a sharded LM-head weight: :func:`head_weight` turns a module's (or a parameter's)
weight into what :func:`~packloss.vocab.head.linear_logprobs` takes, ``(weight, parallel)``, whatever
its sharding — a plain tensor as is; an FSDP2 (``fully_shard``) shard unsharded once through FSDP's own
``unshard`` (FSDP reduce-scatters the gradient and reshards after the backward); a DTensor ``Shard(0)``
over a tensor-parallel mesh as its local vocabulary slice with :class:`~packloss.vocab.core.VocabParallel`
(no gather). DeepSpeed ZeRO-3 is a recipe in ``docs/sharded_head.md``. Tied weights stay one Parameter.
The mechanisms, the all-gather counts and their tests: ``docs/sharded_head.md``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed._composable_state import _module_state_mapping
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
from torch.distributed.tensor import DTensor, Replicate, Shard

from packloss.vocab.core import VocabParallel
from packloss.vocab.head import linear_logprobs

__all__ = ["HeadWeight", "head_weight", "sharded_linear_logprobs"]


class HeadWeight(NamedTuple):
    """What :func:`head_weight` yields: ``weight`` ``[V, H]`` (or this rank's ``[V_local, H]`` vocabulary
    rows) and ``parallel`` (None, or the :class:`VocabParallel` of those rows), the two arguments of
    :func:`~packloss.vocab.head.linear_logprobs`."""

    weight: Tensor
    parallel: VocabParallel | None


def _parameter_of(head: object) -> tuple[Tensor, bool]:
    """``(the weight, whether head is an FSDPModule)``; a module must be bias-free with a ``.weight``."""
    if isinstance(head, nn.Module):
        weight = getattr(head, "weight", None)
        if not isinstance(weight, Tensor):
            raise TypeError(f"head must have a `.weight` tensor [V, H], got {type(head).__name__} without one")
        if getattr(head, "bias", None) is not None:
            raise ValueError("head has a bias; the fused head supports bias-free output layers only")
        return weight, isinstance(head, FSDPModule)
    if isinstance(head, Tensor):
        return head, False
    raise TypeError(f"head must be an nn.Module with a `.weight` or a Tensor [V, H], got {type(head).__name__}")


def _fsdp_owner(weight: Tensor) -> tuple[FSDPModule, FSDPParam] | None:
    """The ``fully_shard``-ed module whose parameter group holds ``weight`` as its sharded parameter
    (after ``fully_shard``, or resharded to a smaller group after the forward), and that parameter's
    ``FSDPParam``; None when no FSDP2 state holds it sharded. FSDP2 has no public map from a parameter
    to its owner, so this reads the composable-state registry (torch 2.13 layout)."""
    for module, ref in list(_module_state_mapping.items()):
        state = ref()
        if not isinstance(state, FSDPState) or not isinstance(module, FSDPModule):
            continue
        for group in state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                if weight is fsdp_param.sharded_param or weight is getattr(
                    fsdp_param, "_sharded_post_forward_param", None
                ):
                    return module, fsdp_param
    return None


def _vocab_start(weight: DTensor, dim: int) -> int:
    """Global id of this rank's first row of a ``Shard(0)`` DTensor over mesh dimension ``dim``: shards
    follow ``torch.chunk`` (``ceil(V / R)`` rows each, the last ones shorter or empty)."""
    mesh, vocab = weight.device_mesh, weight.shape[0]
    per_rank = -(-vocab // mesh.size(dim))
    start = min(mesh.get_local_rank(dim) * per_rank, vocab)
    local = weight.to_local().shape[0]
    if local != min(per_rank, vocab - start):
        raise ValueError(
            f"head weight: the Shard(0) DTensor holds {local} rows on this rank where torch.chunk places "
            f"{min(per_rank, vocab - start)} (V = {vocab}); its rows are not one contiguous vocabulary slice"
        )
    return start


def _local_head(weight: DTensor) -> HeadWeight:
    """A DTensor that no FSDP2 group holds sharded: ``Shard(0)`` on one mesh dimension and ``Replicate``
    on the others is vocab-parallel over that dimension's group (its local rows, differentiable through
    ``to_local``: the gradient lands on the DTensor parameter as ``Shard(0)``); all ``Replicate`` is a
    full local copy."""
    placements = tuple(weight.placements)
    sharded = [d for d, p in enumerate(placements) if not isinstance(p, Replicate)]
    if len(sharded) > 1 or any(type(placements[d]) is not Shard or placements[d].dim != 0 for d in sharded):
        raise ValueError(
            f"head weight: a DTensor head must be Shard(0) (vocab-parallel) on at most one mesh dimension and "
            f"Replicate on the others, got placements {placements}"
        )
    local = weight.to_local()  # [V_local, H]
    if not sharded:
        return HeadWeight(local, None)
    (dim,) = sharded
    group = weight.device_mesh.get_group(dim)
    return HeadWeight(local, VocabParallel(group, vocab_start=_vocab_start(weight, dim)))


def _check_not_partitioned(weight: Tensor) -> None:
    """A DeepSpeed ZeRO-3 parameter outside a gather holds no data: say how to gather it."""
    if hasattr(weight, "ds_status") and weight.dim() != 2:
        raise ValueError(
            f"head weight is a partitioned DeepSpeed ZeRO-3 parameter (shape {tuple(weight.shape)}); gather it "
            "around the call and its backward with deepspeed.zero.GatheredParameters(weight, modifier_rank=None), "
            "or register it with deepspeed.zero.register_external_parameter (docs/sharded_head.md)"
        )


@contextlib.contextmanager
def head_weight(head: nn.Module | Tensor) -> Iterator[HeadWeight]:
    """Yield ``HeadWeight(weight, parallel)`` for the fused head from ``head`` (a bias-free output
    module, e.g. ``model.lm_head`` or a tied ``nn.Embedding``, or its weight), whatever its sharding::

        with head_weight(model.lm_head) as (w, parallel):
            logprobs, entropy = linear_logprobs(hidden, w, labels, parallel=parallel)

    * a plain tensor, or an FSDP2 parameter already unsharded (inside its module's forward, or a root
      kept unsharded after the forward): as is, no collective;
    * an FSDP2 parameter still sharded (outside its module's forward, verl #7427): its module's
      ``FSDPModule.unshard()`` — one all-gather of that parameter group, in FSDP's ``param_dtype`` —
      and the unsharded parameter, kept until FSDP's post-backward reduce-scatters its gradient
      (following the group's gradient-sync, ``reduce_dtype`` and divide-factor settings) and reshards;
      the linear_logprobs backward recomputes from it without a second gather. The backward must run
      through a forward of the FSDP model (the hidden states come from it), which queues that
      post-backward. With grad mode off nothing keeps the weight, and the group is resharded on exit;
    * a DTensor ``Shard(0)`` over a tensor-parallel mesh (torchtitan's vocab-parallel output layer): this
      rank's rows and ``VocabParallel`` of that mesh dimension, no gather (the hidden states must then be
      the same full tensor on every rank of the group);
    * a DeepSpeed ZeRO-3 parameter outside a gather: ``ValueError`` pointing to the recipe.

    A weight tied to the input embedding stays the one Parameter: both uses accumulate into its gradient.
    """
    weight, is_fsdp_module = _parameter_of(head)
    _check_not_partitioned(weight)
    owner = _fsdp_owner(weight) if isinstance(weight, DTensor) else None
    if owner is None and is_fsdp_module and isinstance(weight, DTensor):
        raise RuntimeError("head is an FSDPModule but no FSDP2 parameter group holds its weight (unknown FSDP2 layout)")
    resharding = None
    if owner is not None:
        module, fsdp_param = owner
        module.unshard()
        weight = fsdp_param.unsharded_param
        resharding = module if not torch.is_grad_enabled() else None
    try:
        yield _local_head(weight) if isinstance(weight, DTensor) else HeadWeight(weight, None)
    finally:
        if resharding is not None:
            resharding.reshard()


def sharded_linear_logprobs(
    hidden: Tensor, head: nn.Module | Tensor, labels: Tensor, **kwargs: object
) -> tuple[Tensor, Tensor | None]:
    """:func:`~packloss.vocab.head.linear_logprobs` on ``head``'s weight through :func:`head_weight`;
    ``kwargs`` are linear_logprobs' keywords except ``parallel`` (given by the weight's sharding)."""
    if "parallel" in kwargs:
        raise TypeError("sharded_linear_logprobs takes no `parallel`: it comes from the head weight's sharding")
    with head_weight(head) as (weight, parallel):
        return linear_logprobs(hidden, weight, labels, parallel=parallel, **kwargs)
