"""Data-parallel: DDP over two gloo processes, one rank fed an empty bin, equals one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from packloss import PackedBatch, all_reduce_metrics, compute_loss
from packloss.testing import make_archetype, run_gloo

H, V = 8, 16


def model_and_bins():
    torch.manual_seed(0)
    model = nn.Linear(H, V, bias=False)
    real = make_archetype("hot", [5, 1, 9, 4], seed=11)
    dummy = make_archetype("dummy", [3, 7], seed=12)
    return model, [real, dummy]


def logprob_batch(model: nn.Module, batch: PackedBatch, seed: int) -> PackedBatch:
    """Replace the bin's trainer log-probs by the model's, so gradients reach parameters."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch.num_tokens, H, generator=g)
    labels = torch.randint(0, V, (batch.num_tokens,), generator=g)
    trn = torch.log_softmax(model(x), -1).gather(1, labels[:, None]).squeeze(1)
    return PackedBatch(
        trainer_logprobs=trn,
        inference_logprobs=trn.detach() + 0.3 * torch.randn(batch.num_tokens, generator=g),
        loss_mask=batch.loss_mask,
        advantages=batch.advantages,
        seq_lens=list(batch.seq_lens),
    )


def global_scale(bins) -> int:
    return int(sum(b.loss_mask.sum() for b in bins))


def ddp_worker(rank: int, world_size: int):
    model, bins = model_and_bins()
    ddp = nn.parallel.DistributedDataParallel(model)
    result = compute_loss(logprob_batch(ddp, bins[rank], seed=rank), rl_scale=global_scale(bins))
    result.loss.backward()
    metrics, counts = all_reduce_metrics(result.metrics, result.counts)
    dist.barrier()
    return {
        "grad": model.weight.grad.clone(),
        "loss": result.loss.detach(),
        "metrics": metrics,
        "counts": counts,
    }


def test_ddp_with_an_empty_rank_matches_single_process():
    ranks = run_gloo(ddp_worker, world_size=2, timeout=180)
    model, bins = model_and_bins()
    results = [compute_loss(logprob_batch(model, b, seed=r), rl_scale=global_scale(bins)) for r, b in enumerate(bins)]
    sum(r.loss for r in results).backward()
    assert results[1].loss.item() == 0.0  # rank 1's bin is really empty
    # DDP averages gradients over ranks; global scales make the sum the step's gradient.
    for rank in ranks:
        assert torch.allclose(rank["grad"] * 2, model.weight.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(ranks[0]["grad"], ranks[1]["grad"])
    for key, value in results[0].metrics.items():
        assert torch.allclose(ranks[1]["metrics"][key], value, atol=1e-6), key
        assert ranks[1]["counts"][key] == results[0].counts[key]
