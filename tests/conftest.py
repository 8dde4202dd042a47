"""Shared fixtures: the archetypes × loss configs of DESIGN.md §8 and list-of-sequences helpers."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from packloss.batch import PackedBatch
from packloss.compat.prime_rl import DefaultLossConfig, IPOLossConfig
from packloss.testing import ARCHETYPES, make_archetype, random_seq_lens

sys.path.insert(0, str(Path(__file__).parent))  # tests/custom_losses.py is importable by path

CONFIGS = {
    "dppo": DefaultLossConfig(),
    "dppo_high10": DefaultLossConfig(dppo_mask_high=10.0),
    "ipo": IPOLossConfig(),
}


@pytest.fixture(params=ARCHETYPES)
def archetype(request) -> str:
    return request.param


@pytest.fixture(params=sorted(CONFIGS))
def config_name(request) -> str:
    return request.param


def bin_of(archetype: str, num_tokens: int = 257, num_seqs: int = 9, seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed + 1000)
    return make_archetype(archetype, random_seq_lens(num_tokens, num_seqs, g), seed=seed)


def as_lists(batch: PackedBatch) -> dict:
    """The compat/reference keyword arguments: per-sequence views of the bin's streams (views keep
    ``trainer_logprobs`` a single leaf, so both implementations' gradients land in one tensor)."""

    def split(t):
        return None if t is None else list(torch.split(t, list(batch.seq_lens)))

    return dict(
        trainer_logprobs=split(batch.trainer_logprobs),
        inference_logprobs=split(batch.inference_logprobs),
        ref_logprobs=split(batch.ref_logprobs),
        advantages=split(batch.advantages),
        loss_mask=split(batch.loss_mask),
        rl_weights=split(batch.rl_weights),
        ce_weights=split(batch.ce_weights),
        ref_kl_weights=split(batch.ref_kl_weights),
    )


def scales(batch: PackedBatch) -> dict:
    """Integer member counts of each component (clamped to 1), as a trainer would pass them."""
    rl = batch.loss_mask if batch.rl_weights is None else batch.loss_mask & (batch.rl_weights != 0)
    ce = torch.zeros(1) if batch.ce_weights is None else batch.ce_weights != 0
    ref_kl = torch.zeros(1) if batch.ref_kl_weights is None else batch.ref_kl_weights != 0
    return {f"{k}_scale": max(int(m.sum()), 1) for k, m in (("rl", rl), ("ce", ce), ("ref_kl", ref_kl))}


def poison_non_members(batch: PackedBatch) -> tuple[PackedBatch, int, int]:
    """Put trn − inf = +100 on one rl non-member and inf/NaN in unused streams of another token."""
    members = batch.loss_mask.clone()
    for w in (batch.ce_weights, batch.ref_kl_weights):
        if w is not None:
            members |= w != 0
    free = (~members).nonzero().flatten().tolist()
    a, b = free[0], free[-1]
    trn = batch.trainer_logprobs.detach().clone()
    inf = batch.inference_logprobs.clone()
    trn[a], inf[a] = 0.0, -100.0
    adv = batch.advantages.clone()
    adv[b] = float("inf")
    replaced = dict(trainer_logprobs=trn.requires_grad_(), inference_logprobs=inf, advantages=adv)
    inf[b] = float("nan")
    if batch.ref_logprobs is not None:
        ref = batch.ref_logprobs.clone()
        ref[b] = float("nan")
        replaced["ref_logprobs"] = ref
    if batch.rl_weights is not None:
        rl_w = batch.rl_weights.clone()
        rl_w[b] = float("nan")  # b is outside loss_mask, so it is not an rl member either way
        replaced["rl_weights"] = rl_w
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.init}
    return PackedBatch(**{**fields, **replaced}), a, b
