"""packloss.tools.demo.bins: a packed bin's layout (lengths, answer positions, labels, positions that
restart per sequence), the empty bin, and each phase kind's plan."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import demo_rollouts
from packloss import DPPO, REF_KL, SFT
from packloss.tools import demo
from packloss.vocab import VocabDistill


def test_bin_layout():
    rollouts = demo_rollouts()
    b = demo.make_bin(rollouts, [1.0, -1.0, 0.5], "cpu")
    assert b.seq_lens == (9, 13, 12)
    assert int(b.answer.sum()) == sum(len(r.completion) for r in rollouts)
    # Every answer position's label is the completion token it scores.
    labels = b.labels[0][b.answer].tolist()
    assert labels == [t for r in rollouts for t in r.completion]
    assert b.positions[0].tolist()[:10] == [*range(9), 0]


def test_the_empty_bin_has_one_position_and_no_member():
    b = demo.empty_bin("cpu")
    assert (b.seq_lens, b.num_real) == ((1,), 0)
    assert b.answer.tolist() == [False] and b.labels.tolist() == [[-100]]
    plan = demo.make_plan("rl", b)
    assert list(plan.components) == ["pg"] and plan.members["pg"].tolist() == [False]


@pytest.mark.parametrize("kind", demo.KINDS)
def test_each_phase_kind_plans_its_component_on_the_answer(kind):
    b = demo.make_bin(demo_rollouts(), [1.0, -1.0, 0.5], "cpu")
    n = sum(b.seq_lens)
    stream = {"ref_kl": torch.full((n,), -1.0), "full": torch.zeros(n, 4)}.get(kind)
    teacher = SimpleNamespace(lm_head=SimpleNamespace(weight=torch.zeros(demo.task.VOCAB_SIZE, 4)))
    plan = demo.make_plan(kind, b, stream, teacher)
    name = demo.COMPONENT[kind]
    assert list(plan.components) == [name] and torch.equal(plan.members[name], b.answer)
    loss = plan.components[name].loss
    expected = {"ce": SFT(), "ref_kl": REF_KL, "full": VocabDistill(kind="reverse_kl"), "rl": DPPO}[kind]
    assert loss == expected
    assert plan.components[name].normalize.value == "token"
    if kind == "rl":
        assert torch.equal(plan.rollout_logprobs, b.rollout_logprobs) and torch.equal(plan.advantages, b.advantages)
    if kind == "ref_kl":
        assert plan.ref_logprobs is stream and torch.equal(plan.rollout_logprobs, b.rollout_logprobs)
    if kind == "full":
        assert plan.teacher_hidden is stream and plan.teacher_weight is teacher.lm_head.weight


def test_plans_and_teacher_streams_refuse_what_they_cannot_build():
    b = demo.make_bin(demo_rollouts(), [0.0, 0.0, 0.0], "cpu")
    with pytest.raises(ValueError, match="phase kind 'full' needs the teacher"):
        demo.make_plan("full", b, torch.zeros(sum(b.seq_lens), 4))
    with pytest.raises(ValueError, match="phase kind 'ref_kl' needs a teacher"):
        demo.teacher_streams("ref_kl", [b], None)
    assert demo.teacher_streams("ce", [b, b], None) == [None, None]
    assert demo.teacher_streams("rl", [b], None) == [None]


def test_an_unknown_phase_kind_is_a_value_error():
    b = demo.make_bin(demo_rollouts(), [0.0, 0.0, 0.0], "cpu")
    with pytest.raises(ValueError, match="unknown phase kind 'ppo'"):
        demo.make_plan("ppo", b)
