"""packloss.core.top_entropy: the threshold against ``torch.quantile`` over the member entropies (bit for bit:
ties, q = 0 / tiny / 1, several bins, NaN and inf on non-members, float32 / float64 / bfloat16), the
selection ``H ≥ θ``, ``PolicyGradient(top_entropy=)`` against the clipped objective written out with
that mask, two gloo ranks against one quantile over both ranks' tokens (collectives counted), no sync
in one process, and the argument checks."""

from __future__ import annotations

import pytest
import torch

from packloss import Component, KLPenalty, Outputs, Plan, PolicyGradient, compute_loss
from packloss.core.top_entropy import TopEntropy, entropy_threshold
from packloss.core.trust_regions import PPOClip
from packloss.testing import OpCounter, run_gloo
from packloss.testing.dist import run_program

QUANTILES = (0.0, 1e-6, 0.01, 0.2, 0.5, 0.8, 0.999, 1.0)


def reference(quantile: float, entropies: list[torch.Tensor], members: list[torch.Tensor]) -> torch.Tensor:
    """TRL's definition: ``torch.quantile`` of the member entropies (at least float32) at ``1 − q``."""
    values = torch.cat([h[m] for h, m in zip(entropies, members, strict=True)])
    values = values.to(torch.promote_types(values.dtype, torch.float32))
    return torch.quantile(values, 1 - quantile) if values.numel() else torch.tensor(float("inf"))


def bins(seed: int, sizes: tuple[int, ...], dtype: torch.dtype, ties: bool):
    """Entropies and members of several bins; non-members hold NaN, +inf and -inf."""
    g = torch.Generator().manual_seed(seed)
    entropies, members = [], []
    for n in sizes:
        h = torch.randint(0, 4, (n,), generator=g).to(torch.float64) / 2 if ties else torch.rand(n, generator=g) * 3
        m = torch.rand(n, generator=g) < 0.7
        junk = torch.tensor([float("nan"), float("inf"), float("-inf")])[torch.randint(0, 3, (n,), generator=g)]
        entropies.append(torch.where(m, h.to(torch.float64), junk).to(dtype))
        members.append(m)
    return entropies, members


@pytest.mark.parametrize("quantile", QUANTILES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("sizes", [(1,), (7,), (40, 3, 25), (3000, 2000)])
def test_threshold_and_selection_equal_torch_quantile(quantile, dtype, ties, sizes):
    entropies, members = bins(len(sizes) * 31 + int(ties), sizes, dtype, ties)
    theta = entropy_threshold(quantile, entropies, members)
    expected = reference(quantile, entropies, members)
    assert theta.dtype == torch.promote_types(dtype, torch.float32)
    assert torch.equal(theta, expected.to(theta.dtype)), (theta, expected)
    top = TopEntropy(quantile).over(entropies, members)
    for h, m in zip(entropies, members, strict=True):
        keep = top.keep(h, m)
        assert torch.equal(keep, m & (h.to(theta.dtype) >= expected))
    if sizes == (1,) or not ties:
        return
    kept = sum(int(top.keep(h, m).sum()) for h, m in zip(entropies, members, strict=True))
    total = sum(int(m.sum()) for m in members)
    if quantile == 1.0:
        assert kept == total  # everything
    elif quantile == 0.0:
        top_value = max(float(h[m].max()) for h, m in zip(entropies, members, strict=True))
        assert kept == sum(int((h[m] == top_value).sum()) for h, m in zip(entropies, members, strict=True))


def test_a_bin_alone_is_its_own_step_and_edge_cases():
    h, m = torch.tensor([0.5, 2.0, 1.0, 3.0]), torch.tensor([True, True, False, True])
    assert torch.equal(TopEntropy(0.5).keep(h, m), torch.tensor([False, True, False, True]))  # θ = 2.0
    nobody = torch.zeros(4, dtype=torch.bool)
    assert entropy_threshold(0.2, [h], [nobody]).item() == float("inf")
    assert not TopEntropy(0.2).keep(h, nobody).any()
    nan_member = torch.tensor([0.5, float("nan"), 1.0, 3.0])
    assert torch.isnan(entropy_threshold(0.2, [nan_member], [m]))  # as torch.quantile: nothing kept
    assert torch.isnan(torch.quantile(nan_member[m], 0.8))
    given = TopEntropy(0.5, threshold=torch.tensor(0.75))
    assert torch.equal(given.keep(h, m), torch.tensor([False, True, False, True]))
    assert given == TopEntropy(0.5) and "threshold" not in repr(given)  # the rule, whatever the step's θ


# ---------------------------------------------------------------------------------------------------
# PolicyGradient(top_entropy=)
# ---------------------------------------------------------------------------------------------------


def policy_case(seed: int = 3, lens=(6, 9, 5)):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    f64 = torch.float64
    old = (torch.rand(n, generator=g, dtype=f64) * 0.9 + 0.05).log()
    trn = (old + 0.4 * torch.randn(n, generator=g, dtype=f64)).clamp(max=0).requires_grad_()
    ref = (torch.rand(n, generator=g, dtype=f64) * 0.9 + 0.05).log()
    adv = torch.randn(n, generator=g, dtype=f64)
    entropy = torch.rand(n, generator=g, dtype=f64) * 3
    mask = torch.rand(n, generator=g) < 0.8
    return list(lens), mask, old, trn, ref, adv, entropy


@pytest.mark.parametrize("quantile", [0.2, 0.5, 1.0])
def test_policy_gradient_zeroes_the_low_entropy_policy_term_only(quantile):
    """``ℓ_t = −keep_t · min(r A, clip(r) A) + β k3(ref − trn)``, token mean over every member."""
    lens, mask, old, trn, ref, adv, entropy = policy_case()
    beta = 0.05
    pg = PolicyGradient(PPOClip(0.2, 0.28), penalties=(KLPenalty(beta, "k3", "ref"),), top_entropy=TopEntropy(quantile))
    plan = Plan(lens, {"pg": Component(pg, mask)}, old_logprobs=old, ref_logprobs=ref, advantages=adv)
    poisoned = torch.where(mask, entropy, float("nan"))
    out = compute_loss(plan, Outputs(logprobs=trn, entropy=poisoned))
    keep = mask & (entropy >= torch.quantile(entropy[mask], 1 - quantile))
    r = torch.exp(trn - old)
    surrogate = torch.minimum(r * adv, r.clamp(0.8, 1.28) * adv)
    x = ref - trn
    k3 = torch.exp(x) - x - 1
    per_token = torch.where(keep, -surrogate, 0.0) + beta * k3
    expected = torch.where(mask, per_token, 0.0).sum() / mask.sum()
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=0)
    (g_out,) = torch.autograd.grad(out.loss, trn)
    (g_exp,) = torch.autograd.grad(expected, trn)
    torch.testing.assert_close(g_out, g_exp, rtol=1e-12, atol=1e-15)
    assert out.metrics["pg/high_entropy"].item() == pytest.approx(keep.sum().item() / mask.sum().item())
    if quantile < 1:
        assert 0 < keep.sum() < mask.sum()


def test_token_local_only_with_the_steps_threshold():
    lens, mask, old, trn, ref, adv, entropy = policy_case()
    plan = Plan(lens, {"pg": Component(PolicyGradient(), mask)}, old_logprobs=old, advantages=adv)
    alone = PolicyGradient(top_entropy=TopEntropy(0.2))
    assert not alone.token_local(plan)
    assert PolicyGradient(top_entropy=alone.top_entropy.over([entropy], [mask])).token_local(plan)


def test_no_sync_and_op_count_flat_in_the_number_of_sequences():
    counts = []
    for lens in ([10] * 2, [2] * 10):
        _, mask, old, trn, _, adv, entropy = policy_case(lens=lens)
        pg = PolicyGradient(top_entropy=TopEntropy(0.2))
        plan = Plan(lens, {"pg": Component(pg, mask)}, old_logprobs=old, advantages=adv)
        with OpCounter() as ops:
            step = TopEntropy(0.2).over([entropy[:7], entropy[7:]], [mask[:7], mask[7:]])
            compute_loss(plan, Outputs(logprobs=trn, entropy=entropy)).loss.backward()
        assert ops.num_syncs == 0 and step.threshold.dim() == 0
        counts.append(ops.total)
    assert counts[0] == counts[1]


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: TopEntropy(1.5), ValueError, r"TopEntropy.quantile must be in \[0, 1\]"),
        (lambda: TopEntropy(float("nan")), ValueError, "TopEntropy.quantile must be finite"),
        (lambda: TopEntropy(0.2, threshold=torch.zeros(2)), ValueError, "TopEntropy.threshold must have shape"),
        (lambda: PolicyGradient(top_entropy=0.2), TypeError, "top_entropy must be a TopEntropy"),
        (lambda: entropy_threshold(0.2, [torch.rand(3)], []), ValueError, "one tensor per bin"),
        (lambda: entropy_threshold(0.2, [torch.rand(3)], [torch.ones(3)]), TypeError, r"members\[0\] must be a bool"),
        (lambda: entropy_threshold(0.2, [torch.rand(3)], [torch.ones(2, dtype=torch.bool)]), ValueError,
         r"members\[0\] must have shape \[3\]"),
        (lambda: entropy_threshold(0.2, [torch.rand(3, 2)], [torch.ones(3, 2, dtype=torch.bool)]), ValueError,
         r"entropies\[0\] must have shape \[N\]"),
        (lambda: entropy_threshold(0.2, [], []), ValueError, "device="),
        (lambda: entropy_threshold(0.2, [torch.rand(3)], [torch.ones(3, dtype=torch.bool)], all_gather=1),
         TypeError, "all_gather must be a bool"),
    ],
)  # fmt: skip
def test_validation(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_missing_entropy_output_names_it():
    lens, mask, old, trn, _, adv, _ = policy_case()
    plan = Plan(lens, {"pg": Component(PolicyGradient(top_entropy=TopEntropy(0.2)), mask)}, old_logprobs=old,
                advantages=adv)  # fmt: skip
    with pytest.raises(ValueError, match="needs outputs.entropy"):
        compute_loss(plan, Outputs(logprobs=trn))


# ---------------------------------------------------------------------------------------------------
# Two ranks: one quantile over both ranks' tokens
# ---------------------------------------------------------------------------------------------------

SIZES = {0: (30, 12), 1: (500,)}  # unequal token counts: rank 1 holds most of the step's
GLOO_PROGRAM = """
import torch
import torch.distributed as dist
from packloss.core.top_entropy import TopEntropy
from packloss.testing import OpCounter
from tests.core.test_top_entropy import SIZES, bins

def worker(rank, world_size):
    entropies, members = bins(rank, SIZES[rank], torch.float32, ties=rank == 0)
    out = {}
    for name, bound in (("given", 500 + 42), ("measured", None)):
        for q in (0.01, 0.2, 1.0):
            with OpCounter() as ops:
                top = TopEntropy(q).over(entropies, members, all_gather=True, max_rank_tokens=bound)
                keep = [top.keep(h, m) for h, m in zip(entropies, members)]
            collectives = {k: v for k, v in ops.ops.items() if "allreduce" in k or "allgather" in k}
            out[name, q] = (top.threshold, keep, collectives, ops.num_syncs)
    dist.barrier()
    return out
"""


def test_two_ranks_take_one_quantile_over_both_ranks_tokens():
    ranks = run_gloo(run_program, world_size=2, args=(GLOO_PROGRAM, "worker"), timeout=120)
    data = {r: bins(r, SIZES[r], torch.float32, ties=r == 0) for r in (0, 1)}
    entropies = data[0][0] + data[1][0]
    members = data[0][1] + data[1][1]
    for (name, q), _ in ranks[0].items():
        expected = reference(q, entropies, members)  # torch.quantile over the concatenated member entropies
        for r, result in enumerate(ranks):
            theta, keep, collectives, syncs = result[name, q]
            assert torch.equal(theta, expected), (name, q, r, theta, expected)
            for h, m, got in zip(data[r][0], data[r][1], keep, strict=True):
                assert torch.equal(got, m & (h >= expected))
            gathers = sum(v for k, v in collectives.items() if "allgather" in k)
            reduces = sum(v for k, v in collectives.items() if "allreduce" in k)
            assert (reduces, gathers, syncs) == ((0, 1, 0) if name == "given" else (1, 1, 1)), collectives
    # not the quantile of either rank alone
    alone = [reference(0.2, *data[r]) for r in (0, 1)]
    assert all(not torch.equal(a, reference(0.2, entropies, members)) for a in alone)
