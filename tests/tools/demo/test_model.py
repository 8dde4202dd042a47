"""packloss.tools.demo.model: packed log-probs equal unpacked ones (positions restart per sequence),
rollouts and the reference answer, greedy generation's length and score."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from conftest import demo_rollouts  # noqa: E402
from packloss.core.packing import block_causal_mask  # noqa: E402
from packloss.tools import demo  # noqa: E402


def test_packed_logprobs_equal_each_sequence_alone():
    model = demo.build_model(demo.DEFAULT.student, seed=0)
    rollouts = demo_rollouts()
    packed = demo.make_bin(rollouts, [0.0] * len(rollouts), "cpu")
    with torch.no_grad():
        together = demo.packed_logprobs(model, packed)
        alone = torch.cat([demo.packed_logprobs(model, demo.make_bin([r], [0.0], "cpu")) for r in rollouts])
        # The explicit block-diagonal causal mask (packloss.core.packing) gives the same log-probs.
        mask = block_causal_mask(packed.seq_lens)[None, None]
        explicit = model(packed.input_ids, labels=packed.labels, position_ids=packed.positions, attention_mask=mask)
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(explicit.logprobs[0], alone, rtol=1e-5, atol=1e-5)
    # Without the position resets the sequences would see each other: the check can fail.
    leaky = model(packed.input_ids, labels=packed.labels).logprobs[0].detach()
    assert (leaky - alone).abs().max() > 1e-3


def test_target_rollout_is_the_reference_answer():
    r = demo.target_rollout("305")
    assert r.prompt == demo.encode_prompt("305") and r.completion == demo.encode_target("305")
    assert (r.reward, r.exact, r.logprobs) == (1.0, True, [0.0] * 4)
    assert r.tokens == r.prompt + r.completion


def test_a_generated_row_is_cut_after_its_first_eos_or_the_answer_length_plus_one():
    from packloss.tools.demo.model import _rollout

    answer = demo.encode_target("12")  # two digits and "$"
    done = _rollout("12", demo.encode_prompt("12"), [*answer, 7, 7], [-0.1, -0.2, -0.3, -0.4, -0.5], None)
    assert (done.completion, done.logprobs, done.reward, done.exact) == (answer, [-0.1, -0.2, -0.3], 1.0, True)
    no_eos = [answer[0], answer[1], answer[1], answer[1], answer[1]]
    cut = _rollout("12", demo.encode_prompt("12"), no_eos, [-1.0] * 5, [0.5] * 5)
    assert cut.completion == no_eos[:4] and cut.kl == [0.5] * 4  # len(answer) + 1 tokens
    assert (cut.reward, cut.exact) == (2 / 3, False)


def test_greedy_generation_is_deterministic_scored_and_has_no_kl_to_itself():
    model = demo.build_model(demo.QUICK.student, seed=0)
    prompts = ["12", "345", "9"]
    first = demo.generate(model, prompts, 5, teacher=model)
    again = demo.generate(model, prompts, 5)
    for r, digits in zip(first, prompts, strict=True):
        assert r.digits == digits and r.prompt == demo.encode_prompt(digits)
        assert 1 <= len(r.completion) <= min(5, len(digits) + 2) and len(r.logprobs) == len(r.completion)
        assert demo.task.EOS not in r.completion[:-1]  # at most the last token
        assert (r.reward, r.exact) == demo.score(digits, r.completion)
        assert all(lp <= 0 for lp in r.logprobs)
        assert r.kl == pytest.approx([0.0] * len(r.completion), abs=1e-6)  # KL(model‖model) = 0
    assert [r.completion for r in again] == [r.completion for r in first] and again[0].kl == []


def test_policy_forward_gives_logprobs_or_hidden_states_and_the_head():
    model = demo.build_model(demo.QUICK.student, seed=1)
    b = demo.make_bin(demo_rollouts(), [0.0, 0.0, 0.0], "cpu")
    policy = demo.Policy(model)
    with torch.no_grad():
        out = policy(b)
        fused = policy(b, hidden=True)
        torch.testing.assert_close(out.logprobs, demo.packed_logprobs(model, b))
    assert fused.hidden.shape == (sum(b.seq_lens), demo.QUICK.student.hidden)
    assert fused.head_weight is model.lm_head.weight
