"""Equivalence of the compat (vectorised) compute_loss with the per-sequence reference."""

from __future__ import annotations

import pytest
import torch

from conftest import CONFIGS, bin_of
from packloss.compat import prime_rl
from packloss.compat.prime_rl import CustomLossConfig
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


def test_selective_log_softmax_and_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g) * 3
    index = torch.randint(0, 11, (2, 5), generator=g)
    expected = torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(prime_rl.selective_log_softmax(logits, index), expected, atol=1e-6)
    p = torch.softmax(logits, -1)
    assert torch.allclose(prime_rl.compute_entropy(logits), -(p * p.log()).sum(-1), atol=1e-5)


def test_shift_tensors():
    t = torch.arange(1, 7).view(2, 3)
    assert prime_rl.shift_tensor_left(t).tolist() == [[2, 3, 0], [5, 6, 0]]
    assert prime_rl.shift_tensor_right(t.float(), pad_value=-1.0).tolist() == [[-1, 1, 2], [-1, 4, 5]]
    assert prime_rl.shift_tensor_right(t).tolist() == [[0, 1, 2], [0, 4, 5]]


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
        packed = prime_rl._cat("trainer_logprobs", lists["trainer_logprobs"], batch.seq_lens)
        assert packed is batch.trainer_logprobs  # the whole row itself: no cat, and no slice to backward
    without_grad = sum(v is not None for k, v in lists.items() if k != "trainer_logprobs")
    assert cats == {1: without_grad, 16: without_grad, 256: without_grad}
    assert totals[1] == totals[16] == totals[256], totals
    copies = {k: [t.clone() for t in v] if v is not None else None for k, v in bin_of("hot").lists().items()}
    with OpCounter() as counter:
        prime_rl.compute_loss(**copies, rl_loss_fn=fn, rl_scale=1, ce_scale=1, ref_kl_scale=1)
    assert counter.ops["aten.cat"] == without_grad + 1  # separate tensors are concatenated (the check can fail)


def _not_one_split(lens: list[int]) -> dict[str, tuple[torch.Tensor, list[torch.Tensor]]]:
    """``(leaf, list)`` pairs whose lists look like one split of a packed row but are not: each must
    get ``cat``'s values and send its gradient where ``cat`` sends it."""
    g = torch.Generator().manual_seed(3)
    leaf = torch.randn(2 * sum(lens), generator=g, requires_grad=True)
    row = leaf * 1.0  # a packed row with a graph, as a model's output is
    cases = {}
    cases["strided"] = (leaf, list(torch.split(row[::2], lens)))  # a view of the row, every other slot
    views = list(torch.split(row[: sum(lens)], lens))
    cases["swapped"] = (leaf, [views[1], views[0], *views[2:]])  # same lengths, wrong order
    cases["copy"] = (leaf, [*views[:-1], views[-1].clone()])  # last one a copy, not a view
    cases["two splits"] = (leaf, [*views[:-1], torch.split(row[sum(lens) :], lens)[-1]])  # last from another split
    offsets = [sum(lens[:i]) for i in range(len(lens))]
    cases["slices"] = (leaf, [row[o : o + n] for o, n in zip(offsets, lens, strict=True)])  # views, no split
    with torch.no_grad():
        own = row[: sum(lens)]  # a view of the row made without grad, then its own leaf
    own.requires_grad_()
    cases["leaf view"] = (own, list(torch.split(own, lens)))
    return cases


@pytest.mark.parametrize("case", ["strided", "swapped", "copy", "two splits", "slices", "leaf view"])
def test_lists_that_are_not_one_split_are_concatenated(case):
    """Only the exact outputs of one split take the no-``cat`` path; anything else gets ``cat``'s values
    and gradient (a wrong shortcut here would be a silent wrong number or a gradient sent elsewhere)."""
    lens = [5, 5, 7]
    leaf, seqs = _not_one_split(lens)[case]
    packed = prime_rl._cat("trainer_logprobs", seqs, tuple(lens))
    expected = torch.cat(seqs)  # what the list holds, element by element
    assert torch.equal(packed, expected)
    weights = torch.arange(1.0, sum(lens) + 1)
    (grad,) = torch.autograd.grad((packed * weights).sum(), leaf, retain_graph=True)
    (grad_expected,) = torch.autograd.grad((expected * weights).sum(), leaf)
    assert torch.equal(grad, grad_expected)


def test_one_split_of_a_squeezed_row_is_read_without_cat():
    """A model's packed row is ``[1, T]``: the split of ``row[0]`` is read as a view of the row too."""
    lens = [3, 1, 4]
    leaf = torch.randn(1, 8, requires_grad=True)
    row = leaf * 2.0  # [1, T]
    seqs = list(torch.split(row[0], lens))
    packed = prime_rl._cat("trainer_logprobs", seqs, tuple(lens))
    assert packed._base is row and torch.equal(packed, row[0])
    (grad,) = torch.autograd.grad((packed * torch.arange(8.0)).sum(), leaf)
    assert torch.equal(grad, 2.0 * torch.arange(8.0)[None])
    with pytest.raises(ValueError, match=r"trainer_logprobs\[1\] must have shape \(2,\), got \(1,\)"):  # other lengths
        prime_rl._cat("trainer_logprobs", seqs, (3, 2, 3))


def test_list_elements_of_the_wrong_shape_or_type_are_refused():
    lens = (3, 4)
    views = list(torch.split(torch.arange(7.0), list(lens)))
    with pytest.raises(ValueError, match=r"advantages\[1\] must have shape \(4,\), got \(1, 4\)"):
        prime_rl._cat("advantages", [views[0], views[1].view(1, 4)], lens)
    with pytest.raises(TypeError, match=r"advantages\[0\] must be a torch.Tensor, got list"):
        prime_rl._cat("advantages", [[0.0, 1.0, 2.0], views[1]], lens)
    with pytest.raises(ValueError, match="advantages holds 1 sequences, trainer_logprobs 2"):
        prime_rl._cat("advantages", views[:1], lens)


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
    with pytest.raises(ValueError, match="constant must be a number or a 0-d"):
        prime_rl.compute_loss(**lists, **{**ints, "rl_scale": torch.ones(2)}, rl_loss_fn=fn)
    with pytest.raises(ValueError, match="constant must be a finite number > 0"):
        prime_rl.compute_loss(**lists, **{**ints, "rl_scale": float("inf")}, rl_loss_fn=fn)
    with pytest.raises(ValueError, match="trainer_logprobs must be a non-empty list"):
        prime_rl.compute_loss(**{**lists, "trainer_logprobs": []}, **ints, rl_loss_fn=fn)


def test_trainer_lengths_come_from_the_list_unless_it_is_the_whole_split():
    """The split's own sizes stand in for a scan of ``trainer_logprobs`` only when the list is every
    output of that split: a prefix of it has its own lengths and total."""
    row = torch.randn(12, requires_grad=True) * 1.0
    whole, lens = prime_rl._packed_trainer(list(torch.split(row, [3, 4, 5])))
    assert lens == (3, 4, 5) and whole is row  # the whole row is used as it is
    prefix, lens = prime_rl._packed_trainer(list(torch.split(row, [3, 4, 5])[:2]))
    assert lens == (3, 4) and torch.equal(prefix, row[:7])
    with pytest.raises(TypeError, match=r"trainer_logprobs\[1\] must be a torch.Tensor, got list"):
        prime_rl._packed_trainer([row[:3], [0.0]])


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
