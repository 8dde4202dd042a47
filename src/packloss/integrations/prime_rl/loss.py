"""What both prime-rl APIs share: prime-rl's ``LossInputs`` / ``LossOutputs``, its fixed ``ce`` and
``ref_kl`` components, its ``compute_loss`` over lists of per-sequence tensors (read as one packed bin,
:mod:`.lists`) and its tensor helpers. ``docs/integrations/prime_rl.md`` tells the story."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from packloss.core import checks
from packloss.core.bin import Component, ComponentInputs, ComponentOutput, Objective, Plan
from packloss.core.dtypes import upcast
from packloss.core.engine import compute_loss as engine_loss
from packloss.core.metrics import masked_mean
from packloss.core.outputs import Outputs
from packloss.core.pg import REF_KL, PolicyGradient, PolicyInputs, pg_loss
from packloss.core.segments import Segments
from packloss.integrations.prime_rl.lists import packed_lists

SHARED = ("LossInputs", "LossOutputs", "LossFn", "ce_loss_fn", "ref_kl_loss_fn", "compute_loss",
          "selective_log_softmax", "compute_entropy", "shift_tensor_left", "shift_tensor_right")  # fmt: skip
"""The names of prime-rl's loss module that both its APIs share (re-exported by :mod:`.legacy` and :mod:`.current`)."""

__all__ = [*SHARED, "SHARED", "LISTS", "summed", "import_object", "packed_loss"]


@dataclass
class LossInputs:
    """What a prime-rl loss function sees, every stream ``[N]`` over the concatenated bin (prime-rl's
    names). ``loss_mask`` selects the component's members; ``loss_weights`` is its weight stream (None:
    1). ``seq_ids [N]``, ``cu_seqlens [S+1]`` and ``num_seqs`` describe the packing; they default to
    one sequence spanning all tokens (what a per-sequence caller passes)."""

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
        if self.seq_ids is None:
            n = self.trainer_logprobs.shape[0]
            device = self.trainer_logprobs.device
            self.seq_ids = torch.zeros(n, dtype=torch.long, device=device)
            self.cu_seqlens = torch.tensor([0, n], dtype=torch.int32, device=device)
            self.num_seqs = 1

    def mean(self, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Sync-free mean of ``values`` over ``mask`` and its member count (``[S]`` per sequence)."""
        return masked_mean(values, mask, self.segments, self.per_sequence_metrics)

    @property
    def segments(self) -> Segments:
        """The packing as packloss's per-sequence reductions."""
        return Segments(self.seq_ids, self.num_seqs)

    def policy_inputs(self) -> PolicyInputs:
        """These streams as a policy-gradient objective reads them (no old stream in prime-rl)."""
        return PolicyInputs(
            m=self.loss_mask,
            trn=self.trainer_logprobs,
            rollout=self.inference_logprobs,
            old=None,
            ref=self.ref_logprobs,
            advantages=self.advantages,
            segments=self.segments,
            per_sequence_metrics=self.per_sequence_metrics,
        )


@dataclass
class LossOutputs:
    """A loss function's summed loss (a scalar, not yet divided by any scale) and its metrics;
    ``counts`` maps a metric name to the member count it was taken over (optional)."""

    loss: Tensor
    metrics: dict[str, Tensor]
    counts: dict[str, Tensor] = field(default_factory=dict)


LossFn = Callable[[LossInputs], LossOutputs]
LISTS = ("inference_logprobs", "ref_logprobs", "advantages", "loss_mask", "rl_weights", "ce_weights", "ref_kl_weights")
"""``compute_loss``'s list arguments besides ``trainer_logprobs``, in its order."""


def summed(inputs: LossInputs, objective: PolicyGradient, metrics: tuple[str, ...] | None = None) -> LossOutputs:
    """``Σ_t ℓ_t · w_t`` of ``objective`` over the members, in the per-token order of prime-rl's code,
    and its metrics (those named in ``metrics``, else all but the drift term's)."""
    out = pg_loss(inputs.policy_inputs(), objective)
    per_token = out.per_token  # [N], zero off the members
    if inputs.loss_weights is not None:
        per_token = per_token * torch.where(inputs.loss_mask, upcast(inputs.loss_weights), 0.0)
    keep = metrics if metrics is not None else [k for k in out.metrics if k != "rollout_kl_penalty"]
    return LossOutputs(per_token.sum(), {k: out.metrics[k] for k in keep}, {k: out.counts[k] for k in keep})


def ref_kl_loss_fn(inputs: LossInputs) -> LossOutputs:
    """On-policy distillation (:data:`packloss.REF_KL`); metrics ``ref_kl/...`` and ``ref_kl`` (the
    mean ``ref − trn``)."""
    out = summed(inputs, REF_KL)
    rename = lambda k: "ref_kl" if k == "ref_kl" else f"ref_kl/{k}"  # noqa: E731
    metrics = {rename(k): v for k, v in out.metrics.items()}
    return LossOutputs(out.loss, metrics, {rename(k): v for k, v in out.counts.items()})


def ce_loss_fn(inputs: LossInputs) -> LossOutputs:
    """Masked negative log-likelihood ``Σ −trn · w``; metric ``nll``."""
    m = inputs.loss_mask
    trn = upcast(inputs.trainer_logprobs)
    nll = -trn if inputs.loss_weights is None else -trn * upcast(inputs.loss_weights)
    value, count = inputs.mean(-trn, m)
    return LossOutputs(torch.where(m, nll, 0.0).sum(), {"nll": value}, {"nll": count})


def import_object(import_path: object) -> Any:
    """``"pkg.module.name"`` or ``"pkg.module:name"`` → the object."""
    if not isinstance(import_path, str):
        raise TypeError(f"import_path must be a str, got {type(import_path).__name__}")
    module_name, sep, attr = import_path.partition(":")
    if not sep:
        module_name, _, attr = import_path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"import_path must look like 'pkg.module.function', got {import_path!r}")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {import_path!r}: {exc}") from exc


@dataclass(frozen=True)
class _LossFnComponent(Objective):
    """A prime-rl loss function (summed loss) as an engine component: the function gets the raw
    weights, and its sum is divided by the component's constant scale."""

    fn: LossFn

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        if inputs.plan.layout.sharded:
            raise ValueError(
                f"component {inputs.name!r}: a prime-rl loss function sees whole bins, not a context-parallel shard"
            )
        comp = inputs.plan.components[inputs.name]
        loss_inputs = LossInputs(
            trainer_logprobs=inputs.trainer_logprobs,
            inference_logprobs=inputs.rollout_logprobs,
            ref_logprobs=inputs.ref_logprobs,
            advantages=inputs.advantages,
            loss_mask=inputs.loss_mask,
            loss_weights=comp.weights,
            seq_ids=inputs.seq_ids,
            cu_seqlens=inputs.cu_seqlens,
            num_seqs=inputs.num_seqs,
        )
        out = self.fn(loss_inputs)
        if not isinstance(out, LossOutputs):
            raise TypeError(f"the {inputs.name} loss function must return LossOutputs, got {type(out).__name__}")
        loss = upcast(out.loss)
        if loss.dim() != 0:
            raise ValueError(
                f"the {inputs.name} loss function returned a loss of shape {tuple(loss.shape)}, not a scalar"
            )
        return ComponentOutput(per_token=None, metrics=out.metrics, counts=out.counts, loss=loss / comp.constant)


def compute_loss(
    trainer_logprobs: list[Tensor],
    inference_logprobs: list[Tensor],
    ref_logprobs: list[Tensor] | None,
    advantages: list[Tensor],
    loss_mask: list[Tensor],
    rl_weights: list[Tensor] | None,
    ce_weights: list[Tensor] | None,
    ref_kl_weights: list[Tensor] | None,
    rl_loss_fn: LossFn,
    rl_scale: int,
    ce_scale: int,
    ref_kl_scale: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """prime-rl's ``compute_loss``: lists of per-sequence ``[n_i]`` tensors in, ``(loss, metrics)`` out.

    ``loss = Σ rl / rl_scale + Σ ce / ce_scale + Σ ref_kl / ref_kl_scale``, each component computed
    once over the concatenated bin; metrics are 1-element token-weighted tensors. No host read.
    """
    if not callable(rl_loss_fn):
        raise TypeError(f"rl_loss_fn must be callable, got {type(rl_loss_fn).__name__}")
    lists = (inference_logprobs, ref_logprobs, advantages, loss_mask, rl_weights, ce_weights, ref_kl_weights)
    streams, seq_lens = packed_lists(trainer_logprobs, dict(zip(LISTS, lists, strict=True)))
    return packed_loss(streams, seq_lens, rl_loss_fn, rl_scale, ce_scale, ref_kl_scale)


def packed_loss(
    streams: dict[str, Tensor | None],
    seq_lens: tuple[int, ...],
    rl_loss_fn: LossFn,
    rl_scale: int,
    ce_scale: int,
    ref_kl_scale: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`compute_loss` once its lists are read: ``streams`` maps each list argument's name to its
    packed ``[N]`` tensor (or None). The benchmark calls it to time what reading the lists costs."""
    for name in ("inference_logprobs", "advantages", "loss_mask"):
        if streams[name] is None:
            raise ValueError(f"{name} is required (a list of per-sequence tensors), got None")
    if streams["ref_kl_weights"] is not None and streams["ref_logprobs"] is None:
        raise ValueError("ref_kl_weights is given but ref_logprobs is None: the ref_kl component needs them")
    scales = {
        k: _scale(k, v) for k, v in (("rl_scale", rl_scale), ("ce_scale", ce_scale), ("ref_kl_scale", ref_kl_scale))
    }
    components = {
        "rl": Component(
            _LossFnComponent(rl_loss_fn), streams["loss_mask"], streams["rl_weights"], "constant", scales["rl_scale"]
        )
    }
    for name, fn in (("ce", ce_loss_fn), ("ref_kl", ref_kl_loss_fn)):
        if streams[f"{name}_weights"] is not None:
            weights, scale = streams[f"{name}_weights"], scales[f"{name}_scale"]
            components[name] = Component(_LossFnComponent(fn), None, weights, "constant", scale)
    plan = Plan(
        seq_lens=seq_lens,
        components=components,
        rollout_logprobs=streams["inference_logprobs"],
        ref_logprobs=streams["ref_logprobs"],
        advantages=streams["advantages"],
    )
    result = engine_loss(plan, Outputs(logprobs=streams["trainer_logprobs"]))
    metrics: dict[str, Tensor] = {}
    for key, value in result.metrics.items():
        _, _, name = key.partition("/")
        if name in metrics:
            raise ValueError(f"metric {name!r} is produced by two components")
        metrics[name] = value.reshape(1)
    return result.loss, metrics


def _scale(name: str, value: object) -> float | Tensor:
    """A component's scale: a finite number > 0, or a 0-d real tensor (its value is not read)."""
    if isinstance(value, Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"{name} must be a number or a 0-d real tensor, got shape {list(value.shape)}")
        return value
    return checks.positive(name, value)


def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """``log_softmax(logits)[..., index]`` without materialising the log-softmax: ``[B, T, V], [B, T] → [B, T]``."""
    picked = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return picked.to(torch.float32) - torch.logsumexp(logits.to(torch.float32), dim=-1)


def compute_entropy(shifted_logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` per position, no gradient: ``[B, T, V] → [B, T]``."""
    with torch.no_grad():
        logits = shifted_logits.to(torch.float32)
        probs = torch.softmax(logits, dim=-1)
        return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def shift_tensor_left(t: Tensor) -> Tensor:
    """``out[:, i] = t[:, i+1]``, last column 0 (labels from input ids): ``[B, T] → [B, T]``."""
    return torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], dim=1)


def shift_tensor_right(t: Tensor, pad_value: float | None = None) -> Tensor:
    """``out[:, i] = t[:, i-1]``, first column ``pad_value`` (default 0): ``[B, T] → [B, T]``."""
    pad = torch.full_like(t[:, :1], 0.0 if pad_value is None else pad_value)
    return torch.cat([pad, t[:, :-1]], dim=1)
