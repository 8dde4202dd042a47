"""prime-rl's fused output head on packloss's: :class:`FusedOutputLinear` and its final-logit-softcapped
twin :class:`GemmaFusedOutputLinear` keep prime-rl's constructors, its ``forward(hidden_states, labels,
temperature)`` and its ``PrimeLmOutput`` return, and compute through
:func:`~packloss.vocab.head.linear_logprobs`: no device→host sync (prime-rl's Gemma head reads the
device in every block), the inputs upcast before the matmul, entropy available with a gradient. Both
are ``torch.nn.Linear(in_features, out_features, bias=False)``, so a plain head's ``state_dict`` loads.
The swap and what differs from prime-rl's code: ``docs/integrations/prime_rl.md``."""

from __future__ import annotations

from typing import TypedDict

import torch
from torch import Tensor

from packloss.core import checks
from packloss.vocab.core import check_positive_int
from packloss.vocab.head import linear_logprobs

__all__ = ["PrimeLmOutput", "FusedOutputLinear", "GemmaFusedOutputLinear"]


class PrimeLmOutput(TypedDict, total=False):
    """prime-rl's LM-head output, the same four optional keys: a plain ``dict`` at runtime, so pytree
    (FSDP2's hooks) finds its tensors. The fused heads set ``logprobs`` and ``entropy`` only, so
    ``out.get("logits")`` is None and prime-rl's trainer takes its fused branch."""

    logits: Tensor | None
    logprobs: Tensor | None
    entropy: Tensor | None
    loss: Tensor | None


def _check_forward(hidden_states: object, labels: object, temperature: object, weight: Tensor) -> tuple[int, int, int]:
    """``(B, S, H)`` once ``hidden_states [B, S, H]``, ``labels [B, S]`` (integer) and ``temperature [B, S]``
    (floating) agree with each other and with ``weight [V, H]``; shapes, dtypes and devices only."""
    if labels is None:
        raise TypeError("labels must be a [B, S] integer tensor, got None: the fused head returns their log-probs")
    if temperature is None:
        raise TypeError("temperature must be a [B, S] tensor of per-token temperatures, got None")
    checks.tensor("hidden_states", hidden_states, floating=True)
    if hidden_states.dim() != 3:
        raise ValueError(f"hidden_states must be 3-D [B, S, H], got shape {list(hidden_states.shape)}")
    b, s, h = hidden_states.shape
    if h != weight.shape[1]:
        raise ValueError(f"hidden_states has H = {h} features but the head's in_features is {weight.shape[1]}")
    checks.tensor("labels", labels, shape=(b, s))
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    checks.tensor("temperature", temperature, shape=(b, s), floating=True)
    checks.same_device("hidden_states", hidden_states.device, labels=labels, temperature=temperature, weight=weight)
    return b, s, h


class FusedOutputLinear(torch.nn.Linear):
    """prime-rl's ``FusedOutputLinear``: per-token log-probs and entropy of
    ``p = softmax(h Wᵀ / T)`` for ``hidden_states [B, S, H]``, ``labels [B, S]`` and per-token
    ``temperature [B, S]``, chunked over ``chunk_size`` tokens and ``vocab_chunk_size`` vocabulary rows::

        logprobs[b, s] = log p[b, s, labels[b, s]]      entropy[b, s] = −Σ_v p log p

    The ``[B·S, V]`` logits never exist. Outputs are float32 (float64 for float64 inputs). The entropy
    carries no gradient, as in prime-rl (its backward refuses one; its vanilla head computes the entropy
    under ``no_grad``): it is returned detached unless ``entropy_grad=True``, which makes it
    differentiable (``∂H/∂x_v = −p_v (log p_v + H)``, an entropy bonus through the fused head).

    Args:
        in_features, out_features: ``H`` and ``V``; the weight is ``[V, H]``, bias-free.
        chunk_size: tokens per chunk (prime-rl's ``fused_lm_head_token_chunk_size``), a positive int.
        vocab_chunk_size: vocabulary rows per block; None: packloss's device default (8192 on an
            accelerator, prime-rl's fixed width; 1024 on CPU).
        entropy_grad: make ``entropy`` differentiable.
        ignore_index: a label with this value gets log-prob 0 and no gradient (prime-rl has no ignored
            label: it gives any label outside ``[0, V)`` ``−logZ``, as packloss does for every other one).
    """

    softcap: float | None = None
    """Final-logit softcap ``c`` of :class:`GemmaFusedOutputLinear`; None here."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        chunk_size: int,
        *,
        vocab_chunk_size: int | None = None,
        entropy_grad: bool = False,
        ignore_index: int = -100,
    ) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        self.vocab_chunk_size = (
            None if vocab_chunk_size is None else check_positive_int("vocab_chunk_size", vocab_chunk_size)
        )
        self.entropy_grad = checks.flag("entropy_grad", entropy_grad)
        self.ignore_index = checks.integer("ignore_index", ignore_index)

    def forward(
        self, hidden_states: Tensor, labels: Tensor | None = None, temperature: Tensor | None = None
    ) -> PrimeLmOutput:
        """``PrimeLmOutput(logprobs=[B, S], entropy=[B, S])``; ``labels`` and ``temperature`` are required
        (None is a ``TypeError`` naming it, where prime-rl asserts)."""
        b, s, h = _check_forward(hidden_states, labels, temperature, self.weight)
        n = b * s
        logprobs, entropy = linear_logprobs(
            hidden_states.reshape(n, h),  # [N, H]
            self.weight,  # [V, H]
            labels.reshape(n),  # [N]
            temperature=temperature.reshape(n),  # [N]
            chunk_size=self.chunk_size,
            vocab_chunk_size=self.vocab_chunk_size,
            entropy_grad=self.entropy_grad,
            softcap=self.softcap,
            ignore_index=self.ignore_index,
        )
        return PrimeLmOutput(logprobs=logprobs.reshape(b, s), entropy=entropy.reshape(b, s))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}"


class GemmaFusedOutputLinear(FusedOutputLinear):
    """prime-rl's ``GemmaFusedOutputLinear``: :class:`FusedOutputLinear` over final-logit-softcapped
    logits, ``l = c·tanh(h Wᵀ / c)`` before the temperature, ``p = softmax(l / T)`` (the model config's
    ``final_logit_softcapping``). ``softcap`` must be a positive finite number."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        chunk_size: int,
        softcap: float,
        *,
        vocab_chunk_size: int | None = None,
        entropy_grad: bool = False,
        ignore_index: int = -100,
    ) -> None:
        super().__init__(
            in_features,
            out_features,
            chunk_size,
            vocab_chunk_size=vocab_chunk_size,
            entropy_grad=entropy_grad,
            ignore_index=ignore_index,
        )
        self.softcap = checks.positive("softcap", softcap)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, softcap={self.softcap}"
