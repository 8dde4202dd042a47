"""Data-parallel: DDP over two gloo processes, one rank fed an empty bin, equals one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from packloss import DPPO, Component, Outputs, Plan, all_reduce_metrics, compute_loss, count_denominators
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
