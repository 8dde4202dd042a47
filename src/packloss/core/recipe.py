"""Recipes: what a named algorithm (GRPO, DAPO, Dr. GRPO, BNPO, ...) or a peer's config means, as the
components of a plan: for each component its loss, normalisation mode and constant.

A :class:`Recipe` is built once (from :data:`PRESETS`, ``packloss.integrations.trl.from_trl`` or
``packloss.integrations.verl.from_verl``) and turned into each bin's components with
:meth:`Recipe.components`::

    recipe = preset("dapo")
    plan = Plan(seq_lens, recipe.components(mask), inference_logprobs=inf, advantages=adv)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import Tensor

from packloss.core.components import ComponentLoss
from packloss.core.normalize import Normalize, as_normalize
from packloss.core.pg import KLPenalty, PolicyGradient
from packloss.core.plan import Component
from packloss.core.trust_regions import PPOClip

__all__ = ["Part", "Recipe", "PRESETS", "preset"]


@dataclass(frozen=True)
class Part:
    """One component of a recipe: its loss, mode and (``normalize="constant"``) constant."""

    loss: ComponentLoss
    normalize: Normalize | str = Normalize.TOKEN
    constant: float | None = None

    def __post_init__(self) -> None:
        if not callable(self.loss):
            raise TypeError(f"Part.loss must be callable, got {type(self.loss).__name__}")
        object.__setattr__(self, "normalize", as_normalize(self.normalize, "Part.normalize"))


@dataclass(frozen=True)
class Recipe:
    """Named parts (``{"pg": Part(...), "entropy": Part(...)}``) sharing one member mask per bin.

    ``notes`` records where the recipe's meaning differs from its source (shown in the docs)."""

    parts: Mapping[str, Part]
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("Recipe.parts is empty: a recipe needs at least one part")
        for name, part in self.parts.items():
            if not isinstance(part, Part):
                raise TypeError(f"Recipe.parts[{name!r}] must be a Part, got {type(part).__name__}")

    def components(self, mask: Tensor | None = None, weights: Tensor | None = None) -> dict[str, Component]:
        """``{name: Component}`` for one bin, every part on ``mask`` (``[N]`` bool) and ``weights``."""
        parts = self.parts.items()
        return {name: Component(part.loss, mask, weights, part.normalize, part.constant) for name, part in parts}

    @property
    def objective(self) -> ComponentLoss:
        """The first part's loss (the policy-gradient objective of a peer's config)."""
        return next(iter(self.parts.values())).loss


def _grpo(beta: float = 0.0, clip_low: float = 0.2, clip_high: float = 0.2) -> Recipe:
    """GRPO (Shao et al. 2024): PPO clip, optional k3 KL to the reference, mean over sequences of the
    per-sequence token mean."""
    penalties = (KLPenalty(beta, "k3", "ref"),) if beta else ()
    pg = PolicyGradient(PPOClip(clip_low, clip_high), penalties=penalties)
    return Recipe({"pg": Part(pg, Normalize.SEQUENCE_MEAN)})


def _dapo(clip_low: float = 0.2, clip_high: float = 0.28) -> Recipe:
    """DAPO (Yu et al. 2025): clip-higher, token-level mean over the step, no KL."""
    return Recipe({"pg": Part(PolicyGradient(PPOClip(clip_low, clip_high)), Normalize.TOKEN)})


def _dr_grpo(max_tokens: float, beta: float = 0.0, clip_low: float = 0.2, clip_high: float = 0.2) -> Recipe:
    """Dr. GRPO (Liu et al. 2025): the token sum divided by a constant (sequences × max completion
    length, host-known), so no length bias."""
    penalties = (KLPenalty(beta, "k3", "ref"),) if beta else ()
    pg = PolicyGradient(PPOClip(clip_low, clip_high), penalties=penalties)
    return Recipe({"pg": Part(pg, Normalize.CONSTANT, float(max_tokens))})


def _bnpo(beta: float = 0.0, clip_low: float = 0.2, clip_high: float = 0.2) -> Recipe:
    """BNPO (TRL's ``loss_type="bnpo"``): token mean over the batch it is computed on; with step
    denominators packloss takes it over the whole step, like DAPO (TRL's BNPO is per micro-batch)."""
    penalties = (KLPenalty(beta, "k3", "ref"),) if beta else ()
    pg = PolicyGradient(PPOClip(clip_low, clip_high), penalties=penalties)
    return Recipe({"pg": Part(pg, Normalize.TOKEN)})


PRESETS: dict[str, Callable[..., Recipe]] = {"grpo": _grpo, "dapo": _dapo, "dr_grpo": _dr_grpo, "bnpo": _bnpo}
"""Named algorithms: ``name → builder(**options) -> Recipe``."""


def preset(name: str, **options: float) -> Recipe:
    """The :class:`Recipe` of a named algorithm (:data:`PRESETS`) with its options."""
    if name not in PRESETS:
        raise ValueError(f"name must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name](**options)
