"""packloss.packing: first-fit-decreasing bins, rank sharding with empty bins, packed attention layout."""

from __future__ import annotations

import random

import pytest
import torch

from packloss.core.packing import block_causal_mask, pack_ffd, position_ids, shard_bins


def test_ffd_fits_budget_and_places_every_sequence_once():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 60))]
        budget = rng.randint(40, 120)
        bins = pack_ffd(lengths, budget)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= budget for b in bins)
        # FFD opens a new bin only when no open bin has room: any two bins together overflow.
        loads = sorted(sum(lengths[i] for i in b) for b in bins)
        assert len(loads) < 2 or loads[0] + loads[1] > budget


def test_ffd_known_example_and_determinism():
    assert pack_ffd([3, 7, 2, 5, 5], 10) == [[1, 0], [3, 4], [2]]
    assert pack_ffd([4, 4, 4], 4) == [[0], [1], [2]]
    assert pack_ffd([], 8) == []


@pytest.mark.parametrize("lengths,budget", [([5, 11], 10), ([0], 4), ([2], 0)])
def test_ffd_rejects_bad_input(lengths, budget):
    with pytest.raises(ValueError):
        pack_ffd(lengths, budget)


def test_shard_bins_equal_counts_with_empty_bins():
    assert shard_bins(5, 2) == [[0, 2, 4], [1, 3, None]]
    assert shard_bins(4, 2) == [[0, 2], [1, 3]]
    assert shard_bins(1, 3) == [[0], [None], [None]]
    assert shard_bins(0, 2) == [[None], [None]]
    for n in range(12):
        for w in range(1, 5):
            shards = shard_bins(n, w)
            assert len({len(s) for s in shards}) == 1
            assert sorted(b for s in shards for b in s if b is not None) == list(range(n))


def test_position_ids_and_block_causal_mask():
    assert position_ids([2, 3, 1]).tolist() == [0, 1, 0, 1, 2, 0]
    mask = block_causal_mask([2, 3, 1])
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for start, n in ((0, 2), (2, 3), (5, 1)):
        expected[start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(mask, expected)
