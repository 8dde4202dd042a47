"""The ``rl head`` rows' variants compute one loss: packloss's one pass and two-step path against the
naive materialised PPO clip, values and head gradients (the peers' compiled variants are left to the
suite itself: each compiles for tens of seconds)."""

from __future__ import annotations

import pytest
import torch

from packloss.tools.bench.peers_head_rl import ROW_TOKENS, rl_head_fn, rl_head_inputs


def _run(variant: str):
    inputs = rl_head_inputs(2 * ROW_TOKENS, 16, 97, "cpu", seed=3)
    loss = rl_head_fn(variant)(*inputs)
    return (loss.detach(), *torch.autograd.grad(loss, [inputs[0], inputs[1]]))


@pytest.mark.parametrize("variant", ["packloss_one_pass", "packloss_two_step"])
def test_packloss_variants_equal_the_naive_loss(variant):
    want = _run("naive_eager")
    assert want[1].abs().max() > 0  # some ratios inside the clip: a gradient to compare
    for got, ref in zip(_run(variant), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-7)


def test_inputs_make_some_ratios_clip():
    hidden, weight, labels, mask, adv, old = rl_head_inputs(ROW_TOKENS, 16, 97, "cpu", seed=0)
    lp = torch.log_softmax(hidden @ weight.T, -1).gather(1, labels[:, None]).squeeze(1)
    r = torch.exp(lp - old)[mask]
    assert ((r > 1.2) | (r < 0.8)).any() and ((r < 1.2) & (r > 0.8)).any()


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="unknown variant"):
        rl_head_fn("nope")
