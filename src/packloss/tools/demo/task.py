"""The demo's verifiable task: reverse a string of digits. Tokens, prompts, answers and the reward."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "PAD",
    "BOS",
    "SEP",
    "EOS",
    "DIGIT0",
    "VOCAB_SIZE",
    "encode_prompt",
    "encode_target",
    "decode",
    "score",
    "Task",
]

PAD, BOS, SEP, EOS = 0, 1, 2, 3
DIGIT0 = 4  # token of digit d is DIGIT0 + d
VOCAB_SIZE = DIGIT0 + 10
_SYMBOLS = {PAD: "_", BOS: "^", SEP: ":", EOS: "$"}


def encode_prompt(digits: str) -> list[int]:
    """``^ d_1 … d_n :`` as token ids."""
    return [BOS, *(DIGIT0 + int(c) for c in digits), SEP]


def encode_target(digits: str) -> list[int]:
    """The answer ``d_n … d_1 $`` as token ids."""
    return [*(DIGIT0 + int(c) for c in reversed(digits)), EOS]


def decode(tokens: Sequence[int]) -> str:
    """Token ids back to text (``^`` BOS, ``:`` SEP, ``$`` EOS, ``_`` PAD)."""
    return "".join(_SYMBOLS.get(t, str(t - DIGIT0)) for t in tokens)


def score(digits: str, completion: Sequence[int]) -> tuple[float, bool]:
    """``(reward, exact)``: the fraction of the ``n + 1`` answer positions that are right, and whether
    the completion is exactly the answer."""
    target = encode_target(digits)
    right = sum(1 for i, t in enumerate(target) if i < len(completion) and completion[i] == t)
    return right / len(target), list(completion) == target


@dataclass(frozen=True)
class Task:
    """Digit strings of ``min_digits..max_digits`` and a fixed held-out evaluation set."""

    min_digits: int
    max_digits: int
    eval_prompts: tuple[str, ...]

    @classmethod
    def make(cls, min_digits: int, max_digits: int, num_eval: int, seed: int) -> Task:
        rng = random.Random(f"eval-{seed}")
        prompts: dict[str, None] = {}
        while len(prompts) < num_eval:
            prompts[_digits(rng, min_digits, max_digits)] = None
        return cls(min_digits, max_digits, tuple(prompts))

    def sample(self, rng: random.Random, n: int) -> list[str]:
        """``n`` training prompts, none of them in the evaluation set."""
        held_out = set(self.eval_prompts)
        out: list[str] = []
        while len(out) < n:
            digits = _digits(rng, self.min_digits, self.max_digits)
            if digits not in held_out:
                out.append(digits)
        return out

    @property
    def max_new_tokens(self) -> int:
        """Generation budget: the longest answer plus one token (to see a missing ``$``)."""
        return self.max_digits + 2


def _digits(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(str(rng.randrange(10)) for _ in range(rng.randint(lo, hi)))
