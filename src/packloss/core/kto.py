"""KTO on packed bins (Ethayarajh et al. 2024): unpaired, each sequence desirable or undesirable
(``Plan.chosen``), against a detached KL reference point ``z`` estimated from mismatched
(prompt, completion) sequences by :func:`kto_reference_kl`, as TRL's ``KTOTrainer`` and OpenRLHF's
former ``KTOLoss`` do. Layout and peer names: ``docs/preference.md``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from packloss.core import checks
from packloss.core.bin import ComponentInputs, ComponentOutput, Normalize, Objective, Plan
from packloss.core.dtypes import upcast
from packloss.core.preference import require_mode, scalar_means, sequence_sums, table

__all__ = ["KTO", "kto_reference_kl"]


def _desirable(plan: Plan) -> Tensor:
    return torch.tensor(plan.chosen, dtype=torch.bool).to(plan.device)  # [S]: one host→device copy


@dataclass(frozen=True, eq=False)
class KTO(Objective):
    """Kahneman–Tversky optimisation. Per sequence ``i`` with ``ρ_i = Σ_{t∈i} (trn_t − ref_t)`` over
    the members and the reference point ``z`` (detached)::

        desirable    L_i = λ_D · (1 − σ(β (ρ_i − z)))
        undesirable  L_i = λ_U · (1 − σ(β (z − ρ_i)))

    every member token of ``i`` takes ``L_i``, and ``normalize="sequence_mean"`` (the only mode
    accepted) makes the term the mean over the step's sequences with members, as TRL's and OpenRLHF's
    mean over the batch.

    Args:
        beta: ``β > 0``.
        desirable_weight, undesirable_weight: ``λ_D``, ``λ_U`` (``>= 0``).
        kl: ``z``, a number ``>= 0`` or a 0-d tensor read on the device at every call (fill it in place
            with :func:`kto_reference_kl` each step). ``0``: no reference point (TRL's
            ``apo_zero_unpaired`` differs; not provided).

    Reads trainer and reference log-probs and ``Plan.chosen``. Metrics (TRL's names), over the bin's
    sequences with members (counts: sequences): ``loss`` (the mean ``L_i``), ``rewards/chosen`` and
    ``logps/chosen`` (``β ρ_i`` and ``Σ trn`` over the desirable ones), ``rewards/rejected`` and
    ``logps/rejected`` (the undesirable ones), ``kl`` (``z``, count 1 per bin). TRL's ``rewards/margins`` is
    the merged ``rewards/chosen − rewards/rejected``.
    """

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    kl: float | Tensor = 0.0

    def __post_init__(self) -> None:
        checks.positive("KTO.beta", self.beta)
        checks.nonnegative("KTO.desirable_weight", self.desirable_weight)
        checks.nonnegative("KTO.undesirable_weight", self.undesirable_weight)
        if isinstance(self.kl, Tensor):
            if self.kl.dim() != 0 or not self.kl.is_floating_point():
                raise ValueError(f"KTO.kl must be a number or a 0-d floating-point tensor, got {self.kl.dtype} "
                                 f"of shape {list(self.kl.shape)}")  # fmt: skip
        else:
            checks.nonnegative("KTO.kl", self.kl)

    def check_plan(self, plan: Plan, name: str) -> None:
        if plan.chosen is None:
            raise ValueError(f"component {name!r} (KTO) needs the plan's chosen flags (True = desirable)")
        plan.require("ref_logprobs", name)
        require_mode(plan, name, (Normalize.SEQUENCE_MEAN,), "KTO's loss per sequence")
        table(plan, "desirable", _desirable)

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        desirable = table(inputs.plan, "desirable", _desirable)  # [S]
        stats = sequence_sums(inputs, with_ref=True)  # [S, 3]
        policy, rho, count = stats[:, 0], stats[:, 0] - stats[:, 1], stats[:, 2]
        if isinstance(self.kl, Tensor):
            z = self.kl.detach().to(device=rho.device, dtype=rho.dtype)
        else:
            z = torch.full((), self.kl, dtype=rho.dtype, device=rho.device)
        x = self.beta * (rho - z)  # [S]
        # 1 − σ(β(ρ − z)) = σ(−β(ρ − z)) and 1 − σ(β(z − ρ)) = σ(β(ρ − z))
        loss = torch.where(
            desirable, self.desirable_weight * torch.sigmoid(-x), self.undesirable_weight * torch.sigmoid(x)
        )  # [S]
        seg = inputs.segments
        per_token = seg.broadcast(loss)  # [N]
        rewards = self.beta * rho.detach()
        active = count > 0  # [S]
        if inputs.per_sequence_metrics:
            named = {"loss": loss, "rewards/chosen": rewards, "rewards/rejected": rewards,
                     "logps/chosen": policy, "logps/rejected": policy, "kl": z.expand(rho.shape)}  # fmt: skip
            masks = {"rewards/chosen": desirable, "logps/chosen": desirable,
                     "rewards/rejected": ~desirable, "logps/rejected": ~desirable}  # fmt: skip
            counts = {k: (active & masks.get(k, active)).to(torch.float32) for k in named}
            return ComponentOutput(per_token, {k: v.detach() for k, v in named.items()}, counts)
        reported = seg.reported(active)  # [S]: one rank reports each sequence of a context-parallel bin
        metrics, counts = scalar_means({
            "loss": (loss, reported),
            "rewards/chosen": (rewards, reported & desirable),
            "rewards/rejected": (rewards, reported & ~desirable),
            "logps/chosen": (policy, reported & desirable),
            "logps/rejected": (policy, reported & ~desirable),
        })  # fmt: skip
        # one count per bin: on the rank that reports its first sequence, when context-parallel
        metrics["kl"], counts["kl"] = z, seg.reported(torch.ones_like(active))[0].to(torch.float32)
        return ComponentOutput(per_token, metrics, counts)


def kto_reference_kl(
    plans: Sequence[Plan],
    logprobs: Sequence[Tensor],
    name: str,
    *,
    all_reduce: bool = False,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """KTO's reference point from mismatched (prompt, completion) sequences (TRL pairs prompt ``x_i``
    with the completion of ``x_{i−1}``): ``z = max(0, Σ_i ρ_i / M)`` with ``ρ_i = Σ_{t∈i} (trn_t −
    ref_t)`` over the members of component ``name`` of each plan and ``M`` the sequences with members.

    ``plans`` hold those sequences (``ref_logprobs`` and a component ``name`` whose members are their
    completion tokens), ``logprobs[k]`` the trainer's log-probs ``[N]`` of ``plans[k]`` (read
    detached: TRL runs that forward under ``no_grad``). With ``all_reduce`` the sums travel over
    ``group`` in one ``all_reduce``: ``z`` is the mean over every rank's sequences (TRL and OpenRLHF
    average the ranks' means: the same when the ranks hold as many); a context-parallel shard's
    sequence sums take one more, over its group. Returns a 0-d float64 tensor; no host read.
    """
    if isinstance(plans, Plan) or not isinstance(plans, Sequence) or len(plans) != len(logprobs):
        raise TypeError("plans and logprobs must be sequences of the same length (one log-prob stream per plan)")
    total = None
    for k, (plan, trn) in enumerate(zip(plans, logprobs, strict=True)):
        if not isinstance(plan, Plan):
            raise TypeError(f"plans[{k}] must be a Plan, got {type(plan).__name__}")
        if name not in plan.members:
            raise ValueError(f"plans[{k}] has no component {name!r} (components: {sorted(plan.members)})")
        checks.tensor(f"logprobs[{k}]", trn, shape=(plan.num_tokens,), floating=True, device=plan.device)
        m = plan.members[name]  # [N]
        ref = upcast(plan.require("ref_logprobs", name)).to(torch.float64)
        x = torch.where(m, upcast(trn.detach()).to(torch.float64) - ref, 0.0)  # [N]
        seg = plan.layout.segments
        sums = seg.sum(torch.stack([x, m.to(torch.float64)], dim=1))  # [S, 2]
        reported = seg.reported(sums[:, 1] > 0)  # [S]
        part = torch.stack([torch.where(reported, sums[:, 0], 0.0).sum(), reported.sum(dtype=torch.float64)])
        total = part if total is None else total + part
    if total is None:
        raise ValueError("plans is empty: no sequences to estimate the KL from")
    if all_reduce:
        dist.all_reduce(total, group=group)
    return (total[0] / total[1].clamp_min(1)).clamp_min(0)
