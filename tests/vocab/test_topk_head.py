"""packloss.vocab.topk_head: the block helpers (ids in a block, the ``amin`` mask, the online tail) and the
fused pass ``head_topk_logits`` against float64 autograd over materialised logits: values, gradients,
blocks of every size, an empty tail, rows off the mask."""

from __future__ import annotations

import math

import pytest
import torch

from packloss.vocab.topk_head import HeadBlocks, block_columns, head_topk_logits, mask_topk_, tail_logsumexp

NEG_INF = -math.inf


@pytest.mark.parametrize("order", [[0, 1], [1, 0]])
def test_an_absent_id_clamped_onto_a_present_ones_column_leaves_it_masked(order) -> None:
    ids = torch.tensor([[-1, 0][i] for i in order])[None]  # [1, 2]: an absent id (clamped to 0) and id 0
    present = ids >= 0
    in_block, col = block_columns(ids, present, 0, 4)
    assert col.tolist() == [[0, 0]] and in_block.tolist() == [[i == 1 for i in order]]
    x = mask_topk_(torch.arange(4.0)[None].clone(), in_block, col)
    assert x.tolist() == [[NEG_INF, 1.0, 2.0, 3.0]]
    only_absent = mask_topk_(torch.arange(4.0)[None].clone(), torch.zeros(1, 2, dtype=torch.bool), col)
    assert only_absent.tolist() == [[0.0, 1.0, 2.0, 3.0]]


def test_ids_outside_a_block_are_not_in_it() -> None:
    ids = torch.tensor([[3, 4, 7, 8]])
    in_block, col = block_columns(ids, torch.ones(1, 4, dtype=torch.bool), 4, 4)  # the block [4, 8)
    assert in_block.tolist() == [[False, True, True, False]] and col.tolist() == [[0, 0, 3, 3]]


def test_an_all_minus_inf_tail_is_minus_inf() -> None:
    m, s = torch.tensor([NEG_INF, 2.0], dtype=torch.float64), torch.tensor([0.0, 3.0], dtype=torch.float64)
    assert tail_logsumexp(m, s).tolist() == [NEG_INF, 2.0 + math.log(3.0)]


def _naive(hidden, weight, ids, present, temperature):
    """``(tail, picked)`` by float64 autograd over the materialised ``[N, V]`` logits."""
    x = hidden @ weight.T / temperature  # [N, V]
    in_topk = torch.zeros_like(x, dtype=torch.bool)
    for i, j in zip(*torch.where(present), strict=True):
        in_topk[i, ids[i, j]] = True
    tail = torch.logsumexp(x.masked_fill(in_topk, NEG_INF), dim=1)
    return tail, torch.where(present, x.gather(1, ids.clamp(min=0)), 0.0)


@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 4), (7, 13), (100, 100)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_materialised_logits(rows, cols, temperature) -> None:
    n, h, v, k = 7, 5, 13, 4
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    ids[2, 1] = -1
    ids[5] = torch.tensor([0, 1, 2, 3])
    present = ids >= 0
    mask = torch.ones(n, dtype=torch.bool)
    g_tail, g_picked = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, k, generator=g)
    g_picked = g_picked.double()
    got = head_topk_logits(hidden, weight, ids, present, mask, temperature, HeadBlocks(rows, cols))
    grads = torch.autograd.grad((got[0] * g_tail).sum() + (got[1] * g_picked).sum(), [hidden, weight])
    want = _naive(hidden, weight, ids, present, temperature)
    want_grads = torch.autograd.grad((want[0] * g_tail).sum() + (want[1] * g_picked).sum(), [hidden, weight])
    for a, b in zip((*got, *grads), (*want, *want_grads), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gradcheck() -> None:
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 5], [2, -1], [1, 3], [4, 0]])
    present, mask = ids >= 0, torch.tensor([True, True, False, True])

    def fn(h, w):
        return head_topk_logits(h, w, ids, present & mask[:, None], mask, 1.3, HeadBlocks(3, 4))

    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_an_empty_tail_is_minus_inf_with_a_finite_gradient() -> None:
    hidden = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]])
    tail, picked = head_topk_logits(hidden, weight, ids, ids >= 0, torch.ones(2, dtype=torch.bool), 1.0,
                                    HeadBlocks(1, 3))  # fmt: skip
    assert tail.tolist() == [NEG_INF, NEG_INF]
    d_h, d_w = torch.autograd.grad(picked.sum() + torch.where(tail > NEG_INF, tail, 0.0).sum(), [hidden, weight])
    torch.testing.assert_close(d_h, weight.detach().sum(0).expand(2, 3))
    assert torch.isfinite(d_w).all()


@pytest.mark.parametrize("need", ["hidden", "weight"])
def test_rows_off_the_mask_give_exact_zeros_and_only_the_needed_gradient(need) -> None:
    hidden = torch.randn(5, 3, dtype=torch.float64)
    hidden[[1, 3]] = math.nan
    weight = torch.randn(8, 3, dtype=torch.float64)
    (hidden if need == "hidden" else weight).requires_grad_()
    ids = torch.tensor([[0, 1]] * 5)
    mask = torch.tensor([True, False, True, False, True])
    tail, picked = head_topk_logits(hidden, weight, ids, (ids >= 0) & mask[:, None], mask, 1.0, HeadBlocks(2, 3))
    loss = torch.where(mask, tail, 0.0).sum() + picked.sum()
    (grad,) = torch.autograd.grad(loss, [hidden if need == "hidden" else weight])
    assert torch.isfinite(grad).all()
    if need == "hidden":
        assert (grad[[1, 3]] == 0).all() and (grad[mask] != 0).all()
