"""PackedBatch: layout derivation, constructors, and one clear error per invalid input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from packloss import PackedBatch
from packloss.testing import OpCounter


def streams(n: int = 6, **over):
    base = dict(
        trainer_logprobs=-torch.rand(n),
        inference_logprobs=-torch.rand(n),
        loss_mask=torch.ones(n, dtype=torch.bool),
        advantages=torch.randn(n),
        seq_lens=[2, 1, 3][: max(1, n // 2)] if n == 6 else [n],
    )
    base.update(over)
    return base


def test_layout_is_derived_once():
    batch = PackedBatch(**streams())
    assert batch.cu_seqlens.tolist() == [0, 2, 3, 6]
    assert batch.seq_ids.tolist() == [0, 0, 1, 2, 2, 2]
    assert (batch.num_seqs, batch.num_tokens) == (3, 6)
    assert batch.seq_ids.dtype == torch.long


def test_construction_has_no_device_to_host_sync():
    s = streams()
    with OpCounter() as counter:
        PackedBatch(**s)
    assert counter.num_syncs == 0, counter.syncs


@pytest.mark.parametrize(
    "over, error, match",
    [
        (dict(trainer_logprobs=-torch.rand(5)), ValueError, "seq_lens sums to 6 but trainer_logprobs holds N=5"),
        (dict(inference_logprobs=-torch.rand(7)), ValueError, "inference_logprobs.*shape"),
        (dict(advantages=torch.randn(6, 1)), ValueError, "advantages.*shape"),
        (dict(seq_lens=[2, 2, 3]), ValueError, "seq_lens sums to 7"),
        (dict(seq_lens=[3, 0, 3]), ValueError, "seq_lens must hold positive"),
        (dict(seq_lens=[4, -1, 3]), ValueError, "seq_lens must hold positive"),
        (dict(seq_lens=[]), ValueError, "seq_lens is empty"),
        (dict(seq_lens=torch.tensor([3, 3])), TypeError, "seq_lens must be host-side"),
        (dict(seq_lens=[3.0, 3.0]), TypeError, "seq_lens must hold Python ints"),
        (dict(loss_mask=torch.ones(6)), TypeError, "loss_mask must be a bool"),
        (dict(trainer_logprobs=torch.zeros(6, dtype=torch.long)), TypeError, "trainer_logprobs must be a floating"),
        (dict(inference_logprobs=torch.zeros(6, dtype=torch.int32)), TypeError, "inference_logprobs.*floating"),
        (dict(ref_logprobs=torch.zeros(6, dtype=torch.long)), TypeError, "ref_logprobs.*floating"),
        (dict(inference_logprobs=-torch.rand(6, device="meta")), ValueError, "inference_logprobs is on meta"),
        (dict(ref_kl_weights=torch.ones(6)), ValueError, "ref_kl_weights is given but ref_logprobs is None"),
        (dict(rl_weights=torch.ones(5)), ValueError, "rl_weights must have shape"),
        (dict(ce_weights=torch.ones(2, 3)), ValueError, "ce_weights must have shape"),
        (dict(ref_kl_weights=torch.ones(6, 1), ref_logprobs=-torch.rand(6)), ValueError, "ref_kl_weights.*shape"),
        (dict(rl_weights=torch.ones(6, dtype=torch.long)), TypeError, "rl_weights must be a floating"),
        (dict(advantages=[0.0] * 6), TypeError, "advantages must be a torch.Tensor"),
        (dict(trainer_logprobs=-torch.rand(2, 3)), ValueError, "trainer_logprobs must be 1-D"),
    ],
)
def test_invalid_input_names_the_argument(over, error, match):
    with pytest.raises(error, match=match):
        PackedBatch(**streams(**over))


def test_deep_validation_reads_values():
    batch = PackedBatch(**streams())
    assert batch.validate(deep=True) is batch
    bad = streams()
    bad["trainer_logprobs"][1] = float("nan")
    with pytest.raises(ValueError, match="trainer_logprobs holds a non-finite"):
        PackedBatch(**bad).validate(deep=True)
    bad = streams()
    bad["inference_logprobs"][0] = 0.5
    with pytest.raises(ValueError, match="inference_logprobs holds a positive"):
        PackedBatch(**bad).validate(deep=True)
    bad = streams(rl_weights=torch.ones(6))
    bad["rl_weights"][2] = float("inf")
    with pytest.raises(ValueError, match="rl_weights holds a non-finite"):
        PackedBatch(**bad).validate(deep=True)
    masked = streams(loss_mask=torch.tensor([True, False, True, True, True, True]))
    masked["trainer_logprobs"][1] = float("nan")  # not a member: fine
    PackedBatch(**masked).validate(deep=True)


def test_from_sequences_concatenates_and_keeps_autograd():
    trn = [torch.rand(n).neg().requires_grad_() for n in (3, 1, 2)]
    batch = PackedBatch.from_sequences(
        trainer_logprobs=trn,
        inference_logprobs=[t.detach() for t in trn],
        loss_mask=[torch.ones(n, dtype=torch.bool) for n in (3, 1, 2)],
        advantages=[torch.ones(n) for n in (3, 1, 2)],
    )
    assert batch.seq_lens == (3, 1, 2)
    batch.trainer_logprobs.sum().backward()
    assert all(torch.equal(t.grad, torch.ones_like(t)) for t in trn)
    with pytest.raises(ValueError, match=r"advantages\[1\] must have shape"):
        PackedBatch.from_sequences(
            trainer_logprobs=trn,
            inference_logprobs=trn,
            loss_mask=[torch.ones(n, dtype=torch.bool) for n in (3, 1, 2)],
            advantages=[torch.ones(n) for n in (3, 2, 2)],
        )
    with pytest.raises(ValueError, match="loss_mask holds 2 sequences"):
        PackedBatch.from_sequences(trn, trn, [torch.ones(3, dtype=torch.bool)] * 2)


@pytest.mark.parametrize("padding", ["right", "left"])
def test_from_padded_round_trip(padding):
    lens = [4, 1, 3]
    t = 5
    attention = torch.zeros(3, t, dtype=torch.bool)
    for b, n in enumerate(lens):
        if padding == "right":
            attention[b, :n] = True
        else:
            attention[b, t - n :] = True
    values = torch.arange(15.0).view(3, t)
    padded = dict(
        trainer_logprobs=-values,
        inference_logprobs=-values,
        loss_mask=attention.clone(),
        advantages=values,
    )
    batch = PackedBatch.from_padded(attention, **padded)
    assert batch.seq_lens == tuple(lens)
    assert batch.advantages.tolist() == values[attention].tolist()
    with OpCounter() as counter:
        PackedBatch.from_padded(attention, seq_lens=lens, **padded)
    assert counter.num_syncs == 0, counter.syncs
    back, back_mask = batch.to_padded(batch.advantages, pad_value=-1.0)
    assert back_mask.sum(1).tolist() == lens
    for b, n in enumerate(lens):
        assert back[b, :n].tolist() == values[b][attention[b]].tolist()
        assert (back[b, n:] == -1.0).all()


def test_from_padded_errors():
    attention = torch.ones(2, 3, dtype=torch.bool)
    s = dict(trainer_logprobs=-torch.rand(2, 3), inference_logprobs=-torch.rand(2, 3), loss_mask=attention)
    with pytest.raises(TypeError, match="unknown stream"):
        PackedBatch.from_padded(attention, **s, advantage=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="advantages must have shape"):
        PackedBatch.from_padded(attention, **s, advantages=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="attention_mask must be"):
        PackedBatch.from_padded(attention[0], **s)
    empty_row = attention.clone()
    empty_row[1] = False
    with pytest.raises(ValueError, match="positive"):
        PackedBatch.from_padded(empty_row, **s)
    batch = PackedBatch.from_padded(attention, **s)
    with pytest.raises(ValueError, match="stream must have shape"):
        batch.to_padded(torch.zeros(5))


def test_batch_is_frozen():
    batch = PackedBatch(**streams())
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.loss_mask = torch.zeros(6, dtype=torch.bool)
