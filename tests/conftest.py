"""Shared fixtures: the archetypes × prime-rl loss configs, and bins in prime-rl's flat layout."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from packloss.compat.prime_rl import DefaultLossConfig, IPOLossConfig
from packloss.testing import ARCHETYPES, Streams, make_archetype, random_seq_lens

sys.path.insert(0, str(Path(__file__).parent))  # tests/custom_losses.py and conftest are importable

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


def bin_of(archetype: str, num_tokens: int = 257, num_seqs: int = 9, seed: int = 0, **kwargs) -> Streams:
    g = torch.Generator().manual_seed(seed + 1000)
    return make_archetype(archetype, random_seq_lens(num_tokens, num_seqs, g), seed=seed, **kwargs)


def poison_non_members(streams: Streams) -> tuple[Streams, int, int]:
    """Put trn − inf = +100 on one non-member and inf/NaN in unused streams of another token."""
    members = torch.zeros_like(streams.loss_mask)
    for m in streams.masks().values():
        members |= m
    members |= streams.loss_mask
    free = (~members).nonzero().flatten().tolist()
    a, b = free[0], free[-1]
    trn = streams.trainer_logprobs.detach().clone()
    inf = streams.inference_logprobs.clone()
    trn[a], inf[a] = 0.0, -100.0
    adv = streams.advantages.clone()
    adv[b] = float("inf")
    inf[b] = float("nan")
    replaced = dict(trainer_logprobs=trn.requires_grad_(), inference_logprobs=inf, advantages=adv)
    if streams.ref_logprobs is not None:
        ref = streams.ref_logprobs.clone()
        ref[b] = float("nan")
        replaced["ref_logprobs"] = ref
    if streams.rl_weights is not None:
        rl_w = streams.rl_weights.clone()
        rl_w[b] = float("nan")  # b is outside loss_mask, so it is not an rl member either way
        replaced["rl_weights"] = rl_w
    return streams.replace(**replaced), a, b
