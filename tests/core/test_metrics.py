"""merge_metrics and all_reduce_metrics: token-weighted means, min/max merges, ranks."""

from __future__ import annotations

import pytest
import torch

from packloss import all_reduce_metrics, merge_metrics
from packloss.core.layout import Layout
from packloss.core.metrics import metric_means
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


def _disagreeing_rank(rank, world_size, same_count):
    metrics = {"a": torch.tensor(1.0), "b": torch.tensor(2.0)}
    if rank == 1:
        metrics = {"a": torch.tensor(1.0), "c": torch.tensor(2.0)} if same_count else {"a": torch.tensor(1.0)}
    counts = {k: torch.tensor(3.0) for k in metrics}
    try:
        all_reduce_metrics(metrics, counts)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("same_count", [True, False], ids=["other-names", "fewer-names"])
def test_all_reduce_with_different_metric_names_raises_on_every_rank(same_count):
    messages = run_gloo(_disagreeing_rank, world_size=2, args=(same_count,), timeout=120)
    assert all("metric names differ across ranks" in m for m in messages), messages


def test_merge_and_all_reduce_reject_bad_arguments():
    result = parts()[0]
    with pytest.raises(TypeError, match="parts must be a list"):
        merge_metrics(result[0])
    with pytest.raises(TypeError, match=r"counts\['x'\] must be a tensor"):
        merge_metrics([({"x": torch.tensor(1.0)}, {"x": 3})])
    with pytest.raises(ValueError, match="counts has no entry for metric 'x'"):
        merge_metrics([({"x": torch.tensor(1.0)}, {})])
    with pytest.raises(ValueError, match="metrics is empty"):
        all_reduce_metrics({}, {})


def _one_rank_fails(rank, world_size, what):
    metrics = {"a": torch.tensor(1.0)}
    if rank == 1:
        metrics = {} if what == "empty" else {"a": torch.tensor([1.0, 2.0, 3.0])}  # per-sequence: [S]
    counts = {k: torch.tensor(3.0) if v.dim() == 0 else torch.ones(3) for k, v in metrics.items()}
    try:
        all_reduce_metrics(metrics, counts)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "what, says", [("empty", "metrics is empty"), ("per-sequence", "metric 'a' is per-sequence (shape (3,))")]
)
def test_a_rank_whose_metrics_fail_their_checks_makes_every_rank_raise(what, says):
    messages = run_gloo(_one_rank_fails, world_size=2, args=(what,), timeout=60)
    assert messages[0] == messages[1] and says in messages[0] and "rank 1: ValueError" in messages[0], messages


def test_per_sequence_metrics_are_refused():
    with pytest.raises(ValueError, match="per-sequence"):
        all_reduce_metrics({"a": torch.ones(3)}, {"a": torch.ones(3)})


@pytest.mark.parametrize("per_sequence", [False, True])
def test_metric_means_equal_plain_masked_means_bit_for_bit(per_sequence):
    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 9, 3, 7]
    n = sum(lens)
    layout = Layout.build(lens)
    m = torch.rand(n, generator=g) > 0.3
    keep = m & (torch.rand(n, generator=g) > 0.5)
    x = torch.randn(n, generator=g)
    x[~m] = float("nan")  # non-members never enter
    named = {"f": (x, keep), "a": (torch.rand(n, generator=g) > 0.5, m), "b": (torch.rand(n, generator=g) > 0.2, m),
             "c": (x, m), "d": (torch.rand(n, generator=g) > 0.9, m)}
    metrics, counts = metric_means(named, layout.segments, per_sequence)
    assert list(metrics) == list(named) == list(counts)
    for key, (values, mask) in named.items():  # the reference: a where and a sum (per sequence: a loop)
        v = torch.where(mask, values.double(), 0.0)
        if per_sequence:
            parts = torch.split(v, lens), torch.split(mask.double(), lens)
            total, count = torch.stack([p.sum() for p in parts[0]]), torch.stack([p.sum() for p in parts[1]])
        else:
            total, count = v.sum(), mask.double().sum()
        assert torch.equal(counts[key], count.float())
        assert torch.allclose(metrics[key].double(), total / count.clamp_min(1), rtol=1e-6, atol=0)
        if values.dtype == torch.bool:  # integer counts: exact
            assert torch.equal(metrics[key], (total.float() / count.float().clamp_min(1)))
