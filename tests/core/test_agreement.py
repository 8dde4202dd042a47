"""packloss.core.agreement: check_agreement over two gloo ranks passes equal descriptions and raises the
same ValueError on every rank when they differ."""

from __future__ import annotations

import zlib

import pytest

from packloss.core.agreement import check_agreement, raised_on_every_rank
from packloss.testing import run_gloo


def _worker(rank: int, world_size: int) -> tuple[str | None, str | None]:
    """``(error with equal descriptions, error with one description per rank)`` on this rank."""
    out = []
    for description in ("components rl:token", f"components rl:{['token', 'sequence_mean'][rank]}"):
        try:
            check_agreement(description, "step components or modes", "cpu")
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
    return tuple(out)


def test_ranks_pass_equal_descriptions_and_all_raise_on_different_ones():
    ranks = run_gloo(_worker, world_size=2, timeout=120)
    assert [equal for equal, _ in ranks] == [None, None]
    low, high = sorted(zlib.crc32(f"components rl:{m}".encode()) for m in ("token", "sequence_mean"))
    for rank, mode in zip(ranks, ("token", "sequence_mean"), strict=True):
        _, message = rank
        assert message == (
            f"step components or modes differ across ranks (fingerprints {low:#010x}..{high:#010x}); "
            f"this rank has components rl:{mode}"
        )


def test_raised_on_every_rank_reraises_unchanged_without_a_process_group():
    from_checks = ValueError("plans[0] has group id 5 >= num_groups=2")
    with pytest.raises(ValueError) as raised:
        with raised_on_every_rank("step components or modes"):
            raise from_checks
    assert raised.value is from_checks
