"""packloss.testing.ops: OpCounter counts aten ops forward and backward, and flags the ops that read a
device value on the host (``.item()``, bool-mask indexing, ``repeat_interleave`` without a size)."""

from __future__ import annotations

import torch

from conftest import bin_of
from packloss.compat import prime_rl
from packloss.testing import SYNC_OPS, OpCounter
from packloss.testing import reference as ref_impl


def test_op_counter_detects_syncs():
    """The counter must be able to fail: a reference-style loop is full of syncs."""
    streams = bin_of("weighted_grpo")
    fn = ref_impl.setup_rl_loss_fn(prime_rl.DefaultLossConfig())
    with OpCounter() as counter:
        loss, _ = ref_impl.compute_loss(**streams.lists(), **streams.integer_scales(), rl_loss_fn=fn)
        loss.backward()
    assert counter.syncs["aten._local_scalar_dense"] > 0
    assert counter.syncs["aten.index"] > 0


def test_counts_ops_forward_and_backward_without_syncs():
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    y = torch.tensor([0.5, 0.5, 0.5])
    with OpCounter() as counter:
        z = x * y + y
        z.sum().backward()
    assert counter.ops["aten.mul"] >= 1 and counter.ops["aten.add"] == 1 and counter.ops["aten.sum"] == 1
    assert counter.total == sum(counter.ops.values()) and counter.num_syncs == 0
    assert torch.equal(x.grad, y)


def test_flags_the_ops_that_read_device_values_on_the_host():
    x = torch.tensor([1.0, -2.0, 3.0])
    lens = torch.tensor([2, 1])
    with OpCounter() as counter:
        x.sum().item()
        _ = x[x > 0]
        torch.repeat_interleave(torch.arange(2), lens)
        torch.repeat_interleave(torch.arange(2), lens, output_size=3)  # the size given: no sync
        x.nonzero()
    assert counter.syncs["aten._local_scalar_dense"] == 1
    assert counter.syncs["aten.index"] == 1
    assert counter.syncs["aten.repeat_interleave"] == 1 and counter.ops["aten.repeat_interleave"] == 2
    assert counter.syncs["aten.nonzero"] >= 1
    assert counter.num_syncs == sum(counter.syncs.values())
    assert {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select"} <= SYNC_OPS


def test_integer_indexing_is_no_sync():
    x = torch.tensor([1.0, -2.0, 3.0])
    with OpCounter() as counter:
        _ = x[torch.tensor([2, 0])]
    assert counter.ops["aten.index"] == 1 and counter.num_syncs == 0
