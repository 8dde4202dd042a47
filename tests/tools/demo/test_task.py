"""packloss.tools.demo.task: prompts and answers as tokens and back, the reward, the held-out evaluation
set and the training prompts that avoid it."""

from __future__ import annotations

import random

from packloss.tools import demo
from packloss.tools.demo import task


def test_task_scoring():
    assert demo.decode(demo.encode_prompt("305") + demo.encode_target("305")) == "^305:503$"
    assert demo.score("305", demo.encode_target("305")) == (1.0, True)
    assert demo.score("305", demo.encode_target("305")[:3]) == (0.75, False)  # no "$"
    assert demo.score("305", demo.encode_target("355")) == (0.75, False)


def test_prompts_and_answers_round_trip_through_the_tokens():
    for digits in ("0", "42", "9081726354"):
        tokens = demo.encode_prompt(digits) + demo.encode_target(digits)
        assert demo.decode(tokens) == f"^{digits}:{digits[::-1]}$"
        assert all(0 <= t < task.VOCAB_SIZE for t in tokens)
    assert demo.decode([task.PAD, task.DIGIT0 + 7]) == "_7"


def test_the_reward_counts_right_answer_positions():
    target = demo.encode_target("12")
    assert demo.score("12", []) == (0.0, False)
    assert demo.score("12", [*target, task.PAD]) == (1.0, False)  # every position right, but not exact
    assert demo.score("12", [target[2], target[0], target[1]]) == (0.0, False)  # every token one place off


def test_the_held_out_set_is_fixed_and_never_sampled():
    t = demo.Task.make(3, 5, 20, seed=1)
    assert t == demo.Task.make(3, 5, 20, seed=1) and t != demo.Task.make(3, 5, 20, seed=2)
    assert len(set(t.eval_prompts)) == 20 and all(3 <= len(d) <= 5 and d.isdigit() for d in t.eval_prompts)
    sampled = t.sample(random.Random(0), 200)
    assert len(sampled) == 200 and not set(sampled) & set(t.eval_prompts)
    assert all(3 <= len(d) <= 5 for d in sampled)
    assert t.max_new_tokens == 7  # the longest answer (5 digits and "$") plus one
