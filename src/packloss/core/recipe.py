"""Recipes: what a named algorithm (GRPO, DAPO, Dr. GRPO, BNPO) or a peer's config means, as template
:class:`~packloss.Component` s (loss, normalisation, constant; no members yet). A recipe is built once
(:func:`preset`, ``from_trl``, ``from_verl``) and bound to each bin's members::

    recipe = preset("dapo")
    plan = Plan(seq_lens, recipe.for_bin(mask), rollout_logprobs=inf, advantages=adv)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from torch import Tensor

from packloss.core.bin import Component, Normalize
from packloss.core.kl import KLPenalty
from packloss.core.pg import PolicyGradient
from packloss.core.trust_regions import PPOClip
from packloss.core.value import ValueLoss

__all__ = ["POLICY", "Recipe", "PRESETS", "preset"]

POLICY = "pg"
"""The name of the policy-gradient component in recipes, adapters and the docs (metrics ``pg/...``)."""


@dataclass(frozen=True)
class Recipe:
    """Named template components (``{"pg": Component(...), "entropy": Component(...)}``) sharing one
    member mask per bin. ``notes`` records where the recipe differs from its source (in the docs)."""

    components: Mapping[str, Component]
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.components, Mapping) or not self.components:
            raise ValueError("Recipe.components is empty: a recipe needs at least one component")
        for name, comp in self.components.items():
            if not isinstance(comp, Component):
                raise TypeError(f"Recipe.components[{name!r}] must be a Component, got {type(comp).__name__}")
            if comp.mask is not None or comp.weights is not None:
                raise ValueError(f"Recipe.components[{name!r}] is a template: give its mask and weights per bin")

    def for_bin(self, mask: Tensor | None = None, weights: Tensor | None = None) -> dict[str, Component]:
        """``{name: Component}`` of one bin: every template on ``mask`` (``[N]`` bool) and ``weights``."""
        return {name: replace(comp, mask=mask, weights=weights) for name, comp in self.components.items()}

    @property
    def objective(self) -> Callable:
        """The first component's loss (the policy-gradient objective of a peer's config)."""
        return next(iter(self.components.values())).loss


def _pg(beta: float, clip_low: float, clip_high: float) -> PolicyGradient:
    penalties = (KLPenalty(beta, "k3", "ref"),) if beta else ()
    return PolicyGradient(PPOClip(clip_low, clip_high), penalties=penalties)


def _grpo(beta: float = 0.0, clip_low: float = 0.2, clip_high: float = 0.2) -> Recipe:
    """GRPO (Shao et al. 2024): PPO clip, optional k3 KL to the reference, mean over sequences of the
    per-sequence token mean."""
    return Recipe({POLICY: Component(_pg(beta, clip_low, clip_high), normalize=Normalize.SEQUENCE_MEAN)})


def _dapo(clip_low: float = 0.2, clip_high: float = 0.28) -> Recipe:
    """DAPO (Yu et al. 2025): clip-higher, token-level mean over the step, no KL."""
    return Recipe({POLICY: Component(_pg(0.0, clip_low, clip_high), normalize=Normalize.TOKEN)})


def _dr_grpo(max_tokens: float, beta: float = 0.0, clip_low: float = 0.2, clip_high: float = 0.2) -> Recipe:
    """Dr. GRPO (Liu et al. 2025): the token sum divided by a constant (sequences × max completion
    length, host-known), so no length bias."""
    pg = _pg(beta, clip_low, clip_high)
    return Recipe({POLICY: Component(pg, normalize=Normalize.CONSTANT, constant=float(max_tokens))})


def _bnpo(beta: float = 0.0, clip_low: float = 0.2, clip_high: float = 0.2) -> Recipe:
    """BNPO (TRL's ``loss_type="bnpo"``): token mean over the batch it is computed on; with step
    denominators packloss takes it over the whole step, like DAPO (TRL's BNPO is per micro-batch)."""
    return Recipe({POLICY: Component(_pg(beta, clip_low, clip_high), normalize=Normalize.TOKEN)})


def _ppo(clip_low: float = 0.2, clip_high: float = 0.2, value_clip: float = 0.5, beta: float = 0.0) -> Recipe:
    """PPO with a critic (verl's ``adv_estimator=gae``): PPO clip on the policy and the clipped value
    loss ``critic`` (``ValueLoss(clip=value_clip)``), both token means over the step."""
    return Recipe(
        {
            POLICY: Component(_pg(beta, clip_low, clip_high), normalize=Normalize.TOKEN),
            "critic": Component(ValueLoss(clip=value_clip), normalize=Normalize.TOKEN),
        }
    )


PRESETS: dict[str, Callable[..., Recipe]] = {
    "grpo": _grpo,
    "dapo": _dapo,
    "dr_grpo": _dr_grpo,
    "bnpo": _bnpo,
    "ppo": _ppo,
}
"""Named algorithms: ``name → builder(**options) -> Recipe``."""


def preset(name: str, **options: float) -> Recipe:
    """The :class:`Recipe` of a named algorithm (:data:`PRESETS`) with its options."""
    if name not in PRESETS:
        raise ValueError(f"name must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name](**options)
