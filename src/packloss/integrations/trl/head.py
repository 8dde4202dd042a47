"""packloss's fused head inside a TRL 1.16 model: :func:`install_head` patches a causal LM's forward so that
``model(..., packloss_head=HeadCall(...))`` runs the backbone and
:func:`~packloss.vocab.head.linear_logprobs` on the output layer's weight at the completion positions only,
so the ``N × V`` logits never exist. Any other call goes to the forward it replaced (TRL's fused head,
generation). Conventions, what is refused and why: ``docs/integrations/trl.md``, "The head"."""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from trl.trainer.utils import FusedCausalLMOutput

from packloss.core import checks
from packloss.vocab.head import linear_logprobs

__all__ = ["HeadCall", "HeadSpec", "head_spec", "install_head", "head_forward", "IGNORE_INDEX"]

IGNORE_INDEX = -100
"""TRL's label of a position without a next token to score (prompt, padding)."""

# Config fields that scale the raw logits before any softcap, in the order they are looked for, and
# whether the model divides by the value (True) or multiplies by it: Cohere's ``logit_scale``, Muse
# Glimmer's ``output_multiplier``, Falcon-H1's ``lm_head_multiplier``, Granite's / MiniCPM3's
# ``logits_scaling`` (HyperCLOVA X multiplies by it). TRL 1.16's fused head reads the same fields.
_LOGIT_SCALES = (("logit_scale", False), ("output_multiplier", False), ("lm_head_multiplier", False),
                 ("logits_scaling", True))  # fmt: skip
_MULTIPLIES_LOGITS_SCALING = ("hyperclovax",)


@dataclass(frozen=True)
class HeadSpec:
    """What a model's config says its output layer computes: ``l = c·tanh(s·z / c)`` (``l = s·z`` without
    softcap) from the raw logits ``z = h Wᵀ``, with ``s`` the ``logit_scale`` and ``c`` the ``softcap``
    (``final_logit_softcapping``)."""

    softcap: float | None
    logit_scale: float


@dataclass(frozen=True)
class HeadCall:
    """One log-prob call of the trainer: score the last ``keep`` positions (TRL's ``logits_to_keep``, the
    completion) under ``softmax(l / temperature)``; compute the entropy when ``entropy``, differentiable
    when ``entropy_grad`` (the entropy bonus)."""

    keep: int
    temperature: float
    entropy: bool
    entropy_grad: bool

    def __post_init__(self) -> None:
        checks.integer("HeadCall.keep", self.keep, minimum=1)
        checks.positive("HeadCall.temperature", self.temperature)
        checks.flag("HeadCall.entropy", self.entropy)
        checks.flag("HeadCall.entropy_grad", self.entropy_grad)
        if self.entropy_grad and not self.entropy:
            raise ValueError("HeadCall.entropy_grad=True needs entropy=True")


def _text_config(model: torch.nn.Module) -> Any:
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def head_spec(model: torch.nn.Module) -> HeadSpec:
    """The softcap and logit scale of ``model``'s config (its text config for a vision-language model)."""
    config = _text_config(model)
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = 1.0
    for field, divides in _LOGIT_SCALES:
        value = getattr(config, field, None)
        if value is not None:
            inverted = divides and getattr(config, "model_type", None) not in _MULTIPLIES_LOGITS_SCALING
            scale = 1.0 / value if inverted else float(value)
            break
    return HeadSpec(softcap=None if softcap is None else float(softcap), logit_scale=scale)


def _check_model(model: torch.nn.Module) -> None:
    """Raise unless ``model`` is a causal LM whose output layer packloss's head computes exactly."""
    name = type(model).__name__
    hint = "; pass packloss_head=False to keep TRL's head"
    backbone = getattr(model, "base_model", None)
    if not isinstance(backbone, torch.nn.Module) or backbone is model:
        raise TypeError(f"packloss_head needs a causal LM with a backbone (`base_model`), got {name}{hint}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        kind = type(head).__name__
        raise TypeError(f"packloss_head needs a torch.nn.Linear output layer; {name}'s is {kind}{hint}")
    if head.bias is not None:
        raise ValueError(f"packloss_head computes bias-free output layers only; {name}'s lm_head has a bias{hint}")
    if is_deepspeed_zero3_enabled():  # the backward recomputes from a weight ZeRO-3 has partitioned again
        raise NotImplementedError(f"packloss_head does not support DeepSpeed ZeRO-3{hint}")


def install_head(model: torch.nn.Module) -> HeadSpec:
    """Patch ``model.forward`` (the instance's, as TRL's own fused head does) so that a call with
    ``packloss_head=HeadCall(...)`` returns :func:`head_forward`'s output; every other call goes to the
    forward it replaced. Checks the model first (``TypeError`` / ``ValueError`` saying why and naming
    ``packloss_head=False``); idempotent. Returns the model's :class:`HeadSpec`."""
    _check_model(model)
    installed = getattr(model, "_packloss_head_spec", None)
    if installed is not None:
        return installed
    spec = head_spec(model)
    previous = model.forward

    # the class's signature, as TRL keeps it: ``generate`` validates its keyword arguments against it
    @functools.wraps(type(model).forward)
    def forward(self: torch.nn.Module, *args: Any, packloss_head: HeadCall | None = None, **kwargs: Any) -> Any:
        if packloss_head is None:
            return previous(*args, **kwargs)
        return head_forward(self, spec, packloss_head, *args, **kwargs)

    model.forward = types.MethodType(forward, model)
    model._packloss_head_spec = spec
    return spec


def head_forward(model: torch.nn.Module, spec: HeadSpec, call: HeadCall, *args: Any, **kwargs: Any) -> Any:
    """TRL's ``FusedCausalLMOutput`` of one call: ``log_probs [B, K]`` of the next tokens at the last
    ``K = call.keep`` positions with a label (0 where the label is ``-100``), ``entropy [B, K]`` (0 there
    too) when asked.

    ``kwargs`` are TRL's model inputs (``input_ids``, ``attention_mask``, multimodal tensors) with
    ``labels`` (``-100`` on prompt and padding) and ``fused_lm_head``; the backbone runs on all of them,
    the head only on the ``B × K`` completion positions, in float32 (float64 for a float64 model) with
    autocast off, whatever ``cast_lm_head_to_fp32``."""
    labels = kwargs.pop("labels")  # [B, L]
    kwargs.pop("fused_lm_head", None)
    kwargs["use_cache"] = False
    hidden = model.base_model(*args, **kwargs).last_hidden_state  # [B, L, H]
    head = model.get_output_embeddings()
    # position t predicts token t + 1: the last K positions that have a next token
    hidden = hidden[:, :-1][:, -call.keep :].to(head.weight.device)  # [B, K, H]
    labels = labels[:, 1:][:, -call.keep :].to(head.weight.device)  # [B, K]
    rows, keep, width = hidden.shape
    flat = hidden.reshape(rows * keep, width)  # [B·K, H]
    if spec.logit_scale != 1.0:  # s·z = (s·h) Wᵀ: the scale goes before the softcap
        flat = flat * spec.logit_scale
    weight = head.weight  # [V, H]
    with torch.autocast(flat.device.type, enabled=False):
        if isinstance(weight, DTensor):  # FSDP2: one full head for every token chunk
            weight = weight.full_tensor()
        logprobs, entropy = linear_logprobs(
            flat,
            weight,
            labels.reshape(rows * keep),
            temperature=call.temperature,
            return_entropy=call.entropy,
            entropy_grad=call.entropy_grad,
            softcap=spec.softcap,
            ignore_index=IGNORE_INDEX,
        )
    scored = labels != IGNORE_INDEX  # [B, K]
    entropy = None if entropy is None else torch.where(scored, entropy.view(rows, keep), 0.0)  # [B, K]
    return FusedCausalLMOutput(log_probs=logprobs.view(rows, keep), entropy=entropy, label_mask=scored)
