"""Recipes and presets: each preset is its components spelled out; validation names the argument."""

from __future__ import annotations

import pytest
import torch

from conftest import bin_of, with_old
from packloss import (
    SFT,
    Component,
    KLPenalty,
    Normalize,
    Outputs,
    PolicyGradient,
    Recipe,
    ValueLoss,
    compute_loss,
    preset,
)
from packloss.core.bin import Plan
from packloss.core.trust_regions import PPOClip

SPELLED = {
    ("grpo", ()): Component(PolicyGradient(PPOClip(0.2, 0.2)), normalize="sequence_mean"),
    ("grpo", (("beta", 0.04),)): Component(
        PolicyGradient(PPOClip(), penalties=(KLPenalty(0.04, "k3", "ref"),)), normalize="sequence_mean"
    ),
    ("dapo", ()): Component(PolicyGradient(PPOClip(0.2, 0.28)), normalize="token"),
    ("dr_grpo", (("max_tokens", 4096.0),)): Component(PolicyGradient(PPOClip()), normalize="constant", constant=4096.0),
    ("bnpo", ()): Component(PolicyGradient(PPOClip()), normalize="token"),
}


@pytest.mark.parametrize("key", sorted(SPELLED), ids=lambda k: k[0] + "".join(f"-{n}" for n, _ in k[1]))
def test_preset_equals_its_components_spelled_out(key):
    name, options = key
    recipe = preset(name, **dict(options))
    want = SPELLED[key]
    assert list(recipe.components) == ["pg"]
    got = recipe.components["pg"]
    assert (got.loss, got.normalize, got.constant) == (want.loss, Normalize(want.normalize), want.constant)
    streams = with_old(bin_of("hot", seed=1)).replace(ref_logprobs=bin_of("sdft", seed=1).ref_logprobs)
    plan = Plan(
        streams.seq_lens,
        recipe.for_bin(streams.loss_mask),
        streams.inference_logprobs,
        streams.ref_logprobs,
        streams.advantages,
        old_logprobs=streams.old_logprobs,
    )
    spelled = Plan(
        streams.seq_lens,
        {"pg": Component(want.loss, streams.loss_mask, None, want.normalize, want.constant)},
        streams.inference_logprobs,
        streams.ref_logprobs,
        streams.advantages,
        old_logprobs=streams.old_logprobs,
    )
    assert torch.equal(compute_loss(plan, streams.outputs()).loss, compute_loss(spelled, streams.outputs()).loss)


def test_recipe_components_share_the_mask():
    recipe = Recipe({"pg": Component(PolicyGradient()), "sft": Component(SFT(), normalize="sequence_mean")})
    mask = torch.tensor([True, False, True])
    comps = recipe.for_bin(mask)
    assert set(comps) == {"pg", "sft"} and all(c.mask is mask for c in comps.values())
    assert comps["sft"].normalize is Normalize.SEQUENCE_MEAN


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: preset("reinforce"), ValueError, "name must be one of"),
        (lambda: Recipe({}), ValueError, "Recipe.components is empty"),
        (lambda: Recipe({"pg": PolicyGradient()}), TypeError, r"Recipe.components\['pg'\] must be a Component"),
        (lambda: Recipe({"pg": Component(SFT(), mask=torch.ones(2, dtype=torch.bool))}), ValueError, "template"),
        (lambda: Component("dppo"), TypeError, "loss must be a callable"),
        (lambda: Component(SFT(), normalize="mean"), ValueError, "normalize must be one of"),
        (lambda: preset("dr_grpo"), TypeError, "max_tokens"),
    ],
)
def test_validation(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_ppo_preset_is_the_policy_and_the_clipped_critic():
    recipe = preset("ppo", value_clip=0.3)
    assert list(recipe.components) == ["pg", "critic"]
    pg, critic = recipe.components["pg"], recipe.components["critic"]
    assert (pg.loss, pg.normalize) == (PolicyGradient(PPOClip(0.2, 0.2)), Normalize.TOKEN)
    assert (critic.loss, critic.normalize) == (ValueLoss(clip=0.3), Normalize.TOKEN)
    streams = with_old(bin_of("hot", seed=2))
    g = torch.Generator().manual_seed(0)
    n = streams.num_tokens
    returns, old_values = (
        torch.randn(n, generator=g, dtype=torch.float64),
        torch.randn(n, generator=g, dtype=torch.float64),
    )
    values = (old_values + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_()
    common = dict(
        advantages=streams.advantages, old_logprobs=streams.old_logprobs, returns=returns, old_values=old_values
    )
    plan = Plan(streams.seq_lens, recipe.for_bin(streams.loss_mask), **common)
    outputs = Outputs(logprobs=streams.trainer_logprobs, values=values)
    m = streams.loss_mask
    v, o, r = values[m], old_values[m], returns[m]
    clipped = torch.minimum(torch.maximum(v, o - 0.3), o + 0.3)
    critic_ref = (0.5 * torch.maximum((v - r) ** 2, (clipped - r) ** 2)).mean()
    result = compute_loss(plan, outputs)
    torch.testing.assert_close(result.terms["critic"], critic_ref, rtol=1e-12, atol=0)
