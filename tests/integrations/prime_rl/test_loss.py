"""The helpers both prime-rl APIs share: log-softmax gathers, entropy and shifts."""

from __future__ import annotations

import torch

from packloss.integrations.prime_rl import loss as prime_rl


def test_selective_log_softmax_and_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g) * 3
    index = torch.randint(0, 11, (2, 5), generator=g)
    expected = torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(prime_rl.selective_log_softmax(logits, index), expected, atol=1e-6)
    p = torch.softmax(logits, -1)
    assert torch.allclose(prime_rl.compute_entropy(logits), -(p * p.log()).sum(-1), atol=1e-5)


def test_shift_tensors():
    t = torch.arange(1, 7).view(2, 3)
    assert prime_rl.shift_tensor_left(t).tolist() == [[2, 3, 0], [5, 6, 0]]
    assert prime_rl.shift_tensor_right(t.float(), pad_value=-1.0).tolist() == [[-1, 1, 2], [-1, 4, 5]]
    assert prime_rl.shift_tensor_right(t).tolist() == [[0, 1, 2], [0, 4, 5]]
