"""prime-rl's trainer loss module (``prime_rl.trainer.rl.loss``, before PR #2951), on packloss.

Switch by changing one import::

    # from prime_rl.trainer.rl.loss import compute_loss, setup_rl_loss_fn, LossInputs, LossOutputs
    from packloss.compat.prime_rl import compute_loss, setup_rl_loss_fn, LossInputs, LossOutputs

``compute_loss`` keeps its signature (lists of per-sequence tensors) but concatenates the bin and
runs every component once over it, with no device→host sync. Gradients equal the per-sequence
implementation's bit for bit; the loss equals it up to summation order. A ``trainer_logprobs`` list
made by one ``torch.split`` of a packed row (as a trainer makes it) is read as that row, so the
backward has no per-sequence edge; the other lists are concatenated in one call each.

Differences a caller can see, as PR #2951 states them:

* Metrics are one token-weighted value per micro-batch, as 1-element tensors (before: one value per
  sequence, stacked). A component whose mask is empty reports its metrics with value 0 (before: the
  metric was missing when every sequence was skipped).
* Loss functions (built-in and custom) are called **once per bin** with the concatenated streams and
  the layout fields ``seq_ids``, ``cu_seqlens``, ``num_seqs`` of :class:`LossInputs`.
* Loss configs are matched by their fields (duck typing), so prime-rl's own pydantic configs work:
  ``import_path`` → custom, ``ipo_threshold`` → IPO, ``dppo_mask_low`` / ``dppo_mask_high`` → DPPO. A custom loss
  that is additive over tokens is unaffected; one that normalises per sequence must use the layout
  (``packloss check MODULE:FUNCTION`` tells which).
"""

from __future__ import annotations

import importlib
import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from packloss.core.bin import ComponentInputs, ComponentOutput, masked_mean, upcast
from packloss.core.engine import compute_loss as _engine_compute_loss
from packloss.core.pg import REF_KL, KLPenalty, PolicyGradient, pg_loss
from packloss.core.bin import Component, Outputs, Plan
from packloss.core.trust_regions import DPPOMask, IPOMask

__all__ = [
    "LossInputs",
    "LossOutputs",
    "LossFn",
    "DefaultLossConfig",
    "IPOLossConfig",
    "CustomLossConfig",
    "LossConfig",
    "setup_rl_loss_fn",
    "default_loss_fn",
    "ipo_loss_fn",
    "ref_kl_loss_fn",
    "ce_loss_fn",
    "compute_loss",
    "selective_log_softmax",
    "compute_entropy",
    "shift_tensor_left",
    "shift_tensor_right",
]


@dataclass
class LossInputs:
    """What a prime-rl loss function sees, every stream ``[N]`` over the concatenated bin.

    ``loss_mask`` selects the component's member tokens; ``loss_weights`` is its weight stream (None:
    1 on every member). ``seq_ids [N]``, ``cu_seqlens [S+1]`` and ``num_seqs`` describe the packing;
    they default to one sequence spanning all tokens (what a per-sequence caller passes).
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
        if self.seq_ids is None:
            n = self.trainer_logprobs.shape[0]
            device = self.trainer_logprobs.device
            self.seq_ids = torch.zeros(n, dtype=torch.long, device=device)
            self.cu_seqlens = torch.tensor([0, n], dtype=torch.int32, device=device)
            self.num_seqs = 1

    def mean(self, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Sync-free mean of ``values`` over ``mask`` and its member count (``[S]`` per sequence)."""
        return masked_mean(values, mask, self.seq_ids, self.num_seqs, self.per_sequence_metrics)


@dataclass
class LossOutputs:
    """A loss function's summed loss (a scalar, not yet divided by any scale) and its metrics;
    ``counts`` maps a metric name to the member count it was taken over (optional)."""

    loss: Tensor
    metrics: dict[str, Tensor]
    counts: dict[str, Tensor] = field(default_factory=dict)


LossFn = Callable[[LossInputs], LossOutputs]


@dataclass(frozen=True)
class DefaultLossConfig:
    """prime-rl's default (DPPO + KL) loss settings."""

    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2
    adv_tau: float = 1.0
    kl_tau: float = 1e-3


@dataclass(frozen=True)
class IPOLossConfig:
    """prime-rl's IPO loss settings."""

    ipo_threshold: float = 0.1
    adv_tau: float = 1.0
    kl_tau: float = 1e-3


@dataclass(frozen=True)
class CustomLossConfig:
    """A custom rl loss: ``import_path`` (``"pkg.module.function"`` or ``"pkg.module:function"``)
    called as ``function(inputs, **kwargs)``."""

    import_path: str
    kwargs: dict[str, Any] = field(default_factory=dict)


LossConfig = DefaultLossConfig | IPOLossConfig | CustomLossConfig


def _pg_params(loss_config: Any) -> PolicyGradient:
    """The objective of a DPPO- or IPO-shaped config (matched by its fields)."""
    if hasattr(loss_config, "ipo_threshold"):
        region = IPOMask(loss_config.ipo_threshold)
    else:
        region = DPPOMask(loss_config.dppo_mask_low, loss_config.dppo_mask_high)
    drift = KLPenalty(loss_config.kl_tau, "squared_log_ratio", "rollout")
    return PolicyGradient(region, ratio="rollout", adv_coef=loss_config.adv_tau, penalties=(drift,))


def _summed(inputs: LossInputs, params: PolicyGradient) -> LossOutputs:
    """``Σ_t ℓ_t · w_t`` of the objective, in the per-token order of the per-sequence original, and
    prime-rl's metrics (its drift term reports none)."""
    out = pg_loss(inputs, params)
    per_token = out.per_token
    if inputs.loss_weights is not None:
        per_token = per_token * torch.where(inputs.loss_mask, upcast(inputs.loss_weights), 0.0)
    keep = lambda d: {k: v for k, v in d.items() if k != "rollout_kl_penalty"}  # noqa: E731
    return LossOutputs(loss=per_token.sum(), metrics=keep(out.metrics), counts=keep(out.counts))


def default_loss_fn(inputs: LossInputs, loss_config: DefaultLossConfig) -> LossOutputs:
    """DPPO trust region + squared-log-ratio drift KL (:data:`packloss.DPPO`)."""
    return _summed(inputs, _pg_params(loss_config))


def ipo_loss_fn(inputs: LossInputs, loss_config: IPOLossConfig) -> LossOutputs:
    """IPO: symmetric trust region ``|dp| > ipo_threshold`` (:data:`packloss.IPO`)."""
    return _summed(inputs, _pg_params(loss_config))


def ref_kl_loss_fn(inputs: LossInputs) -> LossOutputs:
    """On-policy distillation (:data:`packloss.REF_KL`); metrics ``ref_kl/...`` and ``ref_kl``
    (the mean ``ref − trn``)."""
    out = _summed(inputs, REF_KL)
    rename = lambda k: "ref_kl" if k == "ref_kl" else f"ref_kl/{k}"
    return LossOutputs(
        loss=out.loss,
        metrics={rename(k): v for k, v in out.metrics.items()},
        counts={rename(k): v for k, v in out.counts.items()},
    )


def ce_loss_fn(inputs: LossInputs) -> LossOutputs:
    """Masked negative log-likelihood ``Σ −trn · w``; metric ``nll``."""
    m = inputs.loss_mask
    trn = upcast(inputs.trainer_logprobs)
    nll = -trn
    if inputs.loss_weights is not None:
        nll = nll * upcast(inputs.loss_weights)
    value, count = inputs.mean(-trn, m)
    return LossOutputs(loss=torch.where(m, nll, 0.0).sum(), metrics={"nll": value}, counts={"nll": count})


def import_object(import_path: str) -> Any:
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


def setup_rl_loss_fn(loss_config: Any) -> LossFn:
    """The rl loss function for a prime-rl loss config, matched by its fields (so prime-rl's own
    pydantic configs work as well as the dataclasses here)."""
    if hasattr(loss_config, "import_path"):
        custom_fn = import_object(loss_config.import_path)
        kwargs = dict(getattr(loss_config, "kwargs", None) or {})
        return lambda inputs: custom_fn(inputs, **kwargs)
    if hasattr(loss_config, "ipo_threshold") or hasattr(loss_config, "dppo_mask_low"):
        params = _pg_params(loss_config)
        return lambda inputs: _summed(inputs, params)
    raise TypeError(
        "loss_config must look like DefaultLossConfig (dppo_mask_low/high), IPOLossConfig (ipo_threshold) or "
        f"CustomLossConfig (import_path), got {type(loss_config).__name__}"
    )


@dataclass(frozen=True)
class _LossFnComponent:
    """Runs a prime-rl loss function (summed loss) as a component of the engine: the function gets
    the raw weights, and its sum is divided by the component's constant scale."""

    fn: LossFn

    def __call__(self, inputs: ComponentInputs) -> ComponentOutput:
        comp = inputs.plan.components[inputs.name]
        loss_inputs = LossInputs(
            trainer_logprobs=inputs.trainer_logprobs,
            inference_logprobs=inputs.plan.inference_logprobs,
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


def _cat(name: str, seqs: list[Tensor] | None, seq_lens: tuple[int, ...]) -> Tensor | None:
    """The per-sequence tensors as one ``[N]`` tensor.

    A list that requires grad and is the output of one ``torch.split`` (what a trainer makes of its
    packed row) is replaced by the split's input, so the bin's backward has no per-sequence edge
    (:func:`_split_input`). Any other list is ``torch.cat``'d (:func:`_concatenate`): for a list without
    grad, one C++ call costs less than reading the views' metadata would."""
    if seqs is None:
        return None
    if len(seqs) != len(seq_lens):
        raise ValueError(f"{name} holds {len(seqs)} sequences, trainer_logprobs {len(seq_lens)}")
    if getattr(seqs[0], "requires_grad", False):
        whole = _split_input(seqs, seq_lens)
        if whole is not None:
            return whole
    return _concatenate(name, seqs, seq_lens)


def _concatenate(name: str, seqs: list[Tensor], seq_lens: tuple[int, ...]) -> Tensor:
    """``torch.cat(seqs)``, every element checked to be ``[n_i]`` at C speed (``numel`` per element and
    a 1-D result); only a failing list is walked in Python, to name the element that is wrong."""
    try:
        out = torch.cat(seqs)
        if out.dim() == 1 and tuple(map(Tensor.numel, seqs)) == seq_lens:
            return out
    except (TypeError, RuntimeError):  # the walk below names the element
        pass
    for i, (t, n) in enumerate(zip(seqs, seq_lens, strict=True)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != (n,):
            raise ValueError(f"{name}[{i}] must have shape ({n},), got {tuple(t.shape)}")
    return torch.cat(list(seqs))  # elements well formed: any error left is torch's (devices, dtypes)


_GRAD_FN = operator.attrgetter("grad_fn")
_OUTPUT_NR = operator.attrgetter("output_nr")
_VIEW_CHAIN_DEPTH = 8  # backward nodes between a split's input and its view root (squeeze, select, view…)


def _split_input(seqs: list[Tensor], seq_lens: tuple[int, ...]) -> Tensor | None:
    """The input of the one ``torch.split(x, seq_lens)`` whose outputs ``seqs`` are, in order, as a
    narrow of ``x``'s view root (the root itself, flattened, when ``x`` covers all of it); None if they
    are anything else.

    Read from autograd's metadata, two C-level ``map``s over the list and no Python frame per element:
    every element has the same ``SplitWithSizesBackward0`` node, at output ``i``; that node split a
    1-D tensor into exactly ``seq_lens``. Split outputs are views that autograd forbids modifying in
    place, so they still hold ``x[offset_i : offset_i + n_i]``. The input is rebuilt from the view
    root (``_base``, contiguous, same dtype) only if the input's gradient reaches that root through
    view nodes alone: a leaf made from a view (``root[:].requires_grad_()`` under ``no_grad``) keeps its
    own gradient, and gets ``cat``."""
    first = seqs[0]
    node, root = first.grad_fn, first._base
    if type(node).__name__ != "SplitWithSizesBackward0" or root is None:
        return None
    sizes = getattr(node, "_saved_split_sizes", None)
    input_shape = getattr(node, "_saved_self_sym_sizes", None)
    if sizes != seq_lens or len(seqs) != len(sizes) or input_shape is None or len(input_shape) != 1:
        return None
    if not all(map(operator.is_, map(_GRAD_FN, seqs), itertools.repeat(node))):
        return None
    if list(map(_OUTPUT_NR, seqs)) != list(range(len(seqs))):
        return None
    if first.stride() != (1,) or root.dtype != first.dtype or not root.is_contiguous():
        return None
    if not _reaches(node, root):
        return None
    start, total = first.storage_offset() - root.storage_offset(), int(input_shape[0])
    if start < 0 or start + total > root.numel():
        return None
    flat = root if root.dim() == 1 else root.view(-1)  # contiguous (checked above)
    if start == 0 and total == flat.numel():  # the whole row: no slice, whose backward zero-fills a copy
        return flat
    return flat.narrow(0, start, total)


def _reaches(node: object, root: Tensor) -> bool:
    """Whether the gradient of ``node``'s input flows into ``root``'s graph: following first edges,
    the walk meets ``root``'s own node (or its ``AccumulateGrad``, for a leaf) within a few steps."""
    target = root.grad_fn
    for _ in range(_VIEW_CHAIN_DEPTH):
        node = node.next_functions[0][0] if node.next_functions else None
        if node is None:
            return False
        if target is not None and node is target:
            return True
        if target is None and type(node).__name__ == "AccumulateGrad":
            return node.variable is root
    return False


def _packed_trainer(seqs: list[Tensor] | tuple[Tensor, ...]) -> tuple[Tensor, tuple[int, ...]]:
    """``trainer_logprobs`` as one ``[N]`` tensor, and the sequence lengths: those of the split that
    made the list when it is one (:func:`_split_input`; nothing to scan), else one C-level ``numel`` per
    element (the shapes are then checked by :func:`_concatenate`)."""
    sizes = getattr(getattr(seqs[0], "grad_fn", None), "_saved_split_sizes", None)
    whole = None if sizes is None else _split_input(seqs, tuple(sizes))
    if whole is not None:
        return whole, tuple(sizes)
    try:
        seq_lens = tuple(map(Tensor.numel, seqs))
    except TypeError:
        i, t = next((i, t) for i, t in enumerate(seqs) if not isinstance(t, Tensor))
        raise TypeError(f"trainer_logprobs[{i}] must be a torch.Tensor, got {type(t).__name__}") from None
    return _concatenate("trainer_logprobs", seqs, seq_lens), seq_lens


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

    ``loss = Σ rl / rl_scale + Σ ce / ce_scale + Σ ref_kl / ref_kl_scale``; metrics are 1-element
    token-weighted tensors (see the module docstring).
    """
    if not isinstance(trainer_logprobs, list | tuple) or not trainer_logprobs:
        raise ValueError("trainer_logprobs must be a non-empty list of per-sequence tensors")
    if not callable(rl_loss_fn):
        raise TypeError(f"rl_loss_fn must be callable, got {type(rl_loss_fn).__name__}")
    trainer, seq_lens = _packed_trainer(trainer_logprobs)
    streams = {"trainer_logprobs": trainer} | {
        name: _cat(name, seqs, seq_lens)
        for name, seqs in dict(
            inference_logprobs=inference_logprobs,
            ref_logprobs=ref_logprobs,
            advantages=advantages,
            loss_mask=loss_mask,
            rl_weights=rl_weights,
            ce_weights=ce_weights,
            ref_kl_weights=ref_kl_weights,
        ).items()
    }
    return _packed_loss(streams, seq_lens, rl_loss_fn, rl_scale, ce_scale, ref_kl_scale)


def _packed_loss(
    streams: dict[str, Tensor | None],
    seq_lens: tuple[int, ...],
    rl_loss_fn: LossFn,
    rl_scale: int,
    ce_scale: int,
    ref_kl_scale: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`compute_loss` once its lists are read: ``streams`` maps each of its list arguments'
    names to the packed ``[N]`` tensor (or None), ``seq_lens`` the sequence lengths. The benchmark
    calls it to time what reading the lists costs on its own."""
    for name in ("inference_logprobs", "advantages", "loss_mask"):
        if streams[name] is None:
            raise ValueError(f"{name} is required (a list of per-sequence tensors), got None")
    if streams["ref_kl_weights"] is not None and streams["ref_logprobs"] is None:
        raise ValueError("ref_kl_weights is given but ref_logprobs is None: the ref_kl component needs them")
    components = {
        "rl": Component(_LossFnComponent(rl_loss_fn), streams["loss_mask"], streams["rl_weights"], "constant", rl_scale)
    }
    if streams["ce_weights"] is not None:
        components["ce"] = Component(_LossFnComponent(ce_loss_fn), None, streams["ce_weights"], "constant", ce_scale)
    if streams["ref_kl_weights"] is not None:
        components["ref_kl"] = Component(
            _LossFnComponent(ref_kl_loss_fn), None, streams["ref_kl_weights"], "constant", ref_kl_scale
        )
    plan = Plan(
        seq_lens=seq_lens,
        components=components,
        inference_logprobs=streams["inference_logprobs"],
        ref_logprobs=streams["ref_logprobs"],
        advantages=streams["advantages"],
    )
    result = _engine_compute_loss(plan, Outputs(logprobs=streams["trainer_logprobs"]))
    metrics: dict[str, Tensor] = {}
    for key, value in result.metrics.items():
        _, _, name = key.partition("/")
        if name in metrics:
            raise ValueError(f"metric {name!r} is produced by two components")
        metrics[name] = value.reshape(1)
    return result.loss, metrics


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
