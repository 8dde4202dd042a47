"""The naive formulas of ``packloss bench peers`` against the installed peers' own losses (TRL's
``_compute_loss``, verl's policy losses): value, gradient and every metric both return, in float64, with
the padding holding values no member has."""

from __future__ import annotations

import pytest
import torch

from packloss.tools.bench import peers_rl


@pytest.mark.parametrize("comparison", ["rl/dapo·trl", "rl/ppo_clip·verl", "rl/dppo_tv·verl"])
def test_naive_formula_equals_the_peers_own_loss(comparison):
    b = peers_rl.rl_batch(400, 6, seed=3).to(torch.float64)
    b = type(b)(**{**vars(b), "old": torch.where(b.valid, b.old, -3.0), "logp": torch.where(b.valid, b.logp, 5.0)})
    (case,) = [c for c in peers_rl._rl_cases(b, []) if c.name == comparison]
    logp = b.logp.clone().requires_grad_()
    expected, expected_metrics = case.peer_loss(logp)
    loss, metrics = case.naive(logp, b.old, case.naive_adv, b.mask, b.mask.sum().double())
    (grad,) = torch.autograd.grad(loss, logp)
    (peer_grad,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, peer_grad, rtol=1e-12, atol=1e-15)
    assert metrics and set(metrics) <= set(expected_metrics)
    for name, value in metrics.items():
        assert float(value) == pytest.approx(expected_metrics[name], rel=1e-9, abs=1e-12), name
    assert any(float(v) > 0 for v in metrics.values())  # the data clip some tokens: the metrics are not all 0
