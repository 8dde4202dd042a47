"""Native compute_loss: zero syncs, op count flat in sequences, NaN safety, empty bins, metrics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import CONFIGS, as_lists, bin_of, poison_non_members, scales
from packloss import DPPO, IPO, REF_KL, PackedBatch, PGParams, compute_loss, merge_metrics
from packloss.compat import prime_rl
from packloss.testing import ARCHETYPES, OpCounter

RL_PARAMS = {"dppo": DPPO, "dppo_high10": PGParams(dppo_mask_high=10.0), "ipo": IPO}


def run_counted(batch: PackedBatch, rl=DPPO, **kwargs) -> OpCounter:
    """Count the ops of forward+backward (the batch and scales are built before, as a trainer would)."""
    with OpCounter() as counter:
        compute_loss(batch, rl, **kwargs).loss.backward()
    return counter


def test_native_has_no_syncs(archetype, config_name):
    batch = bin_of(archetype)
    counter = run_counted(batch, RL_PARAMS[config_name], **scales(batch))
    assert counter.num_syncs == 0, counter.syncs
    assert counter.ops["aten.exp"] > 0  # the counter really saw the forward
    assert counter.ops["aten.exp_backward"] + counter.ops["aten.mul"] > 0


def test_compat_has_no_syncs(archetype, config_name):
    batch = bin_of(archetype)
    kwargs = dict(**as_lists(batch), **scales(batch), rl_loss_fn=prime_rl.setup_rl_loss_fn(CONFIGS[config_name]))
    with OpCounter() as counter:
        loss, _ = prime_rl.compute_loss(**kwargs)
        loss.backward()
    assert counter.num_syncs == 0, counter.syncs


def test_op_count_independent_of_sequence_count(archetype, config_name):
    counts = {}
    for num_seqs in (1, 16, 256):
        batch = bin_of(archetype, num_tokens=2048, num_seqs=num_seqs)
        counts[num_seqs] = run_counted(batch, RL_PARAMS[config_name], per_sequence_metrics=True).total
    assert counts[1] == counts[16] == counts[256], counts


def test_op_counter_detects_syncs():
    """The counter must be able to fail: a reference-style loop is full of syncs."""
    from packloss import reference

    batch = bin_of("weighted_grpo")
    with OpCounter() as counter:
        loss, _ = reference.compute_loss(
            **as_lists(batch), **scales(batch), rl_loss_fn=reference.setup_rl_loss_fn(prime_rl.DefaultLossConfig())
        )
        loss.backward()
    assert counter.syncs["aten._local_scalar_dense"] > 0
    assert counter.syncs["aten.index"] > 0
    x = torch.arange(5.0)
    with OpCounter() as counter:
        x[x > 2].sum().item()
        torch.nonzero(x)
    assert counter.num_syncs >= 3


@pytest.mark.parametrize("rl", [DPPO, IPO, PGParams(dppo_mask_high=10.0)], ids=["dppo", "ipo", "dppo_high10"])
def test_non_member_extremes_change_nothing(archetype, rl):
    clean = bin_of(archetype)
    poisoned, a, _ = poison_non_members(clean)
    assert (poisoned.trainer_logprobs - poisoned.inference_logprobs)[a].item() == 100.0
    out_clean = compute_loss(clean, rl, **scales(clean))
    out_poisoned = compute_loss(poisoned, rl, **scales(clean))
    (g_clean,) = torch.autograd.grad(out_clean.loss, clean.trainer_logprobs)
    (g_poisoned,) = torch.autograd.grad(out_poisoned.loss, poisoned.trainer_logprobs)
    assert torch.isfinite(out_poisoned.loss) and torch.isfinite(g_poisoned).all()
    assert torch.equal(out_clean.loss, out_poisoned.loss)
    assert torch.equal(g_clean, g_poisoned)
    for key, value in out_clean.metrics.items():
        assert torch.equal(value, out_poisoned.metrics[key]), key


@pytest.mark.parametrize("archetype", ["all_empty", "dummy"])
@pytest.mark.parametrize(
    "rl", [DPPO, IPO, dataclasses.replace(REF_KL, metric_prefix="rl/")], ids=["dppo", "ipo", "ref_kl"]
)
def test_empty_bins_return_zero_and_zero_gradient(archetype, rl):
    batch = bin_of(archetype)
    if rl.advantage == "ref_kl" and batch.ref_logprobs is None:
        batch = dataclasses.replace(batch, ref_logprobs=batch.inference_logprobs)
    result = compute_loss(batch, rl)
    result.loss.backward()
    assert result.loss.item() == 0.0
    assert batch.trainer_logprobs.grad is not None
    assert torch.equal(batch.trainer_logprobs.grad, torch.zeros_like(batch.trainer_logprobs))


def test_default_scale_is_member_count_and_scales_divide():
    batch = bin_of("echo")
    base = compute_loss(batch, rl_scale=1, ce_scale=1)
    rl_only = compute_loss(dataclasses.replace(batch, ce_weights=None), rl_scale=1)
    ce_sum = base.loss - rl_only.loss
    rl_members = batch.loss_mask.sum().item()
    ce_members = (batch.ce_weights != 0).sum().item()
    default = compute_loss(batch)
    expected = rl_only.loss / rl_members + ce_sum / ce_members
    assert torch.allclose(default.loss, expected, rtol=1e-5)
    halved = compute_loss(batch, rl_scale=2, ce_scale=2)
    assert torch.allclose(halved.loss, base.loss / 2, rtol=1e-6)


def test_metrics_carry_counts_and_merge_exactly():
    """Two micro-batches merged with their counts equal one call over both."""
    a, b = bin_of("hot", seed=1), bin_of("hot", seed=2)
    both = PackedBatch(
        trainer_logprobs=torch.cat([a.trainer_logprobs, b.trainer_logprobs]),
        inference_logprobs=torch.cat([a.inference_logprobs, b.inference_logprobs]),
        loss_mask=torch.cat([a.loss_mask, b.loss_mask]),
        advantages=torch.cat([a.advantages, b.advantages]),
        seq_lens=a.seq_lens + b.seq_lens,
    )
    merged, counts = merge_metrics([compute_loss(a), compute_loss(b)])
    whole = compute_loss(both)
    assert merged.keys() == whole.metrics.keys()
    for key in whole.metrics:
        assert torch.allclose(merged[key], whole.metrics[key], atol=1e-6), key
        assert torch.equal(counts[key], whole.counts[key]), key
    assert counts["is_masked"].item() == both.loss_mask.sum().item()


def test_per_sequence_metrics_match_per_sequence_calls():
    batch = bin_of("weighted_grpo", seed=5)
    result = compute_loss(batch, per_sequence_metrics=True)
    assert result.metrics["is_masked"].shape == (batch.num_seqs,)
    splits = as_lists(batch)
    for s in range(batch.num_seqs):
        one = PackedBatch(
            trainer_logprobs=splits["trainer_logprobs"][s],
            inference_logprobs=splits["inference_logprobs"][s],
            loss_mask=splits["loss_mask"][s],
            advantages=splits["advantages"][s],
            rl_weights=splits["rl_weights"][s],
            seq_lens=[batch.seq_lens[s]],
        )
        alone = compute_loss(one)
        for key, value in alone.metrics.items():
            assert torch.allclose(result.metrics[key][s], value, atol=1e-6), (key, s)
            assert result.counts[key][s] == alone.counts[key], (key, s)


def test_custom_loss_sees_whole_bin_and_layout():
    seen = []

    def spy(inputs):
        seen.append((inputs.trainer_logprobs.shape[0], inputs.num_seqs, inputs.cu_seqlens.tolist()))
        return DPPO(inputs)

    batch = bin_of("hot")
    compute_loss(batch, spy)
    assert seen == [(batch.num_tokens, batch.num_seqs, batch.cu_seqlens.tolist())]


def test_bad_arguments_raise_clear_errors():
    batch = bin_of("hot")
    with pytest.raises(TypeError, match="batch"):
        compute_loss({"trainer_logprobs": batch.trainer_logprobs})
    with pytest.raises(ValueError, match="rl_scale"):
        compute_loss(batch, rl_scale=0)
    with pytest.raises(TypeError, match="ce_scale"):
        compute_loss(batch, ce_scale="10")
    with pytest.raises(TypeError, match="rl"):
        compute_loss(batch, "dppo")
    with pytest.raises(TypeError, match="LossOutputs"):
        compute_loss(batch, lambda inputs: inputs.trainer_logprobs.sum())
    with pytest.raises(ValueError, match="produced by two components"):
        compute_loss(bin_of("sdft"), REF_KL)
    no_adv = dataclasses.replace(batch, advantages=None)
    with pytest.raises(ValueError, match="advantages"):
        compute_loss(no_adv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_compute_in_float32(dtype):
    batch = bin_of("hot")
    low = dataclasses.replace(
        batch,
        trainer_logprobs=batch.trainer_logprobs.detach().to(dtype).requires_grad_(),
        inference_logprobs=batch.inference_logprobs.to(dtype),
        advantages=batch.advantages.to(dtype),
    )
    result = compute_loss(low)
    result.loss.backward()
    assert result.loss.dtype == torch.float32
    assert low.trainer_logprobs.grad.dtype == dtype
    up = dataclasses.replace(
        batch,
        trainer_logprobs=low.trainer_logprobs.detach().float().requires_grad_(),
        inference_logprobs=low.inference_logprobs.float(),
        advantages=low.advantages.float(),
    )
    assert torch.equal(compute_loss(up).loss, result.loss)


def test_all_archetypes_listed():
    assert set(ARCHETYPES) == {"hot", "weighted_grpo", "opd", "echo", "sdft", "all_empty", "dummy"}


def test_compute_loss_compiles_with_fullgraph():
    """torch.compile(fullgraph=True) traces the whole engine (no graph break, no sync) and agrees."""
    batch = bin_of("sdft", num_tokens=300, num_seqs=7, seed=9)
    rl = PGParams(trust_region="gspo", metric_prefix="rl/")
    compiled = torch.compile(lambda b: compute_loss(b, rl, normalize="sequence_mean").loss, fullgraph=True)
    loss = compiled(batch)
    (grad,) = torch.autograd.grad(loss, batch.trainer_logprobs)
    eager = compute_loss(batch, rl, normalize="sequence_mean").loss
    (grad_eager,) = torch.autograd.grad(eager, batch.trainer_logprobs)
    assert torch.allclose(loss, eager, rtol=1e-6)
    assert torch.allclose(grad, grad_eager, rtol=1e-5, atol=1e-8)


def test_compiled_engine_does_not_recompile_per_packing():
    """After dynamo's one automatic-dynamic recompile, new sequence counts reuse the graph."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    compiled = torch.compile(lambda b: compute_loss(b).loss)
    graphs = []
    for num_seqs in (1, 16, 64, 256):
        compiled(bin_of("hot", num_tokens=512, num_seqs=num_seqs)).backward()
        graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[1], graphs
