"""Recipes and presets: each preset is its parts spelled out; validation names the argument."""

from __future__ import annotations

import pytest
import torch

from conftest import bin_of, with_old
from packloss import SFT, KLPenalty, Normalize, Part, PolicyGradient, Recipe, compute_loss, preset
from packloss.core.plan import Plan
from packloss.core.trust_regions import PPOClip

SPELLED = {
    ("grpo", ()): Part(PolicyGradient(PPOClip(0.2, 0.2)), "sequence_mean"),
    ("grpo", (("beta", 0.04),)): Part(
        PolicyGradient(PPOClip(), penalties=(KLPenalty(0.04, "k3", "ref"),)), "sequence_mean"
    ),
    ("dapo", ()): Part(PolicyGradient(PPOClip(0.2, 0.28)), "token"),
    ("dr_grpo", (("max_tokens", 4096.0),)): Part(PolicyGradient(PPOClip()), "constant", 4096.0),
    ("bnpo", ()): Part(PolicyGradient(PPOClip()), "token"),
}


@pytest.mark.parametrize("key", sorted(SPELLED), ids=lambda k: k[0] + "".join(f"-{n}" for n, _ in k[1]))
def test_preset_equals_its_parts(key):
    name, options = key
    recipe = preset(name, **dict(options))
    want = SPELLED[key]
    assert list(recipe.parts) == ["pg"]
    got = recipe.parts["pg"]
    assert (got.loss, got.normalize, got.constant) == (want.loss, Normalize(want.normalize), want.constant)
    streams = with_old(bin_of("hot", seed=1)).replace(ref_logprobs=bin_of("sdft", seed=1).ref_logprobs)
    plan = Plan(
        streams.seq_lens,
        recipe.components(streams.loss_mask),
        streams.inference_logprobs,
        streams.ref_logprobs,
        streams.advantages,
        old_logprobs=streams.old_logprobs,
    )
    spelled = Plan(
        streams.seq_lens,
        {
            "pg": want.loss
            and __import__("packloss").Component(want.loss, streams.loss_mask, None, want.normalize, want.constant)
        },
        streams.inference_logprobs,
        streams.ref_logprobs,
        streams.advantages,
        old_logprobs=streams.old_logprobs,
    )
    assert torch.equal(compute_loss(plan, streams.outputs()).loss, compute_loss(spelled, streams.outputs()).loss)


def test_recipe_components_share_the_mask():
    recipe = Recipe({"pg": Part(PolicyGradient()), "sft": Part(SFT(), "sequence_mean")})
    mask = torch.tensor([True, False, True])
    comps = recipe.components(mask)
    assert set(comps) == {"pg", "sft"} and all(c.mask is mask for c in comps.values())
    assert comps["sft"].normalize is Normalize.SEQUENCE_MEAN


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: preset("ppo"), ValueError, "name must be one of"),
        (lambda: Recipe({}), ValueError, "Recipe.parts is empty"),
        (lambda: Recipe({"pg": PolicyGradient()}), TypeError, r"Recipe.parts\['pg'\] must be a Part"),
        (lambda: Part("dppo"), TypeError, "Part.loss must be callable"),
        (lambda: Part(SFT(), "mean"), ValueError, "Part.normalize must be one of"),
        (lambda: preset("dr_grpo"), TypeError, "max_tokens"),
    ],
)
def test_validation(build, error, match):
    with pytest.raises(error, match=match):
        build()
