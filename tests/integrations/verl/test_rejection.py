"""``rejection_mask``: verl's decoupled rejection sampling on a packed bin, equal to verl's own mask,
sync-free, flat in the sequences and NaN-safe."""

from __future__ import annotations

import pytest
import torch
from verl.trainer.ppo.rollout_corr_helper import (
    compute_rollout_rejection_mask,
)

from packloss import (
    Layout,
)
from packloss.integrations.verl import rejection_mask
from packloss.testing import OpCounter
from tests.integrations.verl.harness import RS_ALL, make_batch


@pytest.mark.parametrize("rs, threshold", [*RS_ALL.items(), ("seq_sum_k1", 1.5)])
def test_rejection_mask_matches_verl(rs, threshold):
    """``rejection_mask`` on the packed bin is verl's ``compute_rollout_rejection_mask`` on the padded one."""
    b = make_batch(21, rows=16, width=20, empty=(4, 9))
    rc = {"rollout_rs": rs, "rollout_rs_threshold": threshold}
    mask = b.mask.to(torch.long)  # verl's response mask is the attention mask's int64 slice
    expected, _ = compute_rollout_rejection_mask(b.old - b.rollout, mask, rs, threshold)
    ours = rejection_mask(rc, b.packed(b.old), b.packed(b.rollout), b.packed(b.mask), b.resp_lens)
    assert torch.equal(ours, b.packed(expected.bool()))
    assert 0 < int(ours.sum()) < int(b.mask.sum())


def test_rejection_mask_sync_free_flat_and_nan_safe():
    counts = set()
    rc = {"rollout_rs": "token_k1,seq_sum_k2,seq_mean_k3,seq_max_k2", "rollout_rs_threshold": "0.5_2.0,0.1,0.02,0.05"}
    for num_seqs in (1, 16, 256):
        lens = [4] * num_seqs
        g = torch.Generator().manual_seed(num_seqs)
        old, inf = -torch.rand(4 * num_seqs, generator=g), -torch.rand(4 * num_seqs, generator=g)
        mask = torch.rand(4 * num_seqs, generator=g) > 0.2
        old[~mask], inf[~mask] = float("nan"), float("inf")  # non-members never enter
        layout = Layout.build(lens)  # built once per bin, with the plan
        with OpCounter() as counter:
            out = rejection_mask(rc, old, inf, mask, layout)
        assert counter.num_syncs == 0, counter.syncs
        counts.add(counter.total)
        clean = rejection_mask(rc, old.nan_to_num(0.0), inf.clamp(max=0.0), mask, lens)
        assert torch.equal(out, clean) and not bool((out & ~mask).any())
    assert len(counts) == 1, counts
