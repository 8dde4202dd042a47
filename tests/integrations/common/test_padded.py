"""packloss.integrations.common.padded: a padded [B, T] batch as one bin, every row a sequence ("rows":
every position; "members": each row's positions, a member-less row keeping its first), the plan and
outputs it packs, check_padded's errors and log_ratio_mean."""

from __future__ import annotations

import pytest
import torch

from packloss import SFT, Component, compute_loss
from packloss.integrations.common.padded import PACKINGS, PaddedBatch, check_padded, log_ratio_mean
from packloss.testing import OpCounter

MEMBERS = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 1]], dtype=torch.bool)  # row 1: no member
X = torch.arange(12.0).reshape(3, 4)


def test_rows_packing_keeps_every_position_and_reads_nothing():
    with OpCounter() as counter:
        batch = PaddedBatch.of(MEMBERS, "rows")
    assert counter.num_syncs == 0
    assert batch.seq_lens == (4, 4, 4) and batch.rows == 3
    assert torch.equal(batch.members, MEMBERS.reshape(-1))
    assert torch.equal(batch.pack(X, "x"), X.reshape(-1))


def test_members_packing_keeps_a_member_less_row_as_its_first_position():
    batch = PaddedBatch.of(MEMBERS, "members")
    assert batch.seq_lens == (2, 1, 2) and batch.rows == 3  # N = 5
    assert batch.pack(X, "x").tolist() == [1.0, 2.0, 4.0, 8.0, 11.0]
    assert batch.members.tolist() == [True, True, False, True, True]  # row 1's kept position is no member


def test_members_packing_with_given_positions():
    positions = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0], [1, 1, 0, 1]])
    batch = PaddedBatch.of(MEMBERS, "members", positions=positions)
    assert batch.seq_lens == (3, 2, 3)
    assert batch.pack(X, "x").tolist() == [0.0, 1.0, 2.0, 5.0, 6.0, 8.0, 9.0, 11.0]
    assert batch.members.tolist() == [False, True, True, False, False, True, False, True]


def test_plan_and_outputs_pack_the_streams_and_detach_the_plans():
    batch = PaddedBatch.of(MEMBERS, "members")
    logps = (-torch.arange(1.0, 13.0).reshape(3, 4) / 4).requires_grad_()
    rollout = logps.detach().clone().requires_grad_()
    plan = batch.plan({"sft": Component(SFT(), mask=batch.members)}, rollout_logprobs=rollout, advantages=None)
    assert plan.seq_lens == (2, 1, 2) and not plan.rollout_logprobs.requires_grad and plan.advantages is None
    assert plan.rollout_logprobs.tolist() == [-0.5, -0.75, -1.25, -2.25, -3.0]
    outputs = batch.outputs(logprobs=logps, entropy=None)
    result = compute_loss(plan, outputs)
    assert result.loss.item() == pytest.approx((0.5 + 0.75 + 2.25 + 3.0) / 4)  # SFT's token mean
    result.loss.backward()
    want = torch.zeros(3, 4)
    want[MEMBERS] = -0.25
    assert torch.equal(logps.grad, want)  # the gradient reaches the padded tensor through pack
    assert batch.pack(None, "x") is None


@pytest.mark.parametrize(
    "members, packing, error, match",
    [
        (MEMBERS, "tokens", ValueError, r"packing must be one of \('rows', 'members'\)"),
        (MEMBERS.long(), "rows", TypeError, "members must be a bool tensor"),
        (MEMBERS[0], "rows", ValueError, r"members must be a non-empty \[B, T\] tensor, got \[4\]"),
        (MEMBERS[:0], "members", ValueError, r"members must be a non-empty \[B, T\] tensor, got \[0, 4\]"),
    ],
)
def test_a_bad_batch_names_the_argument(members, packing, error, match):
    with pytest.raises(error, match=match):
        PaddedBatch.of(members, packing)
    assert PACKINGS == ("rows", "members")


def test_check_padded_names_the_stream_with_its_owner():
    check_padded({"old_log_prob": torch.zeros(3, 4), "ref": None}, (3, 4), "data.")
    with pytest.raises(ValueError, match=r"data\.old_log_prob must have shape \[B, T\] = \[3, 4\], got \[3, 5\]"):
        check_padded({"old_log_prob": torch.zeros(3, 5)}, (3, 4), "data.")
    with pytest.raises(TypeError, match=r"data\.advantages must be a floating-point tensor"):
        check_padded({"advantages": torch.zeros(3, 4, dtype=torch.long)}, (3, 4), "data.")
    with pytest.raises(TypeError, match=r"^log_prob must be a torch.Tensor"):
        check_padded({"log_prob": [[0.0]]}, (1, 1))


def test_log_ratio_mean_is_the_detached_member_mean_in_float32():
    m = torch.tensor([True, False, True])
    numerator = torch.tensor([-1.0, 5.0, -2.0], dtype=torch.bfloat16, requires_grad=True)
    denominator = torch.tensor([-1.5, 0.0, -1.0], dtype=torch.bfloat16)
    got = log_ratio_mean(m, numerator, denominator)
    assert got.dtype == torch.float32 and got.shape == () and not got.requires_grad
    assert got.item() == pytest.approx((0.5 - 1.0) / 2)
