"""prime-rl's #2951-era loss module (``packloss.compat.prime_rl``): equal to the per-sequence reference,
its configs matched by their fields, and the lists read as one packed bin."""

from __future__ import annotations

import pytest
import torch

from conftest import CONFIGS, bin_of
from packloss.integrations.prime_rl import legacy as prime_rl
from packloss.integrations.prime_rl.legacy import CustomLossConfig
from packloss.integrations.prime_rl.lists import packed_trainer
from packloss.testing import ARCHETYPES, OpCounter, reference

DPPO_KEYS = {
    "masked_mismatch_kl",
    "unmasked_mismatch_kl",
    "is_masked",
    "is_masked_low",
    "is_masked_high",
    "masked_advantage_positive",
    "masked_advantage_negative",
}


IPO_KEYS = {"masked_mismatch_kl", "unmasked_mismatch_kl", "is_masked"}


REF_KL_KEYS = {"ref_kl/masked_mismatch_kl", "ref_kl/unmasked_mismatch_kl", "ref_kl/is_masked", "ref_kl"}


def expected_keys(config_name: str, batch) -> set[str]:
    keys = set(IPO_KEYS if config_name == "ipo" else DPPO_KEYS)
    if batch.ce_weights is not None:
        keys.add("nll")
    if batch.ref_kl_weights is not None:
        keys |= REF_KL_KEYS
    return keys


def run_both(batch, new_fn, ref_fn):
    trn = batch.trainer_logprobs
    kwargs = dict(**batch.lists(), **batch.integer_scales())
    loss_new, metrics_new = prime_rl.compute_loss(**kwargs, rl_loss_fn=new_fn)
    (grad_new,) = torch.autograd.grad(loss_new, trn)
    loss_ref, metrics_ref = reference.compute_loss(**kwargs, rl_loss_fn=ref_fn)
    (grad_ref,) = torch.autograd.grad(loss_ref, trn)
    return (loss_new, metrics_new, grad_new), (loss_ref, metrics_ref, grad_ref)


def assert_loss_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a.item(), b.item())


@pytest.mark.parametrize("seed", [0, 1])
def test_compat_equals_reference(archetype, config_name, seed):
    batch = bin_of(archetype, seed=seed)
    config = CONFIGS[config_name]
    (loss, metrics, grad), (loss_ref, metrics_ref, grad_ref) = run_both(
        batch, prime_rl.setup_rl_loss_fn(config), reference.setup_rl_loss_fn(config)
    )
    assert torch.equal(grad, grad_ref)
    assert_loss_close(loss, loss_ref)
    assert set(metrics) == expected_keys(config_name, batch)
    assert set(metrics_ref) <= set(metrics)
    assert all(v.shape == (1,) for v in metrics.values())
    if archetype in ("all_empty", "dummy"):
        assert all(v.item() == 0 for v in metrics.values())


@pytest.mark.parametrize("archetype", ["hot", "weighted_grpo", "echo", "sdft"])
def test_trust_regions_fire_and_metrics_are_token_weighted(archetype, config_name):
    """The harness is only meaningful if tokens are actually dropped; the 1-element metric is the
    member-weighted mean of the reference's per-sequence values."""
    batch = bin_of(archetype)
    config = CONFIGS[config_name]
    (_, metrics, _), (_, metrics_ref, _) = run_both(
        batch, prime_rl.setup_rl_loss_fn(config), reference.setup_rl_loss_fn(config)
    )
    assert metrics["is_masked"].item() > 0
    if config_name == "dppo_high10":  # only the low side can fire with a high threshold of 10
        assert metrics["is_masked_high"].item() == 0 and metrics["is_masked_low"].item() > 0
    rl_mask = batch.loss_mask if batch.rl_weights is None else batch.loss_mask & (batch.rl_weights != 0)
    per_seq = torch.stack([m.sum() for m in torch.split(rl_mask, list(batch.seq_lens))]).float()
    if batch.rl_weights is not None:  # the reference skips sequences with no rl members
        per_seq = per_seq[per_seq > 0]
    weighted = (metrics_ref["is_masked"] * per_seq).sum() / per_seq.sum()
    assert torch.allclose(metrics["is_masked"][0], weighted, atol=1e-6)


def test_ref_kl_component_trust_region_fires():
    batch = bin_of("opd")
    (_, metrics, grad), (_, _, grad_ref) = run_both(
        batch, prime_rl.setup_rl_loss_fn(CONFIGS["dppo"]), reference.setup_rl_loss_fn(CONFIGS["dppo"])
    )
    assert metrics["ref_kl/is_masked"].item() > 0.05
    assert torch.equal(grad, grad_ref)


@pytest.mark.parametrize("archetype", ARCHETYPES)
def test_custom_additive_loss_equals_reference(archetype):
    config = CustomLossConfig(import_path="custom_losses.additive_loss", kwargs={"coef": 0.5})
    batch = bin_of(archetype, seed=3)
    (loss, metrics, grad), (loss_ref, _, grad_ref) = run_both(
        batch, prime_rl.setup_rl_loss_fn(config), reference.setup_rl_loss_fn(config)
    )
    assert torch.equal(grad, grad_ref)
    assert_loss_close(loss, loss_ref)
    assert "custom_ratio" in metrics


def test_non_additive_custom_loss_differs_and_layout_fixes_it():
    """Called once per bin, a per-call mean changes meaning; the layout fields make it exact."""
    batch = bin_of("hot", seed=4)
    naive = CustomLossConfig(import_path="custom_losses:per_sequence_mean_naive")
    segmented = CustomLossConfig(import_path="custom_losses:per_sequence_mean_segmented")
    (loss, _, _), (loss_ref, _, grad_ref) = run_both(
        batch, prime_rl.setup_rl_loss_fn(naive), reference.setup_rl_loss_fn(naive)
    )
    assert not torch.allclose(loss, loss_ref, rtol=1e-3)
    (loss, _, grad), _ = run_both(batch, prime_rl.setup_rl_loss_fn(segmented), reference.setup_rl_loss_fn(naive))
    assert_loss_close(loss, loss_ref)
    assert torch.allclose(grad, grad_ref, rtol=1e-6, atol=1e-9)


def test_constant_custom_loss_is_still_backward_able():
    config = CustomLossConfig(import_path="custom_losses.constant_loss")
    batch = bin_of("dummy")
    kwargs = dict(**batch.lists(), **batch.integer_scales())
    loss, _ = prime_rl.compute_loss(**kwargs, rl_loss_fn=prime_rl.setup_rl_loss_fn(config))
    loss.backward()
    assert torch.equal(batch.trainer_logprobs.grad, torch.zeros_like(batch.trainer_logprobs))


def test_setup_rl_loss_fn_rejects_bad_config():
    with pytest.raises(TypeError, match="loss_config"):
        prime_rl.setup_rl_loss_fn({"type": "default"})
    with pytest.raises(ValueError, match="import_path"):
        prime_rl.setup_rl_loss_fn(CustomLossConfig(import_path="nomodule"))
    with pytest.raises(ValueError, match="cannot import"):
        prime_rl.setup_rl_loss_fn(CustomLossConfig(import_path="custom_losses.missing"))


def test_default_configs_match_prime_rl():
    assert prime_rl.DefaultLossConfig() == prime_rl.DefaultLossConfig(0.2, 0.2, 1.0, 1e-3)
    assert prime_rl.IPOLossConfig().ipo_threshold == 0.1


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_configs_are_matched_by_fields_not_by_class(config_name):
    """A config of another class with the same fields (prime-rl's own pydantic models) works."""
    config = CONFIGS[config_name]
    foreign = type("DefaultLossConfig", (), {k: getattr(config, k) for k in config.__dataclass_fields__})()
    batch = bin_of("weighted_grpo", seed=2)
    (_, _, grad), (_, _, grad_ref) = run_both(
        batch, prime_rl.setup_rl_loss_fn(foreign), reference.setup_rl_loss_fn(config)
    )
    assert torch.equal(grad, grad_ref)


_METADATA_OPS = {"aten.view", "aten.expand", "aten.as_strided", "aten.alias", "aten.slice", "aten.narrow"}


def test_split_lists_cost_the_same_at_any_sequence_count():
    """The trainer's split log-probs are read as their packed row (no ``cat``, no per-sequence edge in
    the backward); the lists without grad are one ``cat`` each: the op count is flat in the sequences."""
    totals, cats = {}, {}
    for num_seqs in (1, 16, 256):
        batch = bin_of("hot", num_tokens=2048, num_seqs=num_seqs)
        lists = batch.lists()
        kwargs = dict(**lists, **batch.integer_scales())
        fn = prime_rl.setup_rl_loss_fn(CONFIGS["dppo"])
        with OpCounter() as counter:
            loss, _ = prime_rl.compute_loss(**kwargs, rl_loss_fn=fn)
            loss.backward()
        cats[num_seqs] = counter.ops["aten.cat"]
        totals[num_seqs] = sum(n for op, n in counter.ops.items() if op not in _METADATA_OPS)
        packed = packed_trainer(lists["trainer_logprobs"])[0]
        assert packed is batch.trainer_logprobs  # the whole row itself: no cat, and no slice to backward
    without_grad = sum(v is not None for k, v in lists.items() if k != "trainer_logprobs")
    assert cats == {1: without_grad, 16: without_grad, 256: without_grad}
    assert totals[1] == totals[16] == totals[256], totals
    copies = {k: [t.clone() for t in v] if v is not None else None for k, v in bin_of("hot").lists().items()}
    with OpCounter() as counter:
        prime_rl.compute_loss(**copies, rl_loss_fn=fn, rl_scale=1, ce_scale=1, ref_kl_scale=1)
    assert counter.ops["aten.cat"] == without_grad + 1  # separate tensors are concatenated (the check can fail)


def test_tensor_scales_equal_int_scales_and_bad_inputs_name_the_argument():
    batch = bin_of("echo", seed=6)
    fn = prime_rl.setup_rl_loss_fn(CONFIGS["dppo"])
    ints = batch.integer_scales()
    loss_int, _ = prime_rl.compute_loss(**batch.lists(), **ints, rl_loss_fn=fn)
    tensors = {k: torch.tensor(float(v)) for k, v in ints.items()}
    loss_tensor, _ = prime_rl.compute_loss(**batch.lists(), **tensors, rl_loss_fn=fn)
    assert torch.equal(loss_int, loss_tensor)
    lists = batch.lists()
    with pytest.raises(ValueError, match="inference_logprobs is required"):
        prime_rl.compute_loss(**{**lists, "inference_logprobs": None}, **ints, rl_loss_fn=fn)
    with pytest.raises(ValueError, match="rl_scale must be a number or a 0-d"):
        prime_rl.compute_loss(**lists, **{**ints, "rl_scale": torch.ones(2)}, rl_loss_fn=fn)
    with pytest.raises(ValueError, match="rl_scale must be finite"):
        prime_rl.compute_loss(**lists, **{**ints, "rl_scale": float("inf")}, rl_loss_fn=fn)
    with pytest.raises(ValueError, match="trainer_logprobs must be a non-empty list"):
        prime_rl.compute_loss(**{**lists, "trainer_logprobs": []}, **ints, rl_loss_fn=fn)


def test_prime_rl_call_site_tuples_of_a_squeezed_row_take_the_split_path():
    """prime-rl's trainer passes ``out["logprobs"].squeeze().split(sequence_lengths)`` (a tuple of views
    of a ``[1, T]`` row) and the other streams alike: the trainer stream needs no ``cat`` and the
    gradient equals the per-sequence reference's bit for bit."""
    batch = bin_of("opd", num_tokens=300, num_seqs=12)
    lens = list(batch.seq_lens)
    row = (batch.trainer_logprobs * 1.0).view(1, -1)  # [1, T], a model output with a graph
    streams = {k: v for k, v in batch.lists().items() if k != "trainer_logprobs"}
    tuples = {
        k: None if v is None else tuple(torch.cat(v).view(1, -1).squeeze().split(lens)) for k, v in streams.items()
    }
    trn = row.squeeze().split(lens)
    fn, ref_fn = prime_rl.setup_rl_loss_fn(CONFIGS["dppo"]), reference.setup_rl_loss_fn(CONFIGS["dppo"])
    with OpCounter() as counter:
        loss, _ = prime_rl.compute_loss(trn, **tuples, rl_loss_fn=fn, **batch.integer_scales())
    assert counter.ops["aten.cat"] == sum(v is not None for v in tuples.values())  # none for the trainer
    (grad,) = torch.autograd.grad(loss, batch.trainer_logprobs, retain_graph=True)  # the row's graph is shared
    loss_ref, _ = reference.compute_loss(list(trn), **tuples, rl_loss_fn=ref_fn, **batch.integer_scales())
    (grad_ref,) = torch.autograd.grad(loss_ref, batch.trainer_logprobs)
    assert torch.equal(grad, grad_ref)
