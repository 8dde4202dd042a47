"""Test data: packed bins of the archetypes trainers run, in prime-rl's flat stream layout."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from packloss.core.bin import Component, Plan
from packloss.core.outputs import Outputs
from packloss.core.pg import DPPO, REF_KL
from packloss.core.sft import SFT

__all__ = ["ARCHETYPES", "Streams", "make_archetype", "random_seq_lens"]

ARCHETYPES = ("hot", "weighted_grpo", "opd", "echo", "sdft", "all_empty", "dummy")
"""The packed-bin archetypes (see :func:`make_archetype`): the mixes of components trainers run."""


def random_seq_lens(num_tokens: int, num_seqs: int, generator: torch.Generator) -> list[int]:
    """``num_seqs`` positive lengths of mixed sizes summing to ``num_tokens``, one of them 1 (if S > 1)."""
    if not 1 <= num_seqs <= num_tokens:
        raise ValueError(f"need 1 <= num_seqs <= num_tokens, got {num_seqs} and {num_tokens}")
    if num_seqs == 1:
        return [num_tokens]
    weights = torch.rand(num_seqs - 1, generator=generator) * 3 + 0.25
    rest = num_tokens - 1 - (num_seqs - 1)  # tokens beyond one per sequence and the length-1 sequence
    extra = torch.floor(weights / weights.sum() * rest).to(torch.long)
    extra[0] += rest - int(extra.sum())
    lens = [1] + [1 + int(e) for e in extra]
    perm = torch.randperm(num_seqs, generator=generator).tolist()  # sync-ok: host-side test data
    return [lens[i] for i in perm]


def make_archetype(
    name: str,
    seq_lens: list[int],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    drift: float = 0.35,
) -> Streams:
    """A packed bin of one archetype with enough trainer/inference drift that trust regions fire.

    Every sequence starts with prompt tokens outside ``loss_mask`` (about a third of it); a length-1
    sequence is one completion token. ``trainer_logprobs`` is a leaf that requires grad.

    Archetypes: ``hot`` (no weight streams) · ``weighted_grpo`` (rl weights 0/0.5/1/2, one sequence
    all 0) · ``opd`` (rl weights 0, ref_kl 1 on the mask) · ``echo`` (rl hot path + ce 0.1 on
    observation tokens outside the mask) · ``sdft`` (rl hot path and ref_kl on part of the mask) ·
    ``all_empty`` (every weight 0) · ``dummy`` (mask all False, no streams).
    """
    if name not in ARCHETYPES:
        raise ValueError(f"unknown archetype {name!r}; choose from {ARCHETYPES}")
    g = torch.Generator().manual_seed(seed)
    n = sum(seq_lens)
    p_inf = torch.rand(n, generator=g) * 0.9 + 0.05  # [N]
    p_trn = (p_inf + (torch.rand(n, generator=g) * 2 - 1) * drift).clamp(1e-3, 1.0)
    p_ref = (p_inf + (torch.rand(n, generator=g) * 2 - 1) * drift).clamp(1e-3, 1.0)
    inf, trn, ref = p_inf.log(), p_trn.log(), p_ref.log()
    adv_seq = torch.randn(len(seq_lens), generator=g)
    advantages = torch.repeat_interleave(adv_seq, torch.tensor(seq_lens), output_size=n)
    pos = torch.cat([torch.arange(k) for k in seq_lens])  # [N] position within its sequence
    prompt_len = torch.repeat_interleave(torch.tensor([k // 3 for k in seq_lens]), torch.tensor(seq_lens))
    completion = pos >= prompt_len
    observation = completion & (torch.rand(n, generator=g) < 0.25) & (pos > prompt_len)
    loss_mask = completion & ~observation
    streams: dict[str, torch.Tensor] = {}
    if name == "weighted_grpo":
        choices = torch.tensor([0.0, 0.5, 1.0, 2.0])
        w = choices[torch.randint(0, 4, (n,), generator=g)]
        seq_ids = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
        streams["rl_weights"] = torch.where(seq_ids == 0, 0.0, w)
    elif name == "opd":
        streams["rl_weights"] = torch.zeros(n)
        streams["ref_kl_weights"] = loss_mask.to(torch.float32)
    elif name == "echo":
        streams["ce_weights"] = observation.to(torch.float32) * 0.1
    elif name == "sdft":
        streams["ref_kl_weights"] = (loss_mask & (torch.rand(n, generator=g) < 0.6)).to(torch.float32)
    elif name == "all_empty":
        streams["rl_weights"] = torch.zeros(n)
        streams["ce_weights"] = torch.zeros(n)
        streams["ref_kl_weights"] = torch.zeros(n)
    elif name == "dummy":
        loss_mask = torch.zeros(n, dtype=torch.bool)
    needs_ref = "ref_kl_weights" in streams
    to = dict(dtype=dtype, device=device)
    return Streams(
        trainer_logprobs=trn.to(**to).requires_grad_(),
        inference_logprobs=inf.to(**to),
        loss_mask=loss_mask.to(device),
        seq_lens=tuple(seq_lens),
        advantages=advantages.to(**to),
        ref_logprobs=ref.to(**to) if needs_ref else None,
        **{k: v.to(**to) for k, v in streams.items()},
    )


@dataclass(frozen=True, eq=False)
class Streams:
    """A bin in prime-rl's flat layout: the trainer log-probs and the pre-forward streams (all
    ``[N]``), with one optional weight stream per component (``rl`` always runs on ``loss_mask``;
    ``ce`` and ``ref_kl`` run when their weights are given).

    :meth:`plan` and :meth:`outputs` turn it into the engine's inputs, :meth:`lists` into the
    per-sequence lists of prime-rl's ``compute_loss``.
    """

    trainer_logprobs: Tensor
    inference_logprobs: Tensor
    loss_mask: Tensor
    seq_lens: tuple[int, ...]
    advantages: Tensor | None = None
    ref_logprobs: Tensor | None = None
    rl_weights: Tensor | None = None
    ce_weights: Tensor | None = None
    ref_kl_weights: Tensor | None = None
    old_logprobs: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.trainer_logprobs.shape[0]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def masks(self) -> dict[str, Tensor]:
        """The member mask ``[N]`` of each component the streams switch on."""
        rl = self.loss_mask if self.rl_weights is None else self.loss_mask & (self.rl_weights != 0)
        out = {"rl": rl}
        if self.ce_weights is not None:
            out["ce"] = self.ce_weights != 0
        if self.ref_kl_weights is not None:
            out["ref_kl"] = self.ref_kl_weights != 0
        return out

    def plan(
        self,
        rl: object = DPPO,
        ref_kl: object = REF_KL,
        normalize: str | dict[str, str] = "token",
        constants: dict[str, float] | None = None,
        group_ids: list[int] | None = None,
    ) -> Plan:
        """The engine's plan: components ``rl`` (``rl``), ``ce`` (SFT), ``ref_kl`` (``ref_kl``)."""
        modes = normalize if isinstance(normalize, dict) else dict.fromkeys(("rl", "ce", "ref_kl"), normalize)
        constants = constants or {}

        def comp(name: str, loss: object, mask: Tensor | None, weights: Tensor | None) -> Component:
            return Component(loss, mask, weights, modes.get(name, "token"), constants.get(name))

        components = {"rl": comp("rl", rl, self.loss_mask, self.rl_weights)}
        if self.ce_weights is not None:
            components["ce"] = comp("ce", SFT(), None, self.ce_weights)
        if self.ref_kl_weights is not None:
            components["ref_kl"] = comp("ref_kl", ref_kl, None, self.ref_kl_weights)
        return Plan(
            seq_lens=self.seq_lens,
            components=components,
            rollout_logprobs=self.inference_logprobs,
            ref_logprobs=self.ref_logprobs,
            advantages=self.advantages,
            group_ids=group_ids,
            old_logprobs=self.old_logprobs,
        )

    def outputs(self) -> Outputs:
        return Outputs(logprobs=self.trainer_logprobs)

    def lists(self) -> dict[str, list[Tensor] | None]:
        """prime-rl ``compute_loss``'s list arguments: per-sequence views of the streams (views keep
        ``trainer_logprobs`` one leaf, so gradients of both implementations land in one tensor)."""
        names = ("trainer_logprobs", "inference_logprobs", "ref_logprobs", "advantages", "loss_mask")
        names += ("rl_weights", "ce_weights", "ref_kl_weights")
        split = lambda t: None if t is None else list(torch.split(t, list(self.seq_lens)))
        return {k: split(getattr(self, k)) for k in names}

    def integer_scales(self) -> dict[str, int]:
        """Each component's member count (at least 1) as host ints, as a trainer passes its scales."""
        counts = {f"{k}_scale": max(int(m.sum()), 1) for k, m in self.masks().items()}  # sync-ok: test data
        return {k: counts.get(k, 1) for k in ("rl_scale", "ce_scale", "ref_kl_scale")}

    def replace(self, **changes: Tensor | None) -> Streams:
        return dataclasses.replace(self, **changes)
