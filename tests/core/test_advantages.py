"""packloss.advantages: group-normalised advantages equal a per-group loop, without syncs."""

from __future__ import annotations

import pytest
import torch

from packloss.core.advantages import group_advantages
from packloss.testing import OpCounter


def _loop(rewards, group_ids, num_groups, scale_by_std, unbiased, eps):
    out = torch.zeros_like(rewards)
    for g in range(num_groups):
        idx = (group_ids == g).nonzero().flatten()
        if idx.numel() == 0:
            continue
        r = rewards[idx]
        centred = r - r.mean()
        if scale_by_std:
            std = r.std(unbiased=unbiased) if r.numel() > 1 else torch.tensor(0.0)
            centred = centred / (std + eps)
        out[idx] = centred
    return out


@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("unbiased", [True, False])
def test_matches_per_group_loop(scale_by_std, unbiased):
    g = torch.Generator().manual_seed(0)
    group_ids = torch.randint(0, 7, (53,), generator=g)
    group_ids[group_ids == 3] = 2  # group 3 is empty
    group_ids[0] = 6
    group_ids[group_ids == 6] = 5
    group_ids[0] = 6  # group 6 has one sample
    rewards = torch.rand(53, generator=g)
    got = group_advantages(rewards, group_ids, 7, scale_by_std=scale_by_std, unbiased=unbiased, eps=1e-6)
    want = _loop(rewards, group_ids, 7, scale_by_std, unbiased, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got[0] == 0


def test_constant_group_is_zero_and_grpo_has_unit_std():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5, 1.0, 0.25, 0.75])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    adv = group_advantages(rewards, group_ids, 2)
    assert torch.equal(adv[:3], torch.zeros(3))
    torch.testing.assert_close(adv[3:].std(), torch.tensor(1.0), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(adv[3:].mean(), torch.tensor(0.0), rtol=0, atol=1e-6)


def test_sync_free_and_integer_rewards():
    rewards = torch.tensor([1, 0, 1, 1])
    group_ids = torch.tensor([0, 0, 1, 1])
    with OpCounter() as counter:
        adv = group_advantages(rewards, group_ids, 2, scale_by_std=False)
    assert counter.num_syncs == 0
    assert adv.dtype == torch.float32
    assert adv.tolist() == [0.5, -0.5, 0.0, 0.0]


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        group_advantages(torch.rand(3), torch.zeros(4, dtype=torch.long), 1)
    with pytest.raises(TypeError):
        group_advantages(torch.rand(3), torch.zeros(3, dtype=torch.int32), 1)
    with pytest.raises(ValueError):
        group_advantages(torch.rand(3), torch.zeros(3, dtype=torch.long), 0)


@pytest.mark.parametrize("ids", [[0, 1, 5], [0, -1, 1]])
def test_check_ids_names_an_id_outside_the_groups(ids):
    rewards, group_ids = torch.tensor([1.0, 2.0, 3.0]), torch.tensor(ids)
    with pytest.raises(ValueError, match=r"group_ids must lie in \[0, num_groups=2\)"):
        group_advantages(rewards, group_ids, 2, check_ids=True)
    assert group_advantages(rewards, torch.tensor([0, 1, 1]), 2, check_ids=True).shape == (3,)
