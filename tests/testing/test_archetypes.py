"""packloss.testing.archetypes: random packings, the archetypes' streams and masks, and Streams' plan,
lists and scales."""

from __future__ import annotations

import pytest
import torch

from packloss import DPPO, REF_KL, SFT
from packloss.testing import ARCHETYPES, make_archetype, random_seq_lens

LENS = [7, 1, 12, 5, 9]


def test_all_archetypes_listed():
    assert set(ARCHETYPES) == {"hot", "weighted_grpo", "opd", "echo", "sdft", "all_empty", "dummy"}


@pytest.mark.parametrize("num_tokens, num_seqs", [(10, 1), (10, 2), (257, 9), (64, 64)])
def test_random_seq_lens_are_positive_with_a_one_and_sum_to_the_tokens(num_tokens, num_seqs):
    lens = random_seq_lens(num_tokens, num_seqs, torch.Generator().manual_seed(0))
    assert len(lens) == num_seqs and sum(lens) == num_tokens and min(lens) >= 1
    assert all(isinstance(k, int) for k in lens)
    assert num_seqs == 1 or 1 in lens
    again = random_seq_lens(num_tokens, num_seqs, torch.Generator().manual_seed(0))
    assert again == lens  # the generator decides


@pytest.mark.parametrize("num_tokens, num_seqs", [(3, 4), (5, 0)])
def test_random_seq_lens_refuses_impossible_packings(num_tokens, num_seqs):
    with pytest.raises(ValueError, match="need 1 <= num_seqs <= num_tokens"):
        random_seq_lens(num_tokens, num_seqs, torch.Generator())


@pytest.mark.parametrize("name", ARCHETYPES)
def test_archetype_streams_share_the_packing_and_mask_the_prompts(name):
    s = make_archetype(name, LENS, seed=4)
    n = sum(LENS)
    assert s.seq_lens == tuple(LENS) and (s.num_tokens, s.num_seqs) == (n, len(LENS))
    assert s.trainer_logprobs.is_leaf and s.trainer_logprobs.requires_grad
    for stream in (s.trainer_logprobs, s.inference_logprobs, s.advantages):
        assert stream.shape == (n,) and stream.dtype == torch.float32
    assert (s.trainer_logprobs.detach() <= 0).all() and (s.inference_logprobs <= 0).all()  # log-probabilities
    # one advantage per sequence
    for adv in torch.split(s.advantages, LENS):
        assert torch.equal(adv, adv[:1].expand_as(adv))
    # the first ⌊k / 3⌋ tokens of a sequence are its prompt: never in loss_mask
    for mask, k in zip(torch.split(s.loss_mask, LENS), LENS, strict=True):
        assert not mask[: k // 3].any()
    assert (s.ref_logprobs is not None) == (s.ref_kl_weights is not None)
    assert s.masks()["rl"].dtype == torch.bool and not (s.masks()["rl"] & ~s.loss_mask).any()


def test_each_archetype_switches_its_components_on():
    weighted = make_archetype("weighted_grpo", LENS, seed=1)
    assert set(weighted.rl_weights.unique().tolist()) <= {0.0, 0.5, 1.0, 2.0}
    assert not weighted.rl_weights[: LENS[0]].any()  # sequence 0 is all weight 0
    assert torch.equal(weighted.masks()["rl"], weighted.loss_mask & (weighted.rl_weights != 0))
    opd = make_archetype("opd", LENS, seed=1)
    assert not opd.masks()["rl"].any() and torch.equal(opd.masks()["ref_kl"], opd.loss_mask)
    echo = make_archetype("echo", LENS, seed=1)
    ce = echo.ce_weights != 0
    assert ce.any() and not (ce & echo.loss_mask).any() and (echo.ce_weights[ce] == torch.tensor(0.1)).all()
    sdft = make_archetype("sdft", LENS, seed=1)
    assert sdft.masks()["ref_kl"].any() and not (sdft.masks()["ref_kl"] & ~sdft.loss_mask).any()
    empty = make_archetype("all_empty", LENS, seed=1)
    assert not any(m.any() for m in empty.masks().values()) and set(empty.masks()) == {"rl", "ce", "ref_kl"}
    dummy = make_archetype("dummy", LENS, seed=1)
    assert not dummy.loss_mask.any() and set(dummy.masks()) == {"rl"} and dummy.ref_logprobs is None
    with pytest.raises(ValueError, match="unknown archetype 'grpo'"):
        make_archetype("grpo", LENS)


def test_plan_lists_and_scales():
    s = make_archetype("echo", LENS, seed=2, dtype=torch.float64)
    assert s.trainer_logprobs.dtype == torch.float64
    plan = s.plan()
    assert set(plan.components) == {"rl", "ce"}
    assert plan.components["rl"].loss == DPPO and plan.components["ce"].loss == SFT()
    assert torch.equal(plan.members["rl"], s.loss_mask) and torch.equal(plan.members["ce"], s.ce_weights != 0)
    sdft = make_archetype("sdft", LENS, seed=2).plan(normalize={"rl": "sequence_mean"})
    assert sdft.components["ref_kl"].loss == REF_KL and sdft.components["rl"].normalize.value == "sequence_mean"
    assert sdft.components["ref_kl"].normalize.value == "token"
    lists = s.lists()
    assert [len(t) for t in lists["trainer_logprobs"]] == LENS and lists["ref_logprobs"] is None
    assert lists["trainer_logprobs"][2]._base is s.trainer_logprobs  # views: one leaf for both implementations
    scales = s.integer_scales()
    assert scales == {"rl_scale": int(s.loss_mask.sum()), "ce_scale": int((s.ce_weights != 0).sum()), "ref_kl_scale": 1}
    assert make_archetype("dummy", LENS).integer_scales()["rl_scale"] == 1  # at least 1
