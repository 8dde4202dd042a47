"""packloss.core.outputs: Outputs, checked by name and against the plan without a sync."""

from __future__ import annotations

import pytest
import torch

from packloss import DPPO, SFT, Component, Outputs, Plan

N = 7


def rl_plan() -> Plan:
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    return Plan([3, 4], {"rl": Component(DPPO, mask=mask)}, rollout_logprobs=torch.full((N,), -1.0),
                advantages=torch.zeros(N))  # fmt: skip


def test_invalid_outputs_name_the_argument():
    plan = rl_plan()
    with pytest.raises(TypeError, match="outputs.logprobs must be a torch.Tensor"):
        Outputs(logprobs=[0.0] * N)
    with pytest.raises(TypeError, match="outputs.entropy must be a floating-point"):
        Outputs(entropy=torch.zeros(N, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden and outputs.head_weight go together"):
        Outputs(hidden=torch.zeros(N, 4))
    with pytest.raises(ValueError, match=r"head_weight must be \[V, H\] with H=4"):
        Outputs(hidden=torch.zeros(N, 4), head_weight=torch.zeros(9, 3))
    with pytest.raises(ValueError, match=r"outputs.logits must have shape \[N, ·\]"):
        Outputs(logits=torch.zeros(N)).check(plan)


def test_outputs_head_weight_on_the_meta_device_is_refused_by_name():
    plan = Plan((3,), {"sft": Component(SFT(), torch.ones(3, dtype=torch.bool))})
    outputs = Outputs(hidden=torch.randn(3, 2), head_weight=torch.empty(5, 2, device="meta"))
    with pytest.raises(ValueError, match="outputs.head_weight is on the meta device"):
        outputs.check(plan)


def test_anchor_is_a_zero_on_every_outputs_graph():
    logprobs = torch.randn(N, requires_grad=True)
    hidden, weight = torch.randn(N, 3, requires_grad=True), torch.randn(5, 3, requires_grad=True)
    zero = Outputs(logprobs=logprobs, hidden=hidden, head_weight=weight).anchor()
    assert zero.item() == 0.0 and zero.dtype == torch.float32
    zero.backward()
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in (logprobs, hidden, weight))
    assert Outputs(logprobs=logprobs.detach()).anchor() is None
