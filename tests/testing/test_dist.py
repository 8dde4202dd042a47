"""packloss.testing.dist: run_gloo runs a function on two ranks of one gloo group and returns their results
in rank order; a rank's exception reaches the caller."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from packloss.testing import run_gloo


def _sum_of_ranks(rank: int, world_size: int, scale: float) -> tuple[int, int, torch.Tensor]:
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    return rank, world_size, x * scale


def _fails_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def test_results_come_back_in_rank_order_across_one_group():
    ranks = run_gloo(_sum_of_ranks, world_size=2, args=(0.5,), timeout=120)
    assert [(r, w) for r, w, _ in ranks] == [(0, 2), (1, 2)]
    assert all(torch.equal(x, torch.tensor([1.5])) for _, _, x in ranks)  # (1 + 2) · 0.5 on both


def test_a_failing_rank_raises_in_the_caller_with_its_traceback():
    with pytest.raises(RuntimeError, match="(?s)gloo rank 1 failed:.*ValueError: rank one refuses"):
        run_gloo(_fails_on_rank_one, world_size=2, timeout=120)
