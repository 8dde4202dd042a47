"""Data-parallel: DDP and FSDP2 over two gloo processes (an empty bin on a rank, micro-batches,
global denominators) equal one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from packloss import (
    DPPO,
    Component,
    KLPenalty,
    Outputs,
    Plan,
    PolicyGradient,
    RolloutCorrection,
    all_reduce_metrics,
    compute_loss,
    count_denominators,
)
from packloss.testing import Streams, make_archetype, run_gloo

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
