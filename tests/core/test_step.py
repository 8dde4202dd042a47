"""packloss.core.step: count_denominators and the step's aggregation. Every normalisation mode for
every component kind equals a hand-written formula; the step's gradient is invariant to packing, order
and data-parallel split (gloo ranks, DDP and FSDP2 over two processes equal one process)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from packloss import (
    DPPO,
    REF_KL,
    SFT,
    Component,
    ComponentOutput,
    Entropy,
    KLPenalty,
    Normalize,
    Outputs,
    Plan,
    PolicyGradient,
    RolloutCorrection,
    all_reduce_metrics,
    compute_loss,
    count_denominators,
)
from packloss.compat.prime_rl import DefaultLossConfig
from packloss.testing import OpCounter, Streams, make_archetype, run_gloo
from packloss.testing import reference as ref_impl

MODES = [m.value for m in Normalize]
CONSTANT = 37.0
LENS = [7, 1, 12, 5, 9, 3, 15, 2, 8, 6, 11, 4]
GROUPS = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]  # group 3's last sequences are all-masked for some kinds


def step(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """A step of 12 sequences: streams [N], per-kind member masks and weights (some sequences empty)."""
    base = make_archetype("sdft", LENS, seed=seed, dtype=dtype)
    n = base.num_tokens
    g = torch.Generator().manual_seed(seed)
    seq_ids = torch.repeat_interleave(torch.arange(len(LENS)), torch.tensor(LENS))
    masks = {
        "rl": base.loss_mask & (seq_ids != 3),
        "sft": ~base.loss_mask & (torch.rand(n, generator=g) < 0.5),
        "distill": base.ref_kl_weights != 0,
        "entropy": base.loss_mask,
        "custom": base.loss_mask & (seq_ids % 2 == 0),
    }
    weights = (torch.rand(n, generator=g) + 0.5).to(dtype)
    return dict(
        theta=base.trainer_logprobs.detach().clone().requires_grad_(),
        entropy=torch.rand(n, generator=g, dtype=torch.float64).to(dtype).requires_grad_(),
        inference=base.inference_logprobs,
        ref=base.ref_logprobs,
        adv=base.advantages,
        masks=masks,
        weights=weights,
        seq_ids=seq_ids,
    )


def _custom(inputs):
    """A custom component: ℓ_t = trn_t² (any per-token function)."""
    return ComponentOutput(per_token=inputs.trainer_logprobs**2)


KINDS = {"rl": DPPO, "sft": SFT(), "distill": REF_KL, "entropy": Entropy(0.3), "custom": _custom}


def _sequence_sums(kind: str, s: dict, weighted: bool) -> list[torch.Tensor]:
    """Σ_{t∈s} w_t ℓ_t for every sequence, from the per-sequence reference or the definition."""
    out = []
    offsets = [sum(LENS[:i]) for i in range(len(LENS))]
    for start, n in zip(offsets, LENS, strict=True):
        sl = slice(start, start + n)
        m = s["masks"][kind][sl]
        w = s["weights"][sl] if weighted else torch.ones(n, dtype=s["weights"].dtype)
        trn = s["theta"][sl]
        if kind in ("rl", "distill"):
            inputs = ref_impl.LossInputs(trn, s["inference"][sl], s["ref"][sl], s["adv"][sl], m, w)
            fn = (
                ref_impl.ref_kl_loss_fn
                if kind == "distill"
                else (lambda i: ref_impl.default_loss_fn(i, DefaultLossConfig()))
            )
            out.append(fn(inputs).loss)
        elif kind == "sft":
            out.append(torch.where(m, -trn * w, 0.0).sum())
        elif kind == "entropy":
            out.append(torch.where(m, -0.3 * s["entropy"][sl] * w, 0.0).sum())
        else:
            out.append(torch.where(m, trn**2 * w, 0.0).sum())
    return out


def hand_formula(kind: str, mode: str, s: dict, weighted: bool) -> torch.Tensor:
    """The component's term written out from the mode's definition."""
    sums = _sequence_sums(kind, s, weighted)
    members = [int(m.sum()) for m in torch.split(s["masks"][kind], LENS)]
    total = sum(sums)
    if mode == "token":
        return total / max(sum(members), 1)
    if mode == "position":
        return total / sum(LENS)
    if mode == "constant":
        return total / CONSTANT
    with_members = [i for i, k in enumerate(members) if k > 0]
    if mode == "sequence_sum":
        return total / max(len(with_members), 1)
    if mode == "sequence_mean":
        return sum(sums[i] / members[i] for i in with_members) / max(len(with_members), 1)
    group_members = {g: 0 for g in GROUPS}
    group_sums = {g: 0.0 for g in GROUPS}
    for i, g in enumerate(GROUPS):
        group_members[g] += members[i]
        group_sums[g] = group_sums[g] + sums[i]
    live = [g for g in group_members if group_members[g] > 0]
    return sum(group_sums[g] / group_members[g] for g in live) / max(len(live), 1)


def plan_of(kind: str, mode: str, s: dict, weighted: bool, index: torch.Tensor | None = None, lens=LENS, groups=GROUPS):
    pick = (lambda t: t) if index is None else (lambda t: t.index_select(0, index))
    comp = Component(
        KINDS[kind],
        mask=pick(s["masks"][kind]),
        weights=pick(s["weights"]) if weighted else None,
        normalize=mode,
        constant=CONSTANT if mode == "constant" else None,
    )
    plan = Plan(
        list(lens), {kind: comp}, rollout_logprobs=pick(s["inference"]), ref_logprobs=pick(s["ref"]),
        advantages=pick(s["adv"]), group_ids=list(groups),
    )  # fmt: skip
    return plan, Outputs(logprobs=pick(s["theta"]), entropy=pick(s["entropy"]))


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-6), (torch.float64, 1e-12)], ids=["f32", "f64"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_mode_equals_its_hand_formula(kind, mode, weighted, dtype, rtol):
    s = step(dtype)
    plan, outputs = plan_of(kind, mode, s, weighted)
    expected = hand_formula(kind, mode, s, weighted)
    assert abs(float(expected.detach())) > 0
    for denominators in (None, count_denominators([plan])):
        got = compute_loss(plan, outputs, denominators).loss
        assert got.dtype == dtype
        assert torch.allclose(got, expected.to(got.dtype), rtol=rtol, atol=0), (float(got), float(expected))


def test_wrong_variants_fail_the_formula():
    """The hand formula can fail: dividing by sequence length, or positions by member count, differ."""
    s = step(torch.float64)
    sums = _sequence_sums("rl", s, True)
    members = [int(m.sum()) for m in torch.split(s["masks"]["rl"], LENS)]
    live = [i for i, k in enumerate(members) if k > 0]
    by_length = sum(sums[i] / LENS[i] for i in live) / len(live)
    assert not torch.isclose(by_length, hand_formula("rl", "sequence_mean", s, True), rtol=1e-6)
    by_members = sum(sums) / sum(members)
    assert not torch.isclose(by_members, hand_formula("rl", "position", s, True), rtol=1e-6)


def micro_batches(kind, mode, s, order, num_bins):
    """Sequences in ``order`` dealt into ``num_bins`` plans; trainer log-probs gather from ``theta``."""
    starts = [sum(LENS[:i]) for i in range(len(LENS))]
    out = []
    for chunk in (order[i::num_bins] for i in range(num_bins)):
        index = torch.cat([torch.arange(starts[q], starts[q] + LENS[q]) for q in chunk])
        lens, groups = [LENS[q] for q in chunk], [GROUPS[q] for q in chunk]
        out.append(plan_of(kind, mode, s, True, index, lens, groups))
    return out


def step_gradient(parts, s, num_groups=None):
    den = count_denominators([p for p, _ in parts], num_groups=num_groups)
    total = sum(compute_loss(p, o, den).loss for p, o in parts)
    return torch.autograd.grad(total, [s["theta"], s["entropy"]], retain_graph=True, allow_unused=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["rl", "distill", "entropy"])
def test_gradient_invariant_to_packing_and_order(kind, mode):
    s = step(torch.float64)
    rng = random.Random(0)
    which = 1 if kind == "entropy" else 0  # the gradient of the stream the component reads
    whole = step_gradient(micro_batches(kind, mode, s, list(range(len(LENS))), 1), s)[which]
    assert whole.abs().sum() > 0
    for num_bins in (2, 4):
        order = list(range(len(LENS)))
        rng.shuffle(order)
        grad = step_gradient(micro_batches(kind, mode, s, order, num_bins), s, num_groups=4)[which]
        assert torch.allclose(grad, whole, rtol=1e-12, atol=1e-15), (num_bins, (grad - whole).abs().max())


def test_naive_per_micro_batch_token_mean_is_not_invariant():
    """Local denominators (each micro-batch's own token mean, averaged) change with the packing."""
    s = step(torch.float64)
    grads = []
    for num_bins in (1, 4):
        parts = micro_batches("rl", "token", s, list(range(len(LENS))), num_bins)
        total = sum(compute_loss(p, o).loss for p, o in parts) / num_bins
        grads.append(torch.autograd.grad(total, s["theta"])[0])
    assert not torch.allclose(grads[0], grads[1], rtol=1e-3, atol=1e-6)


def _dp_worker(rank, world_size):
    """This rank's share of a 4-bin step for every mode; counts the all-reduces."""
    s = step(torch.float64)
    grads, all_reduces = {}, []
    for mode in MODES:
        parts = micro_batches("rl", mode, s, list(range(len(LENS))), 4)[rank::world_size]
        with OpCounter() as counter:
            den = count_denominators([p for p, _ in parts], all_reduce=True, num_groups=4, check=mode != "token")
        all_reduces.append(sum(n for op, n in counter.ops.items() if "allreduce" in op))
        total = sum(compute_loss(p, o, den).loss for p, o in parts)
        grads[mode] = torch.autograd.grad(total, s["theta"])[0]
    return grads, all_reduces


def test_gradient_invariant_to_data_parallel_split():
    ranks = run_gloo(_dp_worker, world_size=2, timeout=240)
    for _, all_reduces in ranks:
        # one all_reduce counts the whole step; the agreement check (skipped for "token") adds one
        assert all_reduces == [1 if mode == "token" else 2 for mode in MODES]
    s = step(torch.float64)
    for mode in MODES:
        (single, _) = step_gradient(micro_batches("rl", mode, s, list(range(len(LENS))), 1), s)
        split = ranks[0][0][mode] + ranks[1][0][mode]
        assert torch.allclose(split, single, rtol=1e-12, atol=1e-15), mode


def test_count_denominators_counts():
    s = step()
    plans = [p for p, _ in micro_batches("rl", "token", s, list(range(len(LENS))), 2)]
    d = count_denominators(plans)
    assert d.denominator("rl").item() == s["masks"]["rl"].sum().item()
    pos = [p for p, _ in micro_batches("rl", "position", s, list(range(len(LENS))), 2)]
    assert count_denominators(pos).denominator("rl").item() == sum(LENS)
    seq = [p for p, _ in micro_batches("rl", "sequence_mean", s, list(range(len(LENS))), 2)]
    live = sum(int(m.any()) for m in torch.split(s["masks"]["rl"], LENS))
    assert count_denominators(seq).denominator("rl").item() == live
    grp = [p for p, _ in micro_batches("rl", "group_mean", s, list(range(len(LENS))), 2)]
    d = count_denominators(grp)
    assert d.counts["rl"].tolist() == [
        float(sum(int(m.sum()) for m, g in zip(torch.split(s["masks"]["rl"], LENS), GROUPS, strict=True) if g == k))
        for k in range(4)
    ]
    with OpCounter() as counter:
        count_denominators(plans)
    assert counter.num_syncs == 0


def test_denominators_carry_their_mode():
    s = step()
    token_plan, outputs = plan_of("rl", "token", s, True)
    seq_plan, _ = plan_of("rl", "sequence_mean", s, True)
    with pytest.raises(
        ValueError, match=r"normalises with normalize='token' but .* counted for normalize='sequence_mean'"
    ):
        compute_loss(token_plan, outputs, count_denominators([seq_plan]))
    other = Plan(LENS, {"sft": Component(SFT(), mask=s["masks"]["sft"])})
    with pytest.raises(ValueError, match="no component 'rl'"):
        compute_loss(token_plan, outputs, count_denominators([other]))
    c1, _ = plan_of("rl", "constant", s, True)
    c2 = Plan(LENS, {"rl": Component(DPPO, mask=s["masks"]["rl"], normalize="constant", constant=2.0)},
              rollout_logprobs=s["inference"], advantages=s["adv"])  # fmt: skip
    with pytest.raises(ValueError, match="constant=2.0"):
        compute_loss(c1, outputs, count_denominators([c2]))
    with pytest.raises(ValueError, match="normalises with"):
        count_denominators([token_plan, seq_plan])


def test_normalize_errors():
    s = step()
    m = s["masks"]["rl"]
    with pytest.raises(ValueError, match="normalize must be one of"):
        Component(SFT(), mask=m, normalize="mean")
    with pytest.raises(TypeError, match="normalize must be"):
        Component(SFT(), mask=m, normalize=1)
    with pytest.raises(ValueError, match="needs constant="):
        Component(SFT(), mask=m, normalize="constant")
    with pytest.raises(ValueError, match="constant must be finite"):
        Component(SFT(), mask=m, normalize="constant", constant=float("inf"))
    with pytest.raises(ValueError, match="constant is only used"):
        Component(SFT(), mask=m, constant=3.0)
    with pytest.raises(ValueError, match="group_ids"):
        Plan(LENS, {"sft": Component(SFT(), mask=m, normalize="group_mean")})
    plan, _ = plan_of("rl", "group_mean", s, True)
    with pytest.raises(ValueError, match="num_groups"):
        count_denominators([plan], all_reduce=True)
    with pytest.raises(ValueError, match="modes="):
        count_denominators([])
    assert Normalize("group_mean") is Normalize.GROUP_MEAN
    assert [m.value for m in Normalize] == MODES


def _disagreeing_worker(rank, world_size, what):
    """Rank 1 normalises differently (or has another component); every rank must raise, none hang."""
    s = step(torch.float64)
    mode = "token" if rank == 0 or what != "mode" else "sequence_mean"
    kind = "rl" if rank == 0 or what != "component" else "sft"
    plan, _ = plan_of(kind, mode, s, True)
    try:
        count_denominators([plan], all_reduce=True)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("what", ["mode", "component"])
def test_ranks_that_disagree_raise_on_every_rank(what):
    messages = run_gloo(_disagreeing_worker, world_size=2, args=(what,), timeout=120)
    assert all("step components or modes differ across ranks" in m for m in messages), messages


# ---------------------------------------------------------------------------------------------------
# Data-parallel: DDP over two gloo processes (an empty bin on a rank, global denominators)
# ---------------------------------------------------------------------------------------------------

H, V = 8, 16


def model_and_bins():
    torch.manual_seed(0)
    model = nn.Linear(H, V, bias=False)
    real = make_archetype("hot", [5, 1, 9, 4], seed=11)
    dummy = make_archetype("dummy", [3, 7], seed=12)
    return model, [real, dummy]


def plan_and_outputs(model: nn.Module, streams: Streams, seed: int) -> tuple[Plan, Outputs]:
    """The bin's plan, and the model's log-probs as the forward's output (gradients reach parameters)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(streams.num_tokens, H, generator=g)
    labels = torch.randint(0, V, (streams.num_tokens,), generator=g)
    trn = torch.log_softmax(model(x), -1).gather(1, labels[:, None]).squeeze(1)
    inference = trn.detach() + 0.3 * torch.randn(streams.num_tokens, generator=g)
    plan = Plan(streams.seq_lens, {"rl": Component(DPPO, mask=streams.loss_mask)}, inference,
                advantages=streams.advantages)  # fmt: skip
    return plan, Outputs(logprobs=trn)


def ddp_worker(rank: int, world_size: int):
    model, bins = model_and_bins()
    ddp = nn.parallel.DistributedDataParallel(model)
    plan, outputs = plan_and_outputs(ddp, bins[rank], seed=rank)
    den = count_denominators([plan], all_reduce=True)
    result = compute_loss(plan, outputs, den)
    result.loss.backward()
    metrics, counts = all_reduce_metrics(result.metrics, result.counts)
    dist.barrier()
    return {"grad": model.weight.grad.clone(), "loss": result.loss.detach(), "metrics": metrics, "counts": counts}


def test_ddp_with_an_empty_rank_matches_single_process():
    ranks = run_gloo(ddp_worker, world_size=2, timeout=180)
    model, bins = model_and_bins()
    parts = [plan_and_outputs(model, b, seed=r) for r, b in enumerate(bins)]
    den = count_denominators([p for p, _ in parts])
    results = [compute_loss(p, o, den) for p, o in parts]
    sum(r.loss for r in results).backward()
    assert results[1].loss.item() == 0.0  # rank 1's bin is really empty
    # DDP averages gradients over ranks; global denominators make the sum the step's gradient.
    for rank in ranks:
        assert torch.allclose(rank["grad"] * 2, model.weight.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(ranks[0]["grad"], ranks[1]["grad"])
    for key, value in results[0].metrics.items():
        assert torch.allclose(ranks[1]["metrics"][key], value, atol=1e-6), key
        assert ranks[1]["counts"][key] == results[0].counts[key]


# ---------------------------------------------------------------------------------------------------
# FSDP2 (fully_shard): parameters sharded over two ranks, two micro-batches each, global denominators
# ---------------------------------------------------------------------------------------------------


def fsdp_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(H, 12), nn.Tanh(), nn.Linear(12, V, bias=False))


def fsdp_bins() -> list[Streams]:
    """Four bins (two per rank): three archetypes with members, one all-masked."""
    specs = [("hot", [5, 1, 9, 4]), ("weighted_grpo", [6, 6, 2]), ("dummy", [3, 7]), ("hot", [8, 2, 2])]
    return [make_archetype(name, lens, seed=20 + i) for i, (name, lens) in enumerate(specs)]


def fsdp_plan(model: nn.Module, streams: Streams, seed: int) -> tuple[Plan, Outputs]:
    """A GRPO-shaped plan (PPO clip vs π_old, k3 KL to the reference, a masked sequence-level rollout
    correction, sequence-mean normalisation) and the model's log-probs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(streams.num_tokens, H, generator=g)
    labels = torch.randint(0, V, (streams.num_tokens,), generator=g)
    trn = torch.log_softmax(model(x), -1).gather(1, labels[:, None]).squeeze(1)
    noise = lambda: 0.2 * torch.randn(streams.num_tokens, generator=g)  # noqa: E731
    objective = PolicyGradient(
        "ppo_clip", penalties=(KLPenalty(0.05),), correction=RolloutCorrection("sequence", "mask", low=0.2, high=5.0)
    )
    plan = Plan(
        streams.seq_lens,
        {"rl": Component(objective, mask=streams.loss_mask, weights=streams.rl_weights, normalize="sequence_mean")},
        rollout_logprobs=trn.detach() + noise(),
        ref_logprobs=trn.detach() + noise(),
        advantages=streams.advantages,
        old_logprobs=trn.detach() + 0.5 * noise(),
    )
    return plan, Outputs(logprobs=trn)


def fsdp_worker(rank: int, world_size: int):
    from torch.distributed.fsdp import fully_shard

    model = fsdp_model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    bins = fsdp_bins()[2 * rank : 2 * rank + 2]
    parts = [fsdp_plan(model, b, seed=2 * rank + i) for i, b in enumerate(bins)]
    den = count_denominators([p for p, _ in parts], all_reduce=True)
    for i, (plan, outputs) in enumerate(parts):
        model.set_requires_gradient_sync(i == len(parts) - 1)  # reduce-scatter once, after the last
        # FSDP2 averages gradients over ranks; the global denominators already make the loss a sum.
        (compute_loss(plan, outputs, den).loss * world_size).backward()
    return [p.grad.full_tensor().clone() for p in model.parameters()]


def test_fsdp2_two_ranks_match_single_process():
    ranks = run_gloo(fsdp_worker, world_size=2, timeout=240)
    model = fsdp_model()
    parts = [fsdp_plan(model, b, seed=i) for i, b in enumerate(fsdp_bins())]
    den = count_denominators([p for p, _ in parts])
    sum(compute_loss(p, o, den).loss for p, o in parts).backward()
    want = [p.grad for p in model.parameters()]
    assert all(g.abs().sum() > 0 for g in want)
    for rank in ranks:
        for got, expected in zip(rank, want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------------
# Heterogeneous micro-batches: a component absent from some bins of the step
# ---------------------------------------------------------------------------------------------------

HETERO_LENS, HETERO_GROUPS = [3, 1, 2, 4], [0, 1, 0, 1]
HETERO_PARTS = [(slice(0, 4), slice(0, 2), True), (slice(4, 10), slice(2, 4), False)]  # tokens, sequences, sft


def hetero_step(mode: str) -> dict:
    """Ten tokens in four sequences; ``rl`` everywhere, ``sft`` members only in the first two sequences."""
    g = torch.Generator().manual_seed(3)
    theta = -torch.rand(10, generator=g, dtype=torch.float64) - 0.1
    return dict(
        mode=mode,
        theta=theta.requires_grad_(),
        old=theta.detach() + 0.1 * torch.randn(10, generator=g, dtype=torch.float64),
        adv=torch.randn(10, generator=g, dtype=torch.float64),
        rl=torch.tensor([1, 1, 0, 1, 1, 0, 1, 1, 1, 0], dtype=torch.bool),
        sft=torch.tensor([0, 1, 1, 1, 0, 0, 0, 0, 0, 0], dtype=torch.bool),
        constant=CONSTANT if mode == "constant" else None,
    )


def hetero_plan(c: dict, tokens: slice, seqs: slice, with_sft: bool) -> Plan:
    components = {"rl": Component(PolicyGradient("ppo_clip"), c["rl"][tokens], None, c["mode"], c["constant"])}
    if with_sft:
        components["sft"] = Component(SFT(), c["sft"][tokens], None, c["mode"], c["constant"])
    return Plan(HETERO_LENS[seqs], components, old_logprobs=c["old"][tokens], advantages=c["adv"][tokens],
                group_ids=HETERO_GROUPS[seqs])  # fmt: skip


def hetero_loss(c: dict, parts, **count) -> torch.Tensor:
    plans = [hetero_plan(c, *part) for part in parts]
    d = count_denominators(plans, num_groups=2, **count)
    return sum(
        compute_loss(p, Outputs(logprobs=c["theta"][t]), d).loss for p, (t, _, _) in zip(plans, parts, strict=True)
    )


def hetero_whole_gradient(mode: str) -> torch.Tensor:
    c = hetero_step(mode)
    return torch.autograd.grad(hetero_loss(c, [(slice(0, 10), slice(0, 4), True)]), c["theta"])[0]


@pytest.mark.parametrize("mode", MODES)
def test_a_component_absent_from_a_micro_batch_gets_the_step_denominator(mode):
    """Micro-batch A declares {rl, sft}, B only {rl}: the split step equals the whole bin (where sft has no
    members in B's positions) in gradient, for every mode. ``position`` used to count only the positions
    of the bins that declare the component (sft's D = 4 instead of 10)."""
    c = hetero_step(mode)
    (split,) = torch.autograd.grad(hetero_loss(c, HETERO_PARTS), c["theta"])
    assert torch.allclose(split, hetero_whole_gradient(mode), rtol=1e-12, atol=1e-15)


def _hetero_worker(rank: int, world_size: int) -> dict:
    out = {}
    for mode in MODES:
        c = hetero_step(mode)
        step_mode = (Normalize.of(mode), c["constant"])
        loss = hetero_loss(c, [HETERO_PARTS[rank]], all_reduce=True, modes={"rl": step_mode, "sft": step_mode})
        out[mode] = torch.autograd.grad(loss, c["theta"])[0]
    return out


def test_a_component_absent_from_a_rank_gets_the_step_denominator():
    """The same split over two gloo ranks: rank 1 has no sft and names it in ``modes``."""
    ranks = run_gloo(_hetero_worker, world_size=2, timeout=120)
    for mode in MODES:
        split = ranks[0][mode] + ranks[1][mode]
        assert torch.allclose(split, hetero_whole_gradient(mode), rtol=1e-12, atol=1e-15), mode


# ---------------------------------------------------------------------------------------------------
# One rank's checks fail: every rank raises the same error, none waits
# ---------------------------------------------------------------------------------------------------


def _selecting_plan(num_tokens: int) -> Plan:
    g = torch.Generator().manual_seed(num_tokens)
    old = -torch.rand(num_tokens, generator=g, dtype=torch.float64) - 0.1
    component = Component(PolicyGradient("clip_cov"), torch.ones(num_tokens, dtype=torch.bool))
    return Plan((num_tokens,), {"pg": component}, old_logprobs=old, advantages=torch.randn(num_tokens, generator=g))


def _grouped_plan(group_id: int) -> Plan:
    component = Component(SFT(), torch.ones(3, dtype=torch.bool), None, "group_mean")
    return Plan((3,), {"sft": component}, group_ids=[group_id])


ONE_RANK_FAILS = {
    # scenario: (what rank 0 counts, what rank 1 counts: (plans, count_denominators keywords)), rank 1's error
    "group id >= num_groups": (([_grouped_plan], 0, {"num_groups": 2}), ([_grouped_plan], 5, {"num_groups": 2})),
    "more tokens than max_rank_tokens": (
        ([_selecting_plan], 4, {"max_rank_tokens": 8}),
        ([_selecting_plan], 12, {"max_rank_tokens": 8}),
    ),
    "no max_rank_tokens": (([_selecting_plan], 4, {"max_rank_tokens": 8}), ([_selecting_plan], 4, {})),
    "empty rank without modes=": (([_grouped_plan], 0, {"num_groups": 2}), ([], 0, {"num_groups": 2})),
}
ONE_RANK_FAILS_SAYS = {
    "group id >= num_groups": "group id 5 >= num_groups=2",
    "more tokens than max_rank_tokens": "12 tokens > max_rank_tokens=8",
    "no max_rank_tokens": "needs max_rank_tokens=",
    "empty rank without modes=": "modes= for a rank without any",
}


def _one_rank_fails_worker(rank: int, world_size: int) -> dict:
    """Each scenario in turn; a rank that does not raise returns "no error" (the other then hangs:
    run_gloo's timeout fails the test)."""
    out = {}
    for scenario, per_rank in ONE_RANK_FAILS.items():
        builders, arg, keywords = per_rank[rank]
        plans = [build(arg) for build in builders]
        try:
            count_denominators(plans, all_reduce=True, **keywords)
            out[scenario] = "no error"
        except ValueError as exc:
            out[scenario] = str(exc)
    return out


def test_a_rank_whose_checks_fail_makes_every_rank_raise_the_same_error():
    ranks = run_gloo(_one_rank_fails_worker, world_size=2, timeout=60)
    for scenario, says in ONE_RANK_FAILS_SAYS.items():
        messages = [r[scenario] for r in ranks]
        assert messages[0] == messages[1], scenario
        assert "rank 1: ValueError" in messages[0] and says in messages[0], (scenario, messages[0])
        assert "rank 0:" not in messages[0], scenario


def test_the_denominator_of_an_unknown_component_names_the_components():
    plan = Plan((3,), {"sft": Component(SFT(), torch.ones(3, dtype=torch.bool))})
    with pytest.raises(ValueError, match=r"name 'typo' is not a component of these denominators: \['sft'\]"):
        count_denominators([plan]).denominator("typo")


@pytest.mark.parametrize("ids, size", [([0, 1, 2], 3), ([0, 5, 2], 6), ([0, 5, 20_000_000], None)])
def test_group_counts_are_sized_by_the_groups_not_the_largest_id(ids, size):
    """Three groups with dataset ids up to 2e7 used to allocate [2e7 + 1] counts per plan (615 MB, 1.3 s)."""
    component = Component(SFT(), torch.ones(3, dtype=torch.bool), None, "group_mean")
    plan = Plan((1, 1, 1), {"sft": component}, group_ids=ids)
    if size is not None:
        assert count_denominators([plan]).counts["sft"].numel() == size
        return
    for call in (lambda: count_denominators([plan]), lambda: compute_loss(plan, Outputs(logprobs=torch.zeros(3)))):
        with pytest.raises(ValueError, match=r"group_ids reach 20000000 for 3 distinct groups.*renumber"):
            call()
