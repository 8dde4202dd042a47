"""packloss.core.engine: compute_loss with zero syncs, op count flat in sequences, NaN safety, empty bins,
steps of every kind, metrics, compile."""

from __future__ import annotations

import pytest
import torch

from conftest import CONFIGS, bin_of, poison_non_members, toy, with_old
from packloss import (
    DPPO,
    IPO,
    REF_KL,
    SFT,
    Component,
    ComponentOutput,
    Entropy,
    Outputs,
    Plan,
    PolicyGradient,
    VocabDistill,
    compute_loss,
    count_denominators,
    merge_metrics,
)
from packloss.compat import prime_rl
from packloss.core.trust_regions import DPPOMask
from packloss.testing import OpCounter, make_archetype

DPPO_HIGH10 = PolicyGradient(DPPOMask(0.2, 10.0), ratio="rollout", penalties=DPPO.penalties)
RL_PARAMS = {"dppo": DPPO, "dppo_high10": DPPO_HIGH10, "ipo": IPO}


def run_counted(plan: Plan, outputs: Outputs, **kwargs) -> OpCounter:
    """Count forward+backward (plan and denominators are built before, as a trainer would)."""
    with OpCounter() as counter:
        compute_loss(plan, outputs, **kwargs).loss.backward()
    return counter


def test_native_has_no_syncs(archetype, config_name):
    streams = bin_of(archetype)
    plan = streams.plan(RL_PARAMS[config_name])
    den = count_denominators([plan])
    counter = run_counted(plan, streams.outputs(), denominators=den)
    assert counter.num_syncs == 0, counter.syncs
    assert counter.ops["aten.exp"] > 0  # the counter really saw the forward


def test_compat_has_no_syncs(archetype, config_name):
    streams = bin_of(archetype)
    kwargs = dict(
        **streams.lists(), **streams.integer_scales(), rl_loss_fn=prime_rl.setup_rl_loss_fn(CONFIGS[config_name])
    )
    with OpCounter() as counter:
        loss, _ = prime_rl.compute_loss(**kwargs)
        loss.backward()
    assert counter.num_syncs == 0, counter.syncs


@pytest.mark.parametrize("normalize", ["token", "sequence_mean", "group_mean"])
def test_op_count_independent_of_sequence_count(archetype, config_name, normalize):
    counts = {}
    for num_seqs in (1, 16, 256):
        streams = bin_of(archetype, num_tokens=2048, num_seqs=num_seqs)
        plan = streams.plan(RL_PARAMS[config_name], normalize=normalize, group_ids=[s // 4 for s in range(num_seqs)])
        counts[num_seqs] = run_counted(plan, streams.outputs(), per_sequence_metrics=True).total
    assert counts[1] == counts[16] == counts[256], counts


@pytest.mark.parametrize(
    "rl",
    [DPPO, IPO, DPPO_HIGH10],
    ids=["dppo", "ipo", "dppo_high10"],
)
def test_non_member_extremes_change_nothing(archetype, rl):
    clean = bin_of(archetype)
    poisoned, a, _ = poison_non_members(clean)
    assert (poisoned.trainer_logprobs - poisoned.inference_logprobs)[a].item() == 100.0
    out_clean = compute_loss(clean.plan(rl), clean.outputs())
    out_poisoned = compute_loss(poisoned.plan(rl), poisoned.outputs())
    (g_clean,) = torch.autograd.grad(out_clean.loss, clean.trainer_logprobs)
    (g_poisoned,) = torch.autograd.grad(out_poisoned.loss, poisoned.trainer_logprobs)
    assert torch.isfinite(out_poisoned.loss) and torch.isfinite(g_poisoned).all()
    assert torch.equal(out_clean.loss, out_poisoned.loss)
    assert torch.equal(g_clean, g_poisoned)
    for key, value in out_clean.metrics.items():
        assert torch.equal(value, out_poisoned.metrics[key]), key


@pytest.mark.parametrize("archetype", ["all_empty", "dummy"])
@pytest.mark.parametrize("rl", [DPPO, IPO, REF_KL], ids=["dppo", "ipo", "ref_kl"])
def test_empty_bins_return_zero_and_zero_gradient(archetype, rl):
    streams = bin_of(archetype)
    if streams.ref_logprobs is None:
        streams = streams.replace(ref_logprobs=streams.inference_logprobs)
    result = compute_loss(streams.plan(rl), streams.outputs())
    result.loss.backward()
    assert result.loss.item() == 0.0
    assert streams.trainer_logprobs.grad is not None
    assert torch.equal(streams.trainer_logprobs.grad, torch.zeros_like(streams.trainer_logprobs))


# --------------------------------------------------------------------------------------------
# Steps of every kind, from the README's API, without placeholder streams


def test_rl_only_step():
    _, seq_lens, inference, trainer, mask = toy()
    adv = torch.tensor([1.0] * 5 + [0.5] + [-1.0] * 6)
    plan = Plan(seq_lens, {"rl": Component(DPPO, mask=mask)}, rollout_logprobs=inference, advantages=adv)
    result = compute_loss(plan, Outputs(logprobs=trainer))
    result.loss.backward()
    assert trainer.grad.abs().sum() > 0
    assert result.counts["rl/is_masked"].item() == mask.sum().item()
    assert {"rl/loss", "rl/is_masked", "rl/masked_mismatch_kl"} <= set(result.metrics)


def test_sampled_distillation_only_step():
    g, seq_lens, inference, trainer, mask = toy()
    ref = (inference + 0.2 * torch.randn(12, generator=g)).clamp_max(0)
    plan = Plan(seq_lens, {"distill": Component(REF_KL, mask=mask)}, rollout_logprobs=inference, ref_logprobs=ref)
    result = compute_loss(plan, Outputs(logprobs=trainer))
    result.loss.backward()
    assert torch.allclose(result.metrics["distill/ref_kl"], (ref - trainer.detach())[mask].mean(), rtol=1e-6)
    assert trainer.grad.abs().sum() > 0


def test_entropy_only_step():
    g, seq_lens, _, _, mask = toy()
    entropy = torch.rand(12, generator=g).requires_grad_()
    plan = Plan(seq_lens, {"ent": Component(Entropy(coef=0.1), mask=mask)})
    result = compute_loss(plan, Outputs(entropy=entropy))
    assert torch.allclose(result.loss, -0.1 * entropy.detach()[mask].mean(), rtol=1e-6)
    assert torch.allclose(result.metrics["ent/entropy"], entropy.detach()[mask].mean(), rtol=1e-6)
    result.loss.backward()
    assert torch.allclose(entropy.grad, torch.where(mask, -0.1 / mask.sum(), 0.0))


def test_all_components_together_sum_their_terms():
    g, seq_lens, inference, trainer, mask = toy()
    adv = torch.randn(12, generator=g)
    ref = (inference + 0.2 * torch.randn(12, generator=g)).clamp_max(0)
    entropy = torch.rand(12, generator=g)
    logits, teacher = torch.randn(12, 9, generator=g, requires_grad=True), torch.randn(12, 9, generator=g)
    components = {
        "rl": Component(DPPO, mask=mask, normalize="sequence_mean"),
        "sft": Component(SFT(), mask=~mask),
        "distill": Component(REF_KL, mask=mask, weights=torch.rand(12, generator=g)),
        "ent": Component(Entropy(0.01), mask=mask),
        "kd": Component(VocabDistill("forward_kl"), mask=mask, normalize="position"),
    }
    streams = dict(rollout_logprobs=inference, ref_logprobs=ref, advantages=adv, teacher_logits=teacher)
    plan = Plan(seq_lens, components, **streams)
    outputs = Outputs(logprobs=trainer, entropy=entropy, logits=logits)
    together = compute_loss(plan, outputs)
    parts = [compute_loss(Plan(seq_lens, {k: c}, **streams), outputs).loss for k, c in components.items()]
    assert torch.allclose(together.loss, sum(parts), rtol=1e-6)
    assert sorted(together.terms) == sorted(components)
    for name in components:
        assert f"{name}/loss" in together.metrics and f"{name}/loss" in together.counts
    assert "kd/forward_kl" in together.metrics
    together.loss.backward()
    assert logits.grad.abs().sum() > 0 and trainer.grad.abs().sum() > 0


def test_every_component_empty_still_backpropagates_zero():
    _, seq_lens, inference, trainer, _ = toy()
    none = torch.zeros(12, dtype=torch.bool)
    plan = Plan(seq_lens, {"sft": Component(SFT(), mask=none)})
    result = compute_loss(plan, Outputs(logprobs=trainer))
    result.loss.backward()
    assert result.loss.item() == 0.0 and torch.equal(trainer.grad, torch.zeros(12))


def test_metrics_carry_counts_and_merge_exactly():
    """Two micro-batches merged with their counts equal one call over both, min/max included."""
    a, b = bin_of("hot", seed=1), bin_of("hot", seed=2)
    both = make_archetype("hot", list(a.seq_lens) + list(b.seq_lens))
    both = both.replace(
        trainer_logprobs=torch.cat([a.trainer_logprobs, b.trainer_logprobs]).detach().requires_grad_(),
        inference_logprobs=torch.cat([a.inference_logprobs, b.inference_logprobs]),
        loss_mask=torch.cat([a.loss_mask, b.loss_mask]),
        advantages=torch.cat([a.advantages, b.advantages]),
    )
    gspo = PolicyGradient("gspo", ratio="rollout")
    parts = [compute_loss(s.plan(gspo), s.outputs()) for s in (a, b)]
    merged, counts = merge_metrics(parts)
    whole = compute_loss(both.plan(gspo), both.outputs())
    assert merged.keys() == whole.metrics.keys()
    assert {"rl/seq_ratio_min", "rl/seq_ratio_max"} <= set(merged)
    for key in whole.metrics:
        assert torch.allclose(merged[key], whole.metrics[key], atol=1e-6), key
        assert torch.equal(counts[key], whole.counts[key]), key
    mins = [p.metrics["rl/seq_ratio_min"] for p in parts]
    assert merged["rl/seq_ratio_min"] == min(mins) and merged["rl/seq_ratio_max"] == max(
        p.metrics["rl/seq_ratio_max"] for p in parts
    )


def test_per_sequence_metrics_match_per_sequence_calls():
    streams = bin_of("weighted_grpo", seed=5)
    result = compute_loss(streams.plan(), streams.outputs(), per_sequence_metrics=True)
    assert result.metrics["rl/is_masked"].shape == (streams.num_seqs,)
    lists = streams.lists()
    for s in range(streams.num_seqs):
        one = streams.replace(
            seq_lens=(streams.seq_lens[s],),
            **{k: lists[k][s] for k in ("trainer_logprobs", "inference_logprobs", "loss_mask", "advantages")},
            rl_weights=lists["rl_weights"][s],
        )
        alone = compute_loss(one.plan(), one.outputs())
        for key, value in alone.metrics.items():
            assert torch.allclose(result.metrics[key][s], value, atol=1e-6), (key, s)
            assert result.counts[key][s] == alone.counts[key], (key, s)


def test_custom_component_sees_whole_bin_and_layout():
    seen = []

    def spy(inputs):
        seen.append((inputs.trainer_logprobs.shape[0], inputs.num_seqs, inputs.cu_seqlens.tolist()))
        return ComponentOutput(per_token=-inputs.trainer_logprobs)

    streams = bin_of("hot")
    compute_loss(Plan(streams.seq_lens, {"mine": Component(spy, mask=streams.loss_mask)}), streams.outputs())
    assert seen == [(streams.num_tokens, streams.num_seqs, [0, *torch.tensor(streams.seq_lens).cumsum(0).tolist()])]


def test_custom_component_ignoring_weights_still_gets_them_and_the_mode():
    """The engine applies weights and normalisation: a component cannot silently bypass them."""
    _, seq_lens, _, trainer, mask = toy()
    w = torch.linspace(0.5, 2.0, 12)
    naive = Component(lambda inputs: ComponentOutput(per_token=-inputs.trainer_logprobs), mask=mask, weights=w,
                      normalize="sequence_mean")  # fmt: skip
    builtin = Component(SFT(), mask=mask, weights=w, normalize="sequence_mean")
    outputs = Outputs(logprobs=trainer)
    a = compute_loss(Plan(seq_lens, {"c": naive}), outputs).loss
    b = compute_loss(Plan(seq_lens, {"c": builtin}), outputs).loss
    assert torch.equal(a, b)


def test_bad_arguments_raise_clear_errors():
    streams = bin_of("hot")
    plan, outputs = streams.plan(), streams.outputs()
    with pytest.raises(TypeError, match="plan"):
        compute_loss({"rl": 1}, outputs)
    with pytest.raises(TypeError, match="outputs"):
        compute_loss(plan, streams.trainer_logprobs)
    with pytest.raises(TypeError, match="ComponentOutput"):
        bad = Component(lambda inputs: inputs.trainer_logprobs.sum(), mask=streams.loss_mask)
        compute_loss(Plan(streams.seq_lens, {"x": bad}), outputs)
    with pytest.raises(ValueError, match=r"per-token loss of shape \[N\]"):
        bad = Component(lambda inputs: ComponentOutput(per_token=inputs.trainer_logprobs.sum()), mask=streams.loss_mask)
        compute_loss(Plan(streams.seq_lens, {"x": bad}), outputs)
    with pytest.raises(ValueError, match="'rl' needs the plan's advantages"):
        streams.replace(advantages=None).plan()
    with pytest.raises(ValueError, match="'rl' needs outputs.logprobs"):
        compute_loss(plan, Outputs(entropy=streams.trainer_logprobs))
    with pytest.raises(ValueError, match=r"outputs.logprobs must have shape \[N\]"):
        compute_loss(plan, Outputs(logprobs=streams.trainer_logprobs[:-1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_compute_in_float32(dtype):
    streams = bin_of("hot")
    low = streams.replace(
        trainer_logprobs=streams.trainer_logprobs.detach().to(dtype).requires_grad_(),
        inference_logprobs=streams.inference_logprobs.to(dtype),
        advantages=streams.advantages.to(dtype),
    )
    result = compute_loss(low.plan(), low.outputs())
    result.loss.backward()
    assert result.loss.dtype == torch.float32
    assert low.trainer_logprobs.grad.dtype == dtype
    up = low.replace(
        trainer_logprobs=low.trainer_logprobs.detach().float().requires_grad_(),
        inference_logprobs=low.inference_logprobs.float(),
        advantages=low.advantages.float(),
    )
    assert torch.equal(compute_loss(up.plan(), up.outputs()).loss, result.loss)


@pytest.mark.parametrize("region", ["gspo", "clip_cov"])
def test_compute_loss_compiles_with_fullgraph(region):
    """torch.compile(fullgraph=True) traces the whole engine (no graph break, no sync) and agrees, also
    for a region that selects tokens over the step (its selection was compared by repr: a graph break)."""
    streams = with_old(bin_of("sdft", num_tokens=300, num_seqs=7, seed=9))
    plan = streams.plan(PolicyGradient(region, ratio="rollout", penalties=DPPO.penalties), normalize="sequence_mean")
    den = count_denominators([plan])
    compiled = torch.compile(lambda p, o, d: compute_loss(p, o, d).loss, fullgraph=True)
    loss = compiled(plan, streams.outputs(), den)
    (grad,) = torch.autograd.grad(loss, streams.trainer_logprobs)
    eager = compute_loss(plan, streams.outputs(), den).loss
    (grad_eager,) = torch.autograd.grad(eager, streams.trainer_logprobs)
    assert torch.allclose(loss, eager, rtol=1e-6)
    assert torch.allclose(grad, grad_eager, rtol=1e-5, atol=1e-8)


def test_vocab_distill_is_not_traced_whole_as_the_design_doc_says():
    """docs/design.md: VocabDistill's chunked autograd Function breaks fullgraph (its backward reads
    the autograd engine's state); its chunks compile with impl="compiled" instead."""
    n, v = 12, 7
    plan = Plan((6, 6), {"kd": Component(VocabDistill("reverse_kl"), torch.ones(n, dtype=torch.bool))},
                teacher_logits=torch.randn(n, v))  # fmt: skip
    compiled = torch.compile(lambda p, o: compute_loss(p, o).loss, fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled(plan, Outputs(logits=torch.randn(n, v, requires_grad=True)))


def test_compiled_engine_does_not_recompile_per_packing():
    """After dynamo's one automatic-dynamic recompile, new sequence counts reuse the graph."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    compiled = torch.compile(lambda p, o: compute_loss(p, o).loss)
    graphs = []
    for num_seqs in (1, 16, 64, 256):
        streams = bin_of("hot", num_tokens=512, num_seqs=num_seqs)
        compiled(streams.plan(), streams.outputs()).backward()
        graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[1], graphs
