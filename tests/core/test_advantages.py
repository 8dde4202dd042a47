"""packloss.core.advantages: group-normalised advantages equal a per-group loop, and packed GAE equals
the paper's per-sequence recursion and verl's own loop, without syncs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packloss.core.advantages import gae_advantages, group_advantages
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


# ---------------------------------------------------------------------------------------------------
# GAE over a packed bin
# ---------------------------------------------------------------------------------------------------


def _gae_loop(rewards, values, seq_lens, mask, gamma, lam):
    """The GAE paper's recursion, one sequence at a time, over its members only (plain floats)."""
    adv, ret = [0.0] * len(rewards), [0.0] * len(rewards)
    start = 0
    for n in seq_lens:
        next_value, next_adv = 0.0, 0.0
        for t in reversed(range(start, start + n)):
            if mask[t]:
                delta = rewards[t] + gamma * next_value - values[t]
                next_adv = delta + gamma * lam * next_adv
                next_value = values[t]
            adv[t] = next_adv
            ret[t] = next_adv + values[t]
        start += n
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def _gae_bin(seq_lens, seed, holes=0.2):
    g = torch.Generator().manual_seed(seed)
    n = sum(seq_lens)
    rewards = torch.randn(n, generator=g, dtype=torch.float64)
    values = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) > holes
    return rewards, values, mask


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 12), min_size=1, max_size=8), seed=st.integers(0, 2**31 - 1),
       gamma=st.sampled_from([1.0, 0.99, 0.5, 0.0]), lam=st.sampled_from([1.0, 0.95, 0.0]))  # fmt: skip
def test_gae_equals_the_per_sequence_recursion(lens, seed, gamma, lam):
    rewards, values, mask = _gae_bin(lens, seed)
    adv, ret = gae_advantages(rewards, values, lens, mask, gamma=gamma, lam=lam)
    want_adv, want_ret = _gae_loop(rewards.tolist(), values.tolist(), lens, mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, want_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, want_ret, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("whiten", [False, True])
def test_gae_equals_verls_on_padded_rows(whiten):
    """verl 0.9.1's own ``compute_gae_advantage_return`` (its loop over time steps; observation tokens
    inside a response, right padding) on ``[B, T]`` rows, each row one sequence of the bin. verl's
    whitening computes its Bessel factor ``n / (n − 1)`` from integer tensors, in float32: its variance is
    off by up to 6e-8 relative, so the whitened comparison is to 1e-7."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    rows, width = 6, 40
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(5, width + 1, (rows,), generator=g)
    mask = (torch.arange(width) < lens[:, None]) & (torch.rand(rows, width, generator=g) > 0.15)  # [B, T]
    rewards = torch.where(mask, torch.randn(rows, width, generator=g, dtype=torch.float64), 0.0)
    values = torch.randn(rows, width, generator=g, dtype=torch.float64)
    gamma, lam = 0.97, 0.9
    verl_adv, verl_ret = core_algos.compute_gae_advantage_return(rewards, values, mask.long(), gamma, lam)
    adv, ret = gae_advantages(rewards.flatten(), values.flatten(), [width] * rows, mask.flatten(), gamma=gamma,
                              lam=lam, whiten=whiten)  # fmt: skip
    torch.testing.assert_close(ret.view(rows, width), verl_ret, rtol=1e-12, atol=1e-12)
    if whiten:
        torch.testing.assert_close(adv.view(rows, width), verl_adv, rtol=1e-7, atol=1e-7)
    else:
        torch.testing.assert_close(adv.view(rows, width), verl_ret - values, rtol=1e-12, atol=1e-12)


def test_gae_is_packing_invariant_and_ignores_non_members():
    """Each sequence's advantages do not depend on what else the bin holds or on the order; rewards and
    values off the members (NaN, inf) change nothing anywhere."""
    lens = [7, 1, 13, 4]
    rewards, values, mask = _gae_bin(lens, 3)
    adv, ret = gae_advantages(rewards, values, lens, mask, gamma=0.9, lam=0.8)
    start = 0
    for n in lens:
        part = slice(start, start + n)
        alone = gae_advantages(rewards[part], values[part], [n], mask[part], gamma=0.9, lam=0.8)
        torch.testing.assert_close(alone[0], adv[part], rtol=0, atol=0)
        start += n
    poison = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float64).repeat(sum(lens))
    r2, v2 = torch.where(mask, rewards, poison[: sum(lens)]), torch.where(mask, values, poison.flip(0)[: sum(lens)])
    adv2, ret2 = gae_advantages(r2, v2, lens, mask, gamma=0.9, lam=0.8)
    assert torch.equal(adv2, adv) and torch.equal(ret2[mask], ret[mask])


def test_gae_is_stable_over_long_sequences():
    """4,096 tokens at γλ = 0.5: a closed form ``(γλ)^{−t} Σ`` overflows float32; the scan does not."""
    lens = [4096, 3]
    rewards, values, mask = _gae_bin(lens, 5, holes=0.0)
    rewards, values = rewards.float(), values.float()
    adv, _ = gae_advantages(rewards, values, lens, mask, gamma=1.0, lam=0.5)
    want, _ = _gae_loop(rewards.double().tolist(), values.double().tolist(), lens, mask.tolist(), 1.0, 0.5)
    assert adv.dtype == torch.float32 and torch.isfinite(adv).all()
    torch.testing.assert_close(adv.double(), want, rtol=1e-5, atol=1e-5)


def test_gae_is_sync_free_and_flat_in_the_number_of_sequences():
    counts = set()
    for num_seqs in (1, 16, 64):
        lens = [256 // num_seqs] * num_seqs
        rewards, values, mask = _gae_bin(lens, num_seqs)
        with OpCounter() as counter:
            gae_advantages(rewards, values, lens, mask, gamma=0.99, lam=0.95, whiten=True)
        assert counter.num_syncs == 0, counter.syncs
        counts.add(counter.total)
    assert len(counts) == 1, counts


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"gamma": 1.5}, ValueError, "gamma must lie in"),
    ({"lam": -0.1}, ValueError, "lam must lie in"),
    ({"mask": torch.ones(5)}, TypeError, "mask must be a bool"),
    ({"values": torch.zeros(4)}, ValueError, "share one"),
    ({"seq_lens": [2, 2]}, ValueError, "seq_lens sums to 4"),
    ({"rewards": torch.zeros(5, 1)}, ValueError, "rewards must be a"),
])  # fmt: skip
def test_gae_names_a_bad_argument(kwargs, error, match):
    args = {"rewards": torch.zeros(5), "values": torch.zeros(5), "seq_lens": [2, 3], "mask": torch.ones(5, dtype=bool)}
    args |= kwargs
    with pytest.raises(error, match=match):
        gae_advantages(args.pop("rewards"), args.pop("values"), args.pop("seq_lens"), args.pop("mask"), **args)
