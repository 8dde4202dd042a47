"""merge_metrics and all_reduce_metrics: token-weighted means, min/max merges, ranks."""

from __future__ import annotations

import torch

from packloss import all_reduce_metrics, merge_metrics
from packloss.testing import run_gloo


def parts():
    a = ({"x": torch.tensor(1.0), "r_min": torch.tensor(0.5), "r_max": torch.tensor(2.0)},
         {"x": torch.tensor(3.0), "r_min": torch.tensor(2.0), "r_max": torch.tensor(2.0)})  # fmt: skip
    b = ({"x": torch.tensor(5.0), "r_min": torch.tensor(0.2), "r_max": torch.tensor(9.0)},
         {"x": torch.tensor(1.0), "r_min": torch.tensor(0.0), "r_max": torch.tensor(0.0)})  # fmt: skip
    c = ({"x": torch.tensor(0.0), "r_min": torch.tensor(0.7), "r_max": torch.tensor(3.0)},
         {"x": torch.tensor(0.0), "r_min": torch.tensor(1.0), "r_max": torch.tensor(1.0)})  # fmt: skip
    return [a, b, c]


def test_merge_is_token_weighted_and_min_max_skip_empty_parts():
    merged, counts = merge_metrics(parts())
    assert merged["x"].item() == (1 * 3 + 5 * 1) / 4
    assert counts["x"].item() == 4
    # b's r_min (0.2) and r_max (9.0) have count 0: they must not win
    assert merged["r_min"].item() == 0.5 and merged["r_max"].item() == 3.0
    assert counts["r_min"].item() == 3


def test_merge_of_nothing_but_empty_parts_is_zero():
    empty = ({"y_min": torch.tensor(4.0)}, {"y_min": torch.tensor(0.0)})
    merged, counts = merge_metrics([empty, empty])
    assert merged["y_min"].item() == 0.0 and counts["y_min"].item() == 0.0


def _rank(rank, world_size):
    metrics, counts = parts()[rank]
    return all_reduce_metrics(metrics, counts)


def test_all_reduce_equals_merge():
    ranks = run_gloo(_rank, world_size=2, timeout=120)
    merged, counts = merge_metrics(parts()[:2])
    for metrics, rank_counts in ranks:
        for key in merged:
            assert torch.allclose(metrics[key], merged[key]), key
            assert rank_counts[key] == counts[key], key
