"""Packing rollouts into bins, and each bin's :class:`~packloss.Plan` for a phase of the demo.

A phase ``kind`` trains one component (named :data:`COMPONENT` ``[kind]``) on the answer positions
of its bins, token-normalised:

* ``ce`` → ``sft``: :class:`~packloss.SFT`, the teacher on the reference answers;
* ``ref_kl`` → ``ref_kl``: :data:`~packloss.REF_KL` with the sampling pass's (``rollout_logprobs``)
  and the teacher's (``ref_logprobs``) log-probs of the sampled tokens;
* ``full`` → ``distill``: ``VocabDistill(kind="reverse_kl")`` from the student's hidden states and
  LM head (``Outputs(hidden=, head_weight=)``) and the teacher's (``teacher_hidden``,
  ``teacher_weight``);
* ``rl`` → ``rl``: :data:`~packloss.DPPO` with ``advantages`` and the sampling pass's log-probs.

An empty bin (a rank's padding) gets the same component with an all-False mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from packloss.core.bin import Component, Plan
from packloss.core.packing import position_ids
from packloss.core.pg import DPPO, REF_KL
from packloss.core.recipe import POLICY
from packloss.core.sft import SFT
from packloss.tools.demo.model import Rollout, packed_hidden, packed_logprobs
from packloss.tools.demo.task import PAD
from packloss.vocab.component import VocabDistill

__all__ = ["KINDS", "COMPONENT", "Bin", "make_bin", "empty_bin", "teacher_streams", "make_plan"]

KINDS = ("ce", "ref_kl", "full", "rl")
COMPONENT = {"ce": "sft", "ref_kl": "ref_kl", "full": "distill", "rl": POLICY}
"""The component name (the metric prefix) of each phase kind."""


@dataclass(frozen=True)
class Bin:
    """One packed bin of ``N`` positions. ``input_ids``, ``positions``, ``labels``: ``[1, N]``
    (labels are next tokens within a sequence, ``-100`` at each sequence's last position);
    ``answer``: ``[N]`` bool, positions whose label is a completion token; ``rollout_logprobs``,
    ``advantages``: ``[N]`` float, on the answer positions (0 elsewhere); ``num_real``: real tokens."""

    input_ids: Tensor
    positions: Tensor
    labels: Tensor
    seq_lens: tuple[int, ...]
    answer: Tensor
    rollout_logprobs: Tensor
    advantages: Tensor
    num_real: int


def make_bin(rollouts: Sequence[Rollout], advantages: Sequence[float], device: torch.device | str) -> Bin:
    """Pack ``rollouts`` (with one advantage each) into a :class:`Bin`, sequence after sequence."""
    ids: list[int] = []
    labels: list[int] = []
    answer: list[bool] = []
    inference: list[float] = []
    adv: list[float] = []
    for r, a in zip(rollouts, advantages, strict=True):
        tokens, p = r.tokens, len(r.prompt)
        ids += tokens
        labels += tokens[1:] + [-100]
        # Position t scores token t + 1: the answer is scored at positions p − 1 … len − 2.
        answer += [p - 1 <= t < len(tokens) - 1 for t in range(len(tokens))]
        inference += [0.0] * (p - 1) + list(r.logprobs) + [0.0]
        adv += [float(a)] * len(tokens)
    lens = tuple(len(r.tokens) for r in rollouts)
    return Bin(
        input_ids=torch.tensor([ids], device=device),
        positions=position_ids(lens, device)[None],
        labels=torch.tensor([labels], device=device),
        seq_lens=lens,
        answer=torch.tensor(answer, device=device),
        rollout_logprobs=torch.tensor(inference, device=device),
        advantages=torch.tensor(adv, device=device),
        num_real=sum(lens),
    )


def empty_bin(device: torch.device | str) -> Bin:
    """A one-token bin without members: a rank with fewer micro-batches runs it (its plan's mask is
    all False) so that every rank runs forward and backward the same number of times."""
    one = torch.full((1, 1), PAD, dtype=torch.long, device=device)
    zero = torch.zeros(1, device=device)
    return Bin(one, one * 0, one * 0 - 100, (1,), zero.bool(), zero, zero, 0)


def teacher_streams(kind: str, bins: Sequence[Bin], teacher: nn.Module | None) -> list[Tensor | None]:
    """Per bin, what the teacher contributes before the student's forward: ``ref_kl`` its ``[N]``
    log-probs of the bin's labels, ``full`` its ``[N, H_t]`` last hidden states, else None."""
    if kind not in ("ref_kl", "full"):
        return [None] * len(bins)
    if teacher is None:
        raise ValueError(f"phase kind {kind!r} needs a teacher")
    with torch.no_grad():
        if kind == "ref_kl":
            return [packed_logprobs(teacher, b) for b in bins]
        return [packed_hidden(teacher, b) for b in bins]


def make_plan(kind: str, b: Bin, teacher_stream: Tensor | None = None, teacher: nn.Module | None = None) -> Plan:
    """The bin's plan for phase ``kind``: one component (named :data:`COMPONENT` ``[kind]``) on the
    answer positions, token-normalised, with the pre-forward streams it reads.

    ``teacher_stream``: the teacher's ``[N]`` log-probs (``ref_kl``, shifted by the baseline) or
    ``[N, H_t]`` hidden states (``full``, with ``teacher``'s LM-head weight).
    """
    if kind not in COMPONENT:
        raise ValueError(f"unknown phase kind {kind!r}; choose from {KINDS}")
    name = COMPONENT[kind]
    if kind == "ce":
        return Plan(b.seq_lens, {name: Component(SFT(), mask=b.answer)})
    if kind == "ref_kl":
        return Plan(
            b.seq_lens,
            {name: Component(REF_KL, mask=b.answer)},
            rollout_logprobs=b.rollout_logprobs,
            ref_logprobs=teacher_stream,
        )
    if kind == "full":
        if teacher is None:
            raise ValueError("phase kind 'full' needs the teacher (its LM-head weight)")
        return Plan(
            b.seq_lens,
            {name: Component(VocabDistill(kind="reverse_kl"), mask=b.answer)},
            teacher_hidden=teacher_stream,
            teacher_weight=teacher.lm_head.weight,
        )
    return Plan(  # kind == "rl"
        b.seq_lens,
        {name: Component(DPPO, mask=b.answer)},
        rollout_logprobs=b.rollout_logprobs,
        advantages=b.advantages,
    )
