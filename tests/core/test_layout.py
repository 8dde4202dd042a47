"""Layout and PaddedLayout: packing [B, T] batches into a bin and back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packloss import Layout, PaddedLayout
from packloss.testing import OpCounter


@pytest.mark.parametrize("padding", ["right", "left", "holes"])
def test_padded_round_trip(padding):
    attention = {
        "right": [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]],
        "left": [[0, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]],
        "holes": [[1, 0, 1, 1], [0, 1, 0, 1], [1, 1, 1, 1]],
    }[padding]
    mask = torch.tensor(attention, dtype=torch.bool)
    x = torch.arange(12.0).view(3, 4).requires_grad_()
    layout = PaddedLayout.from_attention_mask(mask)
    packed = layout.pack(x, "x")
    assert layout.seq_lens == tuple(int(r.sum()) for r in mask)
    assert packed.tolist() == x.detach()[mask].tolist()  # row-major order of the attended positions
    back = layout.unpack(packed.detach(), pad_value=-1.0)
    assert torch.equal(torch.where(mask, back, -1.0), back) and torch.equal(back[mask], x.detach()[mask])
    packed.sum().backward()
    assert torch.equal(x.grad, mask.float())
    logits = torch.randn(3, 4, 5)
    assert layout.pack(logits).shape == (int(mask.sum()), 5)


def test_padded_layout_with_host_lengths_has_no_sync_and_can_be_validated():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    with OpCounter() as counter:
        layout = PaddedLayout.from_attention_mask(mask, seq_lens=[2, 3])
    assert counter.num_syncs == 0
    layout.validate(mask)
    with pytest.raises(ValueError, match="disagree with attention_mask"):
        PaddedLayout.from_attention_mask(mask, seq_lens=[3, 2]).validate(mask)


def test_padded_layout_errors():
    mask = torch.ones(2, 3, dtype=torch.bool)
    layout = PaddedLayout.from_attention_mask(mask)
    with pytest.raises(ValueError, match=r"advantages must have shape \[B, T, ...\]"):
        layout.pack(torch.zeros(2, 4), "advantages")
    with pytest.raises(TypeError, match="advantages must be a torch.Tensor"):
        layout.pack([[0.0] * 3] * 2, "advantages")
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, T\]"):
        PaddedLayout.from_attention_mask(torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="seq_lens holds 1 lengths for B=2"):
        PaddedLayout.from_attention_mask(mask, seq_lens=[3])
    with pytest.raises(ValueError, match="positive"):
        PaddedLayout.from_attention_mask(torch.tensor([[1, 1], [0, 0]]))


def test_layout_to_padded():
    layout = Layout.build([2, 3])
    padded, attention = layout.to_padded(torch.arange(5.0), pad_value=-1.0)
    assert padded.tolist() == [[0.0, 1.0, -1.0], [2.0, 3.0, 4.0]]
    assert attention.tolist() == [[True, True, False], [True, True, True]]
    with pytest.raises(ValueError, match="stream must have shape"):
        layout.to_padded(torch.arange(4.0))


def test_unpack_of_the_wrong_length_names_the_layout_size():
    layout = PaddedLayout.from_attention_mask(torch.tensor([[1, 1, 0], [1, 0, 0]]).bool())
    with pytest.raises(ValueError, match=r"x must be \[N, \.\.\.\] with N=3"):
        layout.unpack(torch.zeros(7))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_padded_layout_index_is_the_stable_sort_of_the_unattended(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) < torch.rand(1, generator=g)
    mask[:, 0] = True
    flat = mask.reshape(-1)
    expected = torch.argsort((~flat).long(), stable=True)[: int(flat.sum())]  # independent reference
    assert torch.equal(PaddedLayout.from_attention_mask(mask).index, expected)


def test_whole_rows_packs_every_position_as_a_view_without_a_sync():
    x = torch.randn(3, 4, 2, requires_grad=True)
    with OpCounter() as ops:
        layout = PaddedLayout.whole_rows((3, 4))
        packed = layout.pack(x, "x")
    assert ops.num_syncs == 0 and "aten.index_select" not in ops.ops
    assert packed._base is x and layout.seq_lens == (4, 4, 4)
    full = PaddedLayout.from_attention_mask(torch.ones(3, 4, dtype=torch.bool))
    assert torch.equal(layout.index, full.index) and torch.equal(packed, full.pack(x))
    assert torch.equal(layout.unpack(packed.detach()), x.detach())
    packed.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, \.\.\.\] = \(3, 4"):
        layout.pack(torch.zeros(4, 3), "x")
    with pytest.raises(ValueError, match="batch_shape must be two positive ints"):
        PaddedLayout.whole_rows((0, 4))
