"""packloss.core.kto: KTO on packed bins and its KL reference point.

The step's loss, gradient and metrics equal TRL 1.16's own ``KTOTrainer._compute_loss`` on the same
sequences padded (run unbound on a stand-in ``self``, ``types.SimpleNamespace`` with the attributes it
reads, and a stand-in model returning the fused head's per-token log-probs, zero where the label is
``-100``), KL completions (the mismatched prompt/completion rows TRL builds) included:
:func:`kto_reference_kl` over them is TRL's ``kl``. OpenRLHF 0.11.2 has no KTO loss (its former
``KTOLoss`` computed the same reference point: the batch mean of the KL rows' log-ratio sums, averaged
over ranks, clamped at 0), so there is no OpenRLHF comparison. Also: the plan checks, NaN safety,
float32 compute, no sync, op counts flat in the sequences. A context-parallel bin with the KL estimate
all-reduced is in ``tests/core/test_preference.py`` (one gloo run for every preference loss).
"""

from __future__ import annotations

import random
import types
from collections import defaultdict
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor
from trl.trainer.kto_trainer import KTOTrainer

from packloss import SFT, Component, Outputs, Plan, compute_loss, count_denominators, merge_metrics
from packloss.core.kto import KTO, kto_reference_kl
from packloss.testing import OpCounter
from tests.core.test_preference import assert_same_step, completion_mask, completion_sums, grads, padded

F64 = torch.float64


@dataclass
class Seq:
    """A sequence: ``prompt`` tokens (non-members; the first holds NaN) then its completion."""

    desirable: bool
    prompt: int
    trn: Tensor
    ref: Tensor


def _logprobs(n: int, g: torch.Generator) -> Tensor:
    x = (torch.rand(n, generator=g, dtype=F64) * 0.9 + 0.05).log()
    x[0] = float("nan")
    return x


def make_seqs(num: int, seed: int, kl_shift: float = 0.0) -> tuple[list[Seq], list[Seq]]:
    """``num`` KTO sequences (both kinds present) and their KL rows: prompt ``i`` with the completion of
    ``i − 1`` (TRL's rotation), whose trainer log-probs sit ``kl_shift`` above the reference's on average."""
    g = torch.Generator().manual_seed(seed)
    prompts = [int(torch.randint(1, 4, (1,), generator=g)) for _ in range(num)]
    completions = [int(torch.randint(1, 7, (1,), generator=g)) for _ in range(num)]
    seqs = [
        Seq(
            i % 3 != 1, prompts[i], _logprobs(prompts[i] + completions[i], g), _logprobs(prompts[i] + completions[i], g)
        )
        for i in range(num)
    ]
    kl = []
    for i in range(num):
        n = prompts[i] + completions[i - 1]
        ref = _logprobs(n, g)
        kl.append(Seq(True, prompts[i], ref + kl_shift + 0.3 * torch.randn(n, generator=g, dtype=F64), ref))
    return seqs, kl


@dataclass
class Packed:
    plans: list[Plan]
    leaves: list[Tensor]
    spans: list[tuple[int, int, int]]  # per sequence: (bin, start, end)

    def values(self, i: int) -> Tensor:
        k, start, end = self.spans[i]
        return self.leaves[k][start:end]


def pack(seqs: list[Seq], num_bins: int, component, seed: int, dtype=F64, chosen: bool = True) -> Packed:
    """The sequences shuffled over ``num_bins`` bins; ``component(mask)`` on the completion tokens."""
    rng = random.Random(seed)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, len(seqs)), num_bins - 1)) if num_bins > 1 else []
    plans, leaves, spans = [], [], [None] * len(seqs)
    for k, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(seqs)], strict=True)):
        members = order[a:b]
        start = 0
        for i in members:
            spans[i] = (k, start, start + seqs[i].trn.numel())
            start += seqs[i].trn.numel()
        mask = torch.cat([torch.arange(seqs[i].trn.numel()) >= seqs[i].prompt for i in members])
        plans.append(
            Plan(
                [seqs[i].trn.numel() for i in members],
                {"kto": component(mask)},
                ref_logprobs=torch.cat([seqs[i].ref for i in members]).to(dtype),
                chosen=[seqs[i].desirable for i in members] if chosen else None,
            )
        )
        leaves.append(torch.cat([seqs[i].trn for i in members]).to(dtype).requires_grad_())
    return Packed(plans, leaves, spans)


def packloss_step(seqs, kl_seqs, *, beta, desirable_weight, undesirable_weight, bins=3, seed=0):
    kl_packed = pack(kl_seqs, 2, lambda mask: Component(SFT(), mask=mask), seed + 1, chosen=False)
    z = kto_reference_kl(kl_packed.plans, kl_packed.leaves, "kto")
    objective = KTO(beta, desirable_weight, undesirable_weight, kl=z)
    packed = pack(seqs, bins, lambda mask: Component(objective, mask=mask, normalize="sequence_mean"), seed)
    den = count_denominators(packed.plans)
    results = [compute_loss(p, Outputs(logprobs=x), den) for p, x in zip(packed.plans, packed.leaves, strict=True)]
    return packed, z, sum(r.loss for r in results), merge_metrics(results)[0]


def trl_kto(main: list[Tensor], seqs: list[Seq], kl_seqs: list[Seq], *, beta, desirable_weight, undesirable_weight):
    """TRL 1.16's ``KTOTrainer._compute_loss`` on the padded rows, with precomputed reference sums."""
    prompts, kl_prompts = [s.prompt for s in seqs], [s.prompt for s in kl_seqs]
    kl_trn = [s.trn for s in kl_seqs]
    attention, comp = completion_mask(main, prompts)
    kl_attention, kl_comp = completion_mask(kl_trn, kl_prompts)
    main_values, kl_values = padded(main), padded(kl_trn)
    batch = {
        "input_ids": torch.zeros(main_values.shape, dtype=torch.long),
        "attention_mask": attention.long(),
        "completion_mask": comp.long(),
        "KL_input_ids": torch.zeros(kl_values.shape, dtype=torch.long),
        "KL_attention_mask": kl_attention.long(),
        "KL_completion_mask": kl_comp.long(),
        "label": torch.tensor([s.desirable for s in seqs]),
        "ref_logps": completion_sums([s.ref for s in seqs], prompts),
        "ref_KL_logps": completion_sums([s.ref for s in kl_seqs], kl_prompts),
    }

    def model(input_ids, attention_mask, labels, fused_lm_head, use_cache):
        values = kl_values if input_ids is batch["KL_input_ids"] else main_values
        scored = labels[:, 1:] != -100
        lp = torch.where(scored, values[:, 1:], 0.0)
        zeros = torch.zeros_like(lp)
        return types.SimpleNamespace(log_probs=lp, entropy=zeros, mean_logits=zeros, aux_loss=None)

    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x),
        calculate_KL=True, aux_loss_enabled=False, precompute_ref_logps=True, loss_type="kto", beta=beta,
        desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    trainer._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, trainer)
    loss = KTOTrainer._compute_loss(trainer, model, batch, return_outputs=False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("kl_shift", [0.2, -0.5], ids=["kl_positive", "kl_clamped"])
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.33, 0.7)], ids=["unweighted", "weighted"])
def test_kto_equals_trl_kto_trainer(kl_shift, weights):
    seqs, kl_seqs = make_seqs(9, seed=1, kl_shift=kl_shift)
    params = dict(beta=0.3, desirable_weight=weights[0], undesirable_weight=weights[1])
    packed, z, loss, metrics = packloss_step(seqs, kl_seqs, **params)
    expected, trl_metrics = trl_kto([packed.values(i) for i in range(len(seqs))], seqs, kl_seqs, **params)
    assert (z.item() == 0) == (kl_shift < 0)
    assert z.item() == pytest.approx(trl_metrics["kl"], rel=1e-12, abs=1e-15)
    assert_same_step(loss, expected, packed.leaves)
    for name in ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert metrics[f"kto/{name}"].item() == pytest.approx(trl_metrics[name], rel=1e-10, abs=1e-12), name
    margin = metrics["kto/rewards/chosen"] - metrics["kto/rewards/rejected"]
    assert margin.item() == pytest.approx(trl_metrics["rewards/margins"], rel=1e-10, abs=1e-12)
    assert metrics["kto/loss"].item() == pytest.approx(expected.item(), rel=1e-10)


def test_kto_equals_the_paper_formula_with_a_member_less_sequence():
    """Eq. 7–8 of the KTO paper per sequence, the mean over the sequences with members (a sequence
    whose completion is masked out entirely is no sample), with a fixed reference point."""
    seqs, _ = make_seqs(6, seed=2)
    seqs[4].prompt = seqs[4].trn.numel()
    beta, lam_d, lam_u, z = 0.2, 1.5, 0.8, 0.05
    objective = KTO(beta, lam_d, lam_u, kl=z)
    packed = pack(seqs, 2, lambda mask: Component(objective, mask=mask, normalize="sequence_mean"), seed=3)
    den = count_denominators(packed.plans)
    results = [compute_loss(p, Outputs(logprobs=x), den) for p, x in zip(packed.plans, packed.leaves, strict=True)]
    terms = []
    for i, s in enumerate(seqs):
        if i == 4:
            continue
        rho = (packed.values(i)[s.prompt :] - s.ref[s.prompt :]).sum()
        v = torch.sigmoid(beta * (rho - z)) if s.desirable else torch.sigmoid(beta * (z - rho))
        terms.append((lam_d if s.desirable else lam_u) * (1 - v))
    assert_same_step(sum(r.loss for r in results), torch.stack(terms).mean(), packed.leaves)
    assert merge_metrics(results)[1]["kto/loss"].item() == 5


def test_a_tensor_reference_point_is_read_at_every_call():
    seqs, _ = make_seqs(4, seed=4)
    z = torch.zeros((), dtype=F64)
    packed = pack(seqs, 1, lambda mask: Component(KTO(kl=z), mask=mask, normalize="sequence_mean"), seed=5)
    plan, trn = packed.plans[0], packed.leaves[0]
    before = compute_loss(plan, Outputs(logprobs=trn)).loss
    z.fill_(0.7)
    after = compute_loss(plan, Outputs(logprobs=trn))
    fixed = compute_loss(
        Plan(plan.seq_lens, {"kto": Component(KTO(kl=0.7), mask=plan.members["kto"], normalize="sequence_mean")},
             ref_logprobs=plan.ref_logprobs, chosen=plan.chosen),
        Outputs(logprobs=trn),
    )  # fmt: skip
    assert not torch.equal(before, after.loss) and torch.equal(after.loss, fixed.loss)
    assert after.metrics["kto/kl"].item() == pytest.approx(0.7) and after.counts["kto/kl"].item() == 1


def _plan(objective=None, normalize="sequence_mean", chosen=(True, False, True), ref=True):
    return Plan(
        [2, 3, 2],
        {"kto": Component(objective or KTO(), mask=torch.ones(7, dtype=torch.bool), normalize=normalize)},
        ref_logprobs=torch.full((7,), -1.0) if ref else None,
        chosen=None if chosen is None else list(chosen),
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(chosen=None), r"component 'kto' \(KTO\) needs the plan's chosen flags \(True = desirable\)"),
        (dict(ref=False), r"component 'kto' needs the plan's ref_logprobs"),
        (dict(normalize="token"), r"KTO's loss per sequence is given to each .* use normalize='sequence_mean'"),
        (dict(normalize="sequence_sum"), r"normalize='sequence_sum' would weight it by its token count"),
    ],
)
def test_plan_checks_name_the_component(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _plan(**kwargs)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: KTO(beta=0), ValueError, r"KTO.beta must be > 0"),
        (lambda: KTO(desirable_weight=-1.0), ValueError, r"KTO.desirable_weight must be >= 0"),
        (lambda: KTO(undesirable_weight=None), TypeError, r"KTO.undesirable_weight must be a number"),
        (lambda: KTO(kl=-0.1), ValueError, r"KTO.kl must be >= 0"),
        (lambda: KTO(kl=torch.zeros(2)), ValueError, r"KTO.kl must be a number or a 0-d floating-point tensor"),
        (lambda: kto_reference_kl([_plan()], [], "kto"), TypeError, r"sequences of the same length"),
        (lambda: kto_reference_kl([], [], "kto"), ValueError, r"plans is empty"),
        (lambda: kto_reference_kl([_plan()], [torch.zeros(7)], "kl"), ValueError, r"plans\[0\] has no component 'kl'"),
        (lambda: kto_reference_kl([_plan()], [torch.zeros(6)], "kto"), ValueError, r"logprobs\[0\] must have shape"),
    ],
)
def test_bad_arguments_name_the_argument(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_non_members_may_hold_anything():
    seqs, kl_seqs = make_seqs(6, seed=6)
    clean = [Seq(s.desirable, s.prompt, s.trn.nan_to_num(-1.0), s.ref.nan_to_num(-1.0)) for s in seqs]
    poisoned = []
    for i, s in enumerate(seqs):
        trn, ref = s.trn.clone(), s.ref.clone()
        trn[: s.prompt], ref[: s.prompt] = (float("inf"), float("nan"))[i % 2], (float("-inf"), float("nan"))[i % 2]
        poisoned.append(Seq(s.desirable, s.prompt, trn, ref))
    params = dict(beta=0.3, desirable_weight=1.0, undesirable_weight=1.0)
    a, za, loss_a, metrics_a = packloss_step(clean, kl_seqs, **params)
    b, zb, loss_b, metrics_b = packloss_step(poisoned, kl_seqs, **params)  # the KL rows' first tokens hold NaN
    assert torch.isfinite(zb) and torch.equal(za, zb)
    assert torch.isfinite(loss_b) and torch.equal(loss_a, loss_b)
    for ga, gb in zip(grads(loss_a, a.leaves), grads(loss_b, b.leaves), strict=True):
        assert torch.equal(ga, gb)
    assert all(torch.equal(metrics_a[k], metrics_b[k]) for k in metrics_a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_computed_in_float32(dtype):
    seqs, _ = make_seqs(5, seed=7)
    packed = pack(seqs, 1, lambda mask: Component(KTO(kl=0.1), mask=mask, normalize="sequence_mean"), 8, dtype)
    result = compute_loss(packed.plans[0], Outputs(logprobs=packed.leaves[0]))
    assert result.loss.dtype == torch.float32 and all(v.dtype == torch.float32 for v in result.metrics.values())
    (grad,) = torch.autograd.grad(result.loss, packed.leaves)
    assert grad.dtype == dtype and torch.isfinite(grad.float()).all()


@pytest.mark.parametrize("per_sequence_metrics", [False, True])
def test_no_sync_and_an_op_count_flat_in_the_sequences(per_sequence_metrics):
    counted = []
    for num in (8, 128):
        seqs, kl_seqs = make_seqs(num, seed=9)
        kl_packed = pack(kl_seqs, 1, lambda mask: Component(SFT(), mask=mask), 10, chosen=False)
        z_out = torch.zeros((), dtype=F64)
        kto = KTO(kl=z_out)
        packed = pack(seqs, 1, lambda mask, kto=kto: Component(kto, mask=mask, normalize="sequence_mean"), 11)
        den = count_denominators(packed.plans)
        with OpCounter() as ops:
            z_out.copy_(kto_reference_kl(kl_packed.plans, kl_packed.leaves, "kto"))
            result = compute_loss(packed.plans[0], Outputs(logprobs=packed.leaves[0]), den,
                                  per_sequence_metrics=per_sequence_metrics)  # fmt: skip
            result.loss.backward()
        assert ops.num_syncs == 0, ops.syncs
        counted.append(ops.ops)
    assert counted[0] == counted[1]
