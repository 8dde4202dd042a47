"""Hugging Face causal LMs (Llama, Qwen2, Mistral, …) through the fused head: :func:`causal_lm_logprobs`
runs the backbone and :func:`~packloss.vocab.head.linear_logprobs` on ``model.lm_head``'s weight (sharded or not);
:func:`patch_causal_lm` makes ``model(input_ids, labels=...)`` do the same (without ``labels`` the
original forward runs, so ``generate`` works). ``transformers`` is never imported. Conventions
(labels, ``-100``, temperature, tied embeddings, softcapping): ``docs/distill.md``."""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch

from packloss.vocab.core import check_positive_int
from packloss.vocab.sharded import sharded_linear_logprobs

__all__ = ["FusedCausalLMOutput", "causal_lm_logprobs", "next_token_labels", "patch_causal_lm"]


@dataclass
class FusedCausalLMOutput:
    """``logprobs [B, S]``, ``entropy [B, S] | None`` and the backbone's extra outputs (``cache`` is
    the transformers 5 key-value cache field)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    cache: object | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None

    def to_tuple(self) -> tuple:
        """The fields that are not None, in order (what ``return_dict=False`` returns)."""
        return tuple(
            v for v in (self.logprobs, self.entropy, self.cache, self.hidden_states, self.attentions) if v is not None
        )


def next_token_labels(input_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``labels[:, t] = input_ids[:, t + 1]``, and ``ignore_index`` at the last position. ``[B, S]``."""
    pad = torch.full_like(input_ids[:, :1], ignore_index)  # [B, 1]
    return torch.cat([input_ids[:, 1:], pad], dim=1)  # [B, S]


def _check_model(model: torch.nn.Module) -> None:
    backbone, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if not isinstance(backbone, torch.nn.Module):
        raise TypeError(f"model must have a `.model` backbone module, got {type(model).__name__}")
    if not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise TypeError(f"model.lm_head must have a `.weight` tensor, got {type(head).__name__}")
    if getattr(head, "bias", None) is not None:
        raise ValueError("model.lm_head has a bias; the fused head supports bias-free output layers only")


def _softcap(model: torch.nn.Module) -> float | None:
    return getattr(getattr(model, "config", None), "final_logit_softcapping", None)


def causal_lm_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = True,
    entropy_grad: bool = False,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    check_labels: bool = False,
    **model_kwargs,
) -> FusedCausalLMOutput:
    """Log-probs ``[B, S]`` of ``labels`` (aligned with positions) and entropy, via the fused head.

    ``model_kwargs`` (``attention_mask``, ``position_ids``, ``inputs_embeds``, …) go to ``model.model``;
    ``chunk_size`` (None: the chunk policy of :func:`~packloss.vocab.core.chunk_rows`) and
    ``vocab_chunk_size`` (None: the device's default) and ``check_labels`` (labels outside the vocabulary
    raise; one host read) to :func:`~packloss.vocab.head.linear_logprobs`.
    ``return_dict=False`` returns :meth:`FusedCausalLMOutput.to_tuple` instead, as transformers models do.
    """
    _check_model(model)
    return_dict = model_kwargs.pop("return_dict", None)
    if return_dict is not None and not isinstance(return_dict, bool):
        raise TypeError(f"return_dict must be a bool or None, got {type(return_dict).__name__}")
    out = model.model(input_ids=input_ids, **model_kwargs)
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state  # [B, S, H]
    b, s, h = hidden.shape
    if labels.shape != (b, s):
        raise ValueError(f"labels must have shape [B, S] = {(b, s)}, got {tuple(labels.shape)}")
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
        if temperature.shape != (b, s):
            shape = tuple(temperature.shape)
            raise ValueError(f"temperature must be a float or [B, S] = {(b, s)}, got {shape}")
        temperature = temperature.reshape(b * s)
    logprobs, entropy = sharded_linear_logprobs(
        hidden.reshape(b * s, h),
        model.lm_head,
        labels.reshape(b * s),
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        return_entropy=return_entropy,
        entropy_grad=entropy_grad,
        softcap=_softcap(model),
        ignore_index=ignore_index,
        check_labels=check_labels,
    )
    result = FusedCausalLMOutput(
        logprobs=logprobs.reshape(b, s),
        entropy=None if entropy is None else entropy.reshape(b, s),
        cache=getattr(out, "cache", None),
        hidden_states=getattr(out, "hidden_states", None),
        attentions=getattr(out, "attentions", None),
    )
    return result.to_tuple() if return_dict is False else result


def patch_causal_lm(
    model: torch.nn.Module, chunk_size: int | None = None, vocab_chunk_size: int | None = None
) -> torch.nn.Module:
    """Make ``model(input_ids, labels=..., **kwargs)`` return :func:`causal_lm_logprobs`'s
    :class:`FusedCausalLMOutput` (its keywords: ``temperature``, ``return_entropy``, …); returns ``model``.

    Without ``labels`` the original forward runs. Idempotent; the original forward is kept as
    ``model._packloss_original_forward``. ``chunk_size`` and ``vocab_chunk_size`` are validated here
    (``ValueError`` unless positive ints or None), not at the first call.
    """
    _check_model(model)
    if chunk_size is not None:
        check_positive_int("chunk_size", chunk_size)
    if vocab_chunk_size is not None:
        check_positive_int("vocab_chunk_size", vocab_chunk_size)
    if hasattr(model, "_packloss_original_forward"):
        return model
    original = model.forward
    fused = functools.partial(causal_lm_logprobs, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)

    def forward(self, input_ids=None, labels=None, **kwargs):
        if labels is None:
            return original(input_ids=input_ids, **kwargs)
        return fused(self, input_ids, labels, **kwargs)

    model._packloss_original_forward = original
    model.forward = types.MethodType(forward, model)
    return model
