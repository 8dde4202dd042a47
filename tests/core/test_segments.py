"""Segment reductions equal per-sequence loops, without syncs."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packloss.core.layout import Layout
from packloss.core.segments import broadcast, segment_count, segment_max, segment_mean, segment_min, segment_sum
from packloss.testing import OpCounter


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 9), min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_segment_reductions_equal_loops(lens, seed):
    g = torch.Generator().manual_seed(seed)
    n, s = sum(lens), len(lens)
    seq_ids = Layout.build(lens).seq_ids
    x = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.6
    x_poisoned = torch.where(mask, x, torch.tensor(float("nan"), dtype=torch.float64))
    mean, count = segment_mean(x_poisoned, mask, seq_ids, s)
    sums = segment_sum(x, seq_ids, s)
    for i, (xs, ms) in enumerate(zip(torch.split(x, lens), torch.split(mask, lens), strict=True)):
        assert torch.allclose(sums[i], xs.sum())
        assert count[i] == ms.sum()
        assert torch.allclose(mean[i], xs[ms].sum() / max(int(ms.sum()), 1))
        if ms.any():
            assert segment_max(x_poisoned, mask, seq_ids, s)[i] == xs[ms].max()
            assert segment_min(x_poisoned, mask, seq_ids, s)[i] == xs[ms].min()
        else:
            assert segment_max(x, mask, seq_ids, s)[i] == float("-inf")
    assert torch.equal(segment_count(mask, seq_ids, s), count.float())
    assert torch.equal(broadcast(sums, seq_ids), torch.repeat_interleave(sums, torch.tensor(lens)))


def test_segment_ops_are_sync_free_and_differentiable():
    seq_ids = Layout.build([3, 1, 4]).seq_ids
    x = torch.randn(8, requires_grad=True)
    mask = torch.tensor([1, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    with OpCounter() as counter:
        total = segment_sum(x, seq_ids, 3)
        mean, _ = segment_mean(x, mask, seq_ids, 3)
        (broadcast(total, seq_ids).sum() + segment_max(x, mask, seq_ids, 3).sum()).backward()
    assert counter.num_syncs == 0, counter.syncs
    assert x.grad is not None and torch.isfinite(x.grad).all()
