"""packloss.testing.context_parallel: every case of the harness gives the single-process loss,
gradient (after DDP's averaging) and metrics on every (dp, cp) layout and shard style. CI runs each
layout once (styles rotating); ``PACKLOSS_CP_FULL=1`` (``make test-cp``) runs every layout × style
with every trust region in every normalisation mode."""

from __future__ import annotations

import os

import pytest
import torch

from packloss import TRUST_REGIONS
from packloss.testing.context_parallel import LAYOUTS, STYLES, cases, make_bins, run_invariance, shard_of

FULL = os.environ.get("PACKLOSS_CP_FULL") == "1"
RUNS = (
    [(dp, cp, style) for dp, cp in LAYOUTS for style in STYLES]
    if FULL
    else [(dp, cp, STYLES[i % len(STYLES)]) for i, (dp, cp) in enumerate(LAYOUTS)]
)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("dp, cp, style", RUNS, ids=[f"dp{d}-cp{c}-{s}" for d, c, s in RUNS])
def test_every_case_equals_one_process(dp, cp, style):
    all_cases = cases(every_mode=FULL)
    for case, (single, ranks) in zip(all_cases, run_invariance(all_cases, dp, cp, style), strict=True):
        assert single["grad"].abs().max() > 0, case.name  # the step trains something
        for rank, r in enumerate(ranks):
            where = f"{case.name} on rank {rank}"
            assert _relative(r["grad"], single["grad"]) <= 1e-12, where
            assert abs(float(r["loss"] - single["loss"])) <= 1e-12 * max(1.0, abs(float(single["loss"]))), where
            assert set(r["metrics"]) == set(single["metrics"]), where
            for key, value in single["metrics"].items():
                assert torch.allclose(r["metrics"][key].double(), value.double(), rtol=1e-5, atol=1e-6), (where, key)
                assert float(r["counts"][key]) == float(single["counts"][key]), (where, key)


def test_the_cases_cover_every_objective_family():
    names = {c.name.split("/")[0] for c in cases()}
    assert set(TRUST_REGIONS) <= names
    families = {"sft", "entropy", "forward_kl", "jsd", "head_reverse_kl", "head_jsd", "ratio_weighted_kl"}
    assert families | {"kl_penalties", "ref_kl", "dppo"} <= names
    modes = {c.name.split("/")[1] for c in cases() if c.name.startswith("ppo_clip/")}
    assert modes == {"token", "token-weighted", "position", "sequence_mean", "sequence_sum", "constant", "group_mean"}
    assert len({c.name for c in cases(every_mode=True)}) == len(cases(every_mode=True))


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shards_partition_every_bin(style, cp):
    for i, b in enumerate(make_bins(num_bins=6, seed=3)):
        held = torch.cat([shard_of(b, style, c, cp, seed=i).positions for c in range(cp)])
        assert torch.equal(held.sort().values, torch.arange(b.num_tokens))


@pytest.mark.parametrize("style", STYLES)
def test_the_harness_bins_hold_the_edge_cases_at_cp4(style):
    """An empty shard, a sequence wholly on one rank and one spanning all four ranks."""
    empty = single = spanning = False
    for i, b in enumerate(make_bins()):
        ids = torch.repeat_interleave(torch.arange(len(b.seq_lens)), torch.tensor(b.seq_lens))
        shards = [shard_of(b, style, c, 4, seed=1000 * i) for c in range(4)]
        empty |= any(s.num_tokens == 0 for s in shards)
        held = [set(ids[s.positions].tolist()) for s in shards]
        ranks_per_seq = [{c for c in range(4) if q in held[c]} for q in range(len(b.seq_lens))]
        single |= any(len(r) == 1 for r in ranks_per_seq)
        spanning |= any(len(r) == 4 for r in ranks_per_seq)
    assert empty and single and spanning
