"""Normalisation modes: the step's gradient is invariant to packing, order and data-parallel split."""

from __future__ import annotations

import random

import pytest
import torch

from packloss import PackedBatch, PGParams, compute_loss
from packloss.normalize import count_denominators
from packloss.testing import OpCounter, make_archetype, run_gloo

MODES = ("token", "position", "sequence_mean", "sequence_sum", "constant")
CONSTANT = {"rl_scale": 500.0, "ce_scale": 40.0, "ref_kl_scale": 300.0}
OBJECTIVES = {"dppo": PGParams(), "gspo": PGParams(trust_region="gspo", clip_low=0.2, clip_high=0.2)}
REF_KL_COMPONENT = PGParams(advantage="ref_kl", trust_region="ppo_clip", metric_prefix="ref_kl/")


def step_streams(seed: int = 0):
    """A step of 12 sequences with rl, ce and ref_kl components (some sequences all-masked)."""
    lens = [7, 1, 12, 5, 9, 3, 15, 2, 8, 6, 11, 4]
    base = make_archetype("sdft", lens, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ce = (~base.loss_mask & (torch.rand(base.num_tokens, generator=g) < 0.5)).float() * 0.3
    seq_ids = base.seq_ids
    rl_weights = torch.where(seq_ids == 3, 0.0, torch.rand(base.num_tokens, generator=g) + 0.5)
    theta = base.trainer_logprobs.detach().clone().requires_grad_()
    streams = dict(
        inference_logprobs=base.inference_logprobs,
        loss_mask=base.loss_mask,
        advantages=base.advantages,
        ref_logprobs=base.ref_logprobs,
        rl_weights=rl_weights,
        ce_weights=ce,
        ref_kl_weights=base.ref_kl_weights,
    )
    return theta, streams, lens


def micro_batches(theta, streams, lens, order, num_bins):
    """Pack the sequences in ``order`` into ``num_bins`` bins; trainer log-probs gather from ``theta``."""
    starts = [sum(lens[:i]) for i in range(len(lens))]
    chunks = [order[i::num_bins] for i in range(num_bins)]
    bins = []
    for chunk in chunks:
        index = torch.cat([torch.arange(starts[s], starts[s] + lens[s]) for s in chunk])
        bins.append(
            PackedBatch(
                trainer_logprobs=theta.index_select(0, index),
                seq_lens=[lens[s] for s in chunk],
                **{k: v.index_select(0, index) for k, v in streams.items()},
            )
        )
    return bins


def step_gradient(bins, theta, mode, rl):
    scales = CONSTANT if mode == "constant" else count_denominators(bins).scales(mode)
    total = sum(compute_loss(b, rl, normalize=mode, ref_kl=REF_KL_COMPONENT, **scales).loss for b in bins)
    (grad,) = torch.autograd.grad(total, theta, retain_graph=True)
    return grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_gradient_invariant_to_packing_and_order(mode, objective):
    theta, streams, lens = step_streams()
    rng = random.Random(0)
    one_bin = micro_batches(theta, streams, lens, list(range(len(lens))), 1)
    reference = step_gradient(one_bin, theta, mode, OBJECTIVES[objective])
    assert reference.abs().sum() > 0
    for num_bins in (1, 2, 4):
        order = list(range(len(lens)))
        rng.shuffle(order)
        grad = step_gradient(micro_batches(theta, streams, lens, order, num_bins), theta, mode, OBJECTIVES[objective])
        assert torch.allclose(grad, reference, rtol=1e-6, atol=1e-8), (num_bins, (grad - reference).abs().max())


def test_naive_per_micro_batch_token_mean_is_not_invariant():
    """Local denominators (each micro-batch's own token mean, averaged) change with the packing."""
    theta, streams, lens = step_streams()
    grads = []
    for num_bins in (1, 4):
        bins = micro_batches(theta, streams, lens, list(range(len(lens))), num_bins)
        total = sum(compute_loss(b, normalize="token").loss for b in bins) / num_bins
        grads.append(torch.autograd.grad(total, theta)[0])
    assert not torch.allclose(grads[0], grads[1], rtol=1e-3, atol=1e-6)


def _dp_worker(rank, world_size):
    """This rank's share of a 4-bin step, for every objective and mode; counts the all-reduces."""
    theta, streams, lens = step_streams()
    bins = micro_batches(theta, streams, lens, list(range(len(lens))), 4)
    mine = bins[rank::world_size]
    with OpCounter() as counter:
        denominators = count_denominators(mine, all_reduce=True)
    grads = {}
    for objective, rl in OBJECTIVES.items():
        for mode in MODES:
            scales = CONSTANT if mode == "constant" else denominators.scales(mode)
            total = sum(compute_loss(b, rl, normalize=mode, ref_kl=REF_KL_COMPONENT, **scales).loss for b in mine)
            grads[objective, mode] = torch.autograd.grad(total, theta, retain_graph=True)[0]
    all_reduces = sum(n for op, n in counter.ops.items() if "allreduce" in op)
    return grads, all_reduces


def test_gradient_invariant_to_data_parallel_split():
    ranks = run_gloo(_dp_worker, world_size=2, timeout=240)
    assert [all_reduces for _, all_reduces in ranks] == [1, 1]  # one all_reduce counts the whole step
    theta, streams, lens = step_streams()
    one_bin = micro_batches(theta, streams, lens, list(range(len(lens))), 1)
    for objective, rl in OBJECTIVES.items():
        for mode in MODES:
            single = step_gradient(one_bin, theta, mode, rl)
            split = ranks[0][0][objective, mode] + ranks[1][0][objective, mode]
            assert torch.allclose(split, single, rtol=1e-6, atol=1e-8), (objective, mode)


def test_count_denominators_counts():
    a = make_archetype("echo", [4, 1, 6], seed=1)
    b = make_archetype("hot", [3, 5], seed=2)
    d = count_denominators([a, b])
    rl_tokens = a.loss_mask.sum() + b.loss_mask.sum()
    assert d.scale("rl", "token") == rl_tokens
    assert d.scale("ce", "token") == (a.ce_weights != 0).sum()
    assert d.scale("rl", "position") == d.scale("ce", "position") == 19
    seqs = sum(int(m.any()) for bt in (a, b) for m in torch.split(bt.loss_mask, list(bt.seq_lens)))
    assert d.scale("rl", "sequence_mean") == d.scale("rl", "sequence_sum") == seqs
    assert d.scale("ref_kl", "token") == 1  # absent component: clamped to 1
    with pytest.raises(ValueError, match="constant"):
        d.scale("rl", "constant")
    with OpCounter() as counter:
        count_denominators([a, b])
    assert counter.num_syncs == 0


def test_normalize_errors():
    batch = make_archetype("hot", [4, 3])
    with pytest.raises(ValueError, match="normalize\\['rl'\\] must be one of"):
        compute_loss(batch, normalize="mean")
    with pytest.raises(ValueError, match="needs rl_scale"):
        compute_loss(batch, normalize="constant")
    with pytest.raises(ValueError, match="unknown component"):
        compute_loss(batch, normalize={"policy": "token"})
    with pytest.raises(TypeError, match="normalize must be"):
        compute_loss(batch, normalize=1)
