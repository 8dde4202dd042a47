"""packloss.core.bin: Plan and Component: cheap sync-free checks that name the argument, and deep checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from packloss import DPPO, REF_KL, SFT, Component, Outputs, Plan
from packloss.testing import OpCounter

N = 7
LENS = [3, 4]


def streams():
    g = torch.Generator().manual_seed(0)
    return dict(
        mask=torch.tensor([0, 1, 1, 0, 1, 1, 1], dtype=torch.bool),
        inference=torch.rand(N, generator=g).clamp_min(0.1).log(),
        adv=torch.randn(N, generator=g),
    )


def rl_plan(**over) -> Plan:
    s = streams()
    kwargs = dict(
        seq_lens=LENS,
        components={"rl": Component(DPPO, mask=s["mask"])},
        rollout_logprobs=s["inference"],
        advantages=s["adv"],
    )
    kwargs.update(over)
    return Plan(**kwargs)


def test_layout_and_members_are_derived_once():
    s = streams()
    w = torch.tensor([0.0, 1.0, 0.0, 2.0, 1.0, 1.0, 0.5])
    plan = rl_plan(components={"rl": Component(DPPO, mask=s["mask"], weights=w), "sft": Component(SFT(), weights=w)})
    assert plan.layout.cu_seqlens.tolist() == [0, 3, 7]
    assert plan.layout.seq_ids.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert (plan.num_seqs, plan.num_tokens) == (2, 7)
    assert plan.members["rl"].tolist() == [False, True, False, False, True, True, True]
    assert plan.members["sft"].tolist() == (w != 0).tolist()
    assert plan.weights["sft"].tolist() == w.tolist()


def test_construction_has_no_device_to_host_sync():
    s = streams()
    with OpCounter() as counter:
        plan = rl_plan(group_ids=[0, 1])
        Outputs(logprobs=s["inference"].clone()).check(plan)
    assert counter.num_syncs == 0, counter.syncs


BAD = [
    (dict(seq_lens=[3, 3]), ValueError, "seq_lens sums to 6"),
    (dict(seq_lens=[3, 0, 4]), ValueError, "seq_lens must hold positive"),
    (dict(seq_lens=[3.0, 4]), TypeError, "seq_lens must hold Python ints"),
    (dict(seq_lens=torch.tensor(LENS)), TypeError, "seq_lens must be host-side"),
    (dict(seq_lens=None), TypeError, "seq_lens must be a list"),
    (dict(seq_lens=[]), ValueError, "seq_lens is empty"),
    (dict(components={}), ValueError, "components is empty"),
    (dict(components=[("rl", 1)]), TypeError, "components must be a mapping"),
    (dict(components={"rl": DPPO}), TypeError, r"components\['rl'\] must be a Component"),
    (dict(components={"rl": Component(DPPO)}), ValueError, r"components\['rl'\] needs mask, weights or both"),
    (dict(components={"": Component(SFT(), mask=torch.ones(N, dtype=torch.bool))}), TypeError, "component names"),
    (dict(components={"rl": Component(DPPO, mask=torch.ones(5, dtype=torch.bool))}), ValueError,
     r"seq_lens sums to 7 but components\['rl'\].mask holds 5"),
    (dict(rollout_logprobs=torch.zeros(6)), ValueError, r"rollout_logprobs must have shape \[7\]"),
    (dict(advantages=torch.zeros(N, dtype=torch.long)), TypeError, "advantages must be a floating-point"),
    (dict(advantages=[0.0] * N), TypeError, "advantages must be a torch.Tensor"),
    (dict(rollout_logprobs=None), ValueError, "'rl' needs the plan's rollout_logprobs"),
    (dict(advantages=None), ValueError, "'rl' needs the plan's advantages"),
    (dict(components={"d": Component(REF_KL, mask=torch.ones(N, dtype=torch.bool))}), ValueError,
     "'d' needs the plan's ref_logprobs"),
    (dict(teacher_logits=torch.zeros(6, 5)), ValueError, r"teacher_logits must have shape \[N, V\]"),
    (dict(teacher_hidden=torch.zeros(N, 4)), ValueError, "teacher_hidden and teacher_weight go together"),
    (dict(teacher_hidden=torch.zeros(N, 4), teacher_weight=torch.zeros(9, 3)), ValueError, "teacher_weight must"),
    (dict(group_ids=[0]), ValueError, "group_ids holds 1 values for S=2"),
    (dict(group_ids=[0, -1]), ValueError, "group_ids must be >= 0"),
    (dict(group_ids=[0, 1.0]), TypeError, "group_ids must hold Python ints"),
    (dict(group_ids=torch.tensor([0, 1])), TypeError, "group_ids must be host-side"),
]  # fmt: skip


@pytest.mark.parametrize("over, error, match", BAD, ids=[m for _, _, m in BAD])
def test_invalid_plan_names_the_argument(over, error, match):
    with pytest.raises(error, match=match):
        rl_plan(**over)


COMPONENT_BAD = [
    (dict(loss="dppo"), TypeError, "loss must be a callable"),
    (dict(mask=torch.ones(N)), TypeError, "mask must be a bool tensor"),
    (dict(mask=[True] * N), TypeError, "mask must be a torch.Tensor"),
    (dict(weights=torch.ones(N, dtype=torch.long)), TypeError, "weights must be a floating-point"),
    (dict(normalize="tokens"), ValueError, "normalize must be one of"),
]


@pytest.mark.parametrize("over, error, match", COMPONENT_BAD, ids=[m for _, _, m in COMPONENT_BAD])
def test_invalid_component_names_the_argument(over, error, match):
    kwargs = dict(loss=SFT(), mask=torch.ones(N, dtype=torch.bool))
    kwargs.update(over)
    with pytest.raises(error, match=match):
        Component(**kwargs)


def test_deep_validation_reads_values():
    plan = rl_plan()
    assert plan.validate(deep=True) is plan
    bad_inf = streams()["inference"].clone()
    bad_inf[0] = float("nan")  # not a member: fine
    rl_plan(rollout_logprobs=bad_inf).validate(deep=True)
    bad_inf[1] = float("nan")
    with pytest.raises(ValueError, match="rollout_logprobs holds a non-finite"):
        rl_plan(rollout_logprobs=bad_inf).validate(deep=True)
    with pytest.raises(ValueError, match="rollout_logprobs holds a positive"):
        rl_plan(rollout_logprobs=torch.full((N,), 0.5)).validate(deep=True)
    w = torch.ones(N)
    w[0] = float("inf")
    with pytest.raises(ValueError, match=r"components\['rl'\].weights holds a non-finite"):
        rl_plan(components={"rl": Component(DPPO, mask=streams()["mask"], weights=w)}).validate(deep=True)


def test_plan_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        rl_plan().seq_lens = (7,)


def test_tensor_constant_is_checked_by_deep_validation():
    s = streams()
    comp = Component(SFT(), mask=s["mask"], normalize="constant", constant=torch.tensor(-2.0))
    plan = Plan(LENS, {"sft": comp})
    with pytest.raises(ValueError, match=r"components\['sft'\].constant must be finite and > 0"):
        plan.validate(deep=True)
    Plan(LENS, {"sft": Component(SFT(), mask=s["mask"], normalize="constant", constant=torch.tensor(3.0))}).validate(
        deep=True
    )


@pytest.mark.parametrize("source", ["teacher", "rollout"])
def test_topk_streams_are_checked_together(source):
    mask = torch.ones(5, dtype=torch.bool)
    comps = {"sft": Component(SFT(), mask)}
    ids, logprobs = torch.zeros(5, 3, dtype=torch.long), torch.full((5, 3), -2.0)
    plan = Plan([2, 3], comps, **{f"{source}_topk_ids": ids, f"{source}_topk_logprobs": logprobs})
    assert getattr(plan, f"{source}_topk_ids") is ids
    with pytest.raises(ValueError, match=f"{source}_topk_ids and {source}_topk_logprobs go together"):
        Plan([2, 3], comps, **{f"{source}_topk_logprobs": logprobs})
    with pytest.raises(ValueError, match=f"{source}_topk_ids must be int32/int64"):
        Plan([2, 3], comps, **{f"{source}_topk_ids": ids.float(), f"{source}_topk_logprobs": logprobs})
    with pytest.raises(ValueError, match=f"{source}_topk_ids must be int32/int64 of the shape"):
        Plan([2, 3], comps, **{f"{source}_topk_ids": ids[:, :2], f"{source}_topk_logprobs": logprobs})
    with pytest.raises(ValueError, match=rf"{source}_topk_logprobs must have shape \[N, K\] with N=5"):
        Plan([2, 3], comps, **{f"{source}_topk_ids": ids[:4], f"{source}_topk_logprobs": logprobs[:4]})


def test_chosen_flags_are_host_bools_one_per_sequence():
    comps = {"sft": Component(SFT(), torch.ones(5, dtype=torch.bool))}
    assert Plan([2, 3], comps, chosen=[True, False]).chosen == (True, False)
    with pytest.raises(TypeError, match="chosen must be host-side Python bools"):
        Plan([2, 3], comps, chosen=torch.tensor([True, False]))
    with pytest.raises(ValueError, match="chosen holds 1 values for S=2 sequences"):
        Plan([2, 3], comps, chosen=[True])
    with pytest.raises(TypeError, match="chosen must be a bool"):
        Plan([2, 3], comps, chosen=[1, 0])
