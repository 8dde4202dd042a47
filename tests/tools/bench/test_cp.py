"""The ``cp`` suite of ``packloss bench``: at its quick sizes, the rows and their structural facts
(bytes and collectives per rank: none for a token-level objective, one ``[S, 2]`` reduction and a
count for GSPO, one all-gather of the shard for gather-first); the gradient check runs inside."""

from __future__ import annotations

import pytest

from packloss.tools.bench import cp


@pytest.fixture(scope="module")
def quick():
    return cp.run("cpu", quick=True)


def test_rows(quick):
    rl = [r for r in quick["rows"] if r["comparison"] == "cp"]
    memory = [r for r in quick["rows"] if r["comparison"] == "cp memory"]
    assert [(r["cp"], r["shape"].split()[0]) for r in rl] == [
        (2, "ppo_clip/token"), (2, "gspo/sequence_mean"), (4, "ppo_clip/token"), (4, "gspo/sequence_mean"),
    ]  # fmt: skip
    assert [r["cp"] for r in memory] == [2, 4]
    for r in rl:
        assert r["partial_sums_ms"] > 0 and r["gather_first_ms"] > 0
        assert r["gather_first_bytes"] == 4 * -(-2048 // r["cp"])  # its float32 chunk of the row
    for r in memory:
        assert r["partial_sums_peak_MiB"] > 0 and r["gather_first_peak_MiB"] > 0


def test_collectives_per_micro_batch(quick):
    for r in quick["rows"]:
        if r["comparison"] != "cp":
            continue
        if r["shape"].startswith("ppo_clip/token"):
            assert (r["partial_sums_collectives"], r["partial_sums_bytes"]) == (0, 0)
        else:  # GSPO's sum [S] (float32); the counts came with the denominators
            assert r["partial_sums_collectives"] == 1 and r["partial_sums_bytes"] == 16 * 4


def test_refuses_a_gpu():
    with pytest.raises(ValueError, match="CPU gloo ranks only"):
        cp.run("cuda", quick=True)
