"""packloss's fused head as verl 0.9.1's fused-kernel backend ``packloss``: with
``actor_rollout_ref.model.use_fused_kernels=True`` and ``fused_kernel_options.impl_backend=packloss`` every
``FusedLinearForPPO`` call site (the dense models' and the vision-language models' torch-backend forwards)
computes its log-probs and entropy with :func:`~packloss.vocab.head.linear_logprobs`, so the ``N × V``
logits never exist. :func:`install` (run by the plugin on ``import verl``) hooks the two places verl checks
and dispatches on the backend name, without editing verl's files. ``docs/integrations/verl.md``, "The head"."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from packloss.vocab.head import linear_logprobs

__all__ = ["BACKEND", "fused_linear_for_ppo", "install", "uninstall", "installed"]

logger = logging.getLogger(__name__)

BACKEND = "packloss"
"""The ``fused_kernel_options.impl_backend`` value (and ``FusedLinearForPPO(impl_backend=...)``) that selects
packloss's head."""

_TORCH = "torch"  # verl's backend whose model forward (the FusedLinearForPPO call sites) packloss reuses
_ORIGINAL = "_packloss_original"  # the attribute of a hook that holds the verl function it replaced


def _flat_temperature(temperature: float | Tensor, shape: torch.Size) -> float | Tensor:
    """A number as it is; a tensor broadcast to the labels' ``shape`` and flattened to ``[N]``."""
    if not isinstance(temperature, Tensor):
        return temperature
    try:
        return torch.broadcast_to(temperature, shape).reshape(-1)  # [N]
    except RuntimeError as e:
        raise ValueError(
            f"temperature must be a number or a tensor that broadcasts to input_ids' shape {tuple(shape)}, "
            f"got shape {tuple(temperature.shape)}"
        ) from e


def fused_linear_for_ppo(
    hidden_states: Tensor, vocab_weights: Tensor, input_ids: Tensor, temperature: float | Tensor = 1.0
) -> tuple[Tensor, Tensor]:
    """verl's ``FusedLinearForPPO.forward`` on packloss's fused head: ``log_probs = log softmax(h Wᵀ / T)[y]``
    and ``entropy = −Σ_v p_v log p_v`` with ``p = softmax(h Wᵀ / T)``, both differentiable (as verl's torch
    backend: ``∂H/∂x_v = −p_v (log p_v + H)``, so an entropy bonus trains the model).

    ``hidden_states`` ``[N, H]`` or ``[B, T, H]``, ``vocab_weights`` ``[V, H]``, ``input_ids`` the rolled
    labels ``[N]`` / ``[B, T]`` (``-100``: log-prob 0 and no gradient, as verl's liger backend), ``temperature``
    a positive number or a tensor broadcast to the labels' shape (no gradient). Returns ``(log_probs,
    entropy)`` in the labels' shape, as verl's torch backend: log-probs float32 (float64 for float64 inputs),
    the entropy in ``hidden_states``' dtype. Computed in float32 whatever the input dtype, block by block over
    the vocabulary (packloss's own block sizes; verl's ``chunk_size`` is not used)."""
    if not isinstance(hidden_states, Tensor) or hidden_states.dim() not in (2, 3):
        got = tuple(hidden_states.shape) if isinstance(hidden_states, Tensor) else type(hidden_states).__name__
        raise ValueError(f"hidden_states must be a [N, H] or [B, T, H] tensor, got {got}")
    if not isinstance(input_ids, Tensor) or input_ids.shape != hidden_states.shape[:-1]:
        got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        want = tuple(hidden_states.shape[:-1])
        raise ValueError(f"input_ids must have hidden_states' leading shape {want}, got {got}")
    shape = input_ids.shape
    log_probs, entropy = linear_logprobs(
        hidden_states.reshape(-1, hidden_states.shape[-1]),  # [N, H]
        vocab_weights,
        input_ids.reshape(-1),  # [N]
        temperature=_flat_temperature(temperature, shape),
        return_entropy=True,
        entropy_grad=True,
    )
    return log_probs.view(shape), entropy.to(hidden_states.dtype).view(shape)


# ----------------------------------------------------------------------------------------------
# the hooks on verl


def _init_hook(original: Callable[..., None]) -> Callable[..., None]:
    """``FusedLinearForPPO.__init__`` that also accepts ``impl_backend="packloss"`` (verl's own check, which
    accepts ``"torch"`` / ``"liger"`` and raises ``ValueError`` for anything else, runs on every other name)."""

    @functools.wraps(original)
    def __init__(self: Any, chunk_size: int = 512, impl_backend: str = _TORCH) -> None:
        ours = impl_backend == BACKEND
        original(self, chunk_size=chunk_size, impl_backend=_TORCH if ours else impl_backend)
        if ours:
            self.impl_backend = BACKEND

    setattr(__init__, _ORIGINAL, original)
    return __init__


def _forward_hook(original: Callable[..., tuple[Tensor, Tensor]]) -> Callable[..., tuple[Tensor, Tensor]]:
    """``FusedLinearForPPO.forward`` that sends ``impl_backend == "packloss"`` to :func:`fused_linear_for_ppo`."""

    @functools.wraps(original)
    def forward(
        self: Any, hidden_states: Tensor, vocab_weights: Tensor, input_ids: Tensor, temperature: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        if self.impl_backend == BACKEND:
            return fused_linear_for_ppo(hidden_states, vocab_weights, input_ids, temperature)
        return original(self, hidden_states, vocab_weights, input_ids, temperature)

    setattr(forward, _ORIGINAL, original)
    return forward


def _patch_hook(original: Callable[..., None]) -> Callable[..., None]:
    """``monkey_patch.patch_forward_with_backends`` that also takes ``fused_kernels_backend="packloss"``: verl's
    torch-backend forward (whose ``FusedLinearForPPO`` reads the model's ``_verl_fused_kernels_backend``), the
    model marked ``"packloss"``. Every other name, and ``use_fused_kernels=False``, goes to verl's own code
    (which skips an unknown name, as verl does)."""

    @functools.wraps(original)
    def patch_forward_with_backends(
        model: torch.nn.Module, use_fused_kernels: bool = False, fused_kernels_backend: str | None = None
    ) -> None:
        ours = bool(use_fused_kernels) and fused_kernels_backend == BACKEND
        backend = _TORCH if ours else fused_kernels_backend
        original(model, use_fused_kernels=use_fused_kernels, fused_kernels_backend=backend)
        if ours:
            model._verl_fused_kernels_backend = BACKEND
            logger.info("packloss: %s's FusedLinearForPPO runs on packloss's fused head", type(model).__name__)

    setattr(patch_forward_with_backends, _ORIGINAL, original)
    return patch_forward_with_backends


def _targets() -> tuple[tuple[Any, str, Callable[[Callable], Callable]], ...]:
    """``(owner, attribute, hook factory)`` for every place verl 0.9.1 checks or dispatches on the backend."""
    # verl imports the plugin (which calls install) while it is itself importing; the head's own math
    # needs no verl, so verl is reached only here
    from verl.models.transformers import monkey_patch
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    return (
        (FusedLinearForPPO, "__init__", _init_hook),
        (FusedLinearForPPO, "forward", _forward_hook),
        (monkey_patch, "patch_forward_with_backends", _patch_hook),
    )


def installed() -> bool:
    """Whether verl's functions are packloss's hooks (all of them)."""
    return all(hasattr(getattr(owner, name), _ORIGINAL) for owner, name, _ in _targets())


def install() -> None:
    """Hook verl so that ``"packloss"`` is a fused-kernel backend (idempotent; the plugin calls it on
    ``import verl``). Imports ``verl.utils.experimental.torch_functional`` and
    ``verl.models.transformers.monkey_patch``."""
    for owner, name, hook in _targets():
        held = getattr(owner, name)
        if not hasattr(held, _ORIGINAL):
            setattr(owner, name, hook(held))


def uninstall() -> None:
    """Give verl its own functions back (idempotent): ``"packloss"`` is then an unknown backend again."""
    for owner, name, _ in _targets():
        held = getattr(owner, name)
        if hasattr(held, _ORIGINAL):
            setattr(owner, name, getattr(held, _ORIGINAL))
