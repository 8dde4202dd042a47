"""packloss.core.context_parallel: the shard styles, their validation, a shard's layout, and on gloo
the bug classes of context-parallel losses (each reproduced on a deliberately wrong variant that
packloss's result differs from), zero syncs and op / collective counts flat in S."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from packloss import (
    Component,
    ContextShard,
    Plan,
    PolicyGradient,
    RolloutCorrection,
    all_reduce_metrics,
    compute_loss,
    gradient_scale,
)
from packloss.core.sft import SFT
from packloss.core.step import count_denominators
from packloss.core.trust_regions import GSPO
from packloss.testing import OpCounter
from packloss.testing.context_parallel import (
    Bin,
    Case,
    CollectiveCount,
    make_bins,
    make_model,
    outputs_for,
    plan_for,
    shard_of,
    single_process,
)
from packloss.testing.dist import run_gloo

LENS = (5, 1, 8, 3)


def test_contiguous_is_torch_chunk_of_the_row():
    n = sum(LENS)
    for size in (1, 2, 3, 4, 6, 20):
        chunks = torch.chunk(torch.arange(n), size)
        for rank in range(size):
            expected = chunks[rank] if rank < len(chunks) else torch.zeros(0, dtype=torch.long)
            assert torch.equal(ContextShard.contiguous(LENS, rank, size).positions, expected)


def test_zigzag_holds_chunks_r_and_mirror_of_every_sequence():
    for size in (1, 2, 3):
        parts = 2 * size
        for rank in range(size):
            expected, start = [], 0
            for length in LENS:
                for j in (rank, parts - 1 - rank):
                    expected += range(start + j * length // parts, start + (j + 1) * length // parts)
                start += length
            assert ContextShard.zigzag(LENS, rank, size).positions.tolist() == expected


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: ContextShard.of_positions(LENS, [0, 3, 3]), ValueError, "twice"),
        (lambda: ContextShard.of_positions(LENS, [0, 17]), ValueError, r"\[0, N=17\)"),
        (lambda: ContextShard.of_positions(LENS, torch.tensor([0.0])), TypeError, "integer"),
        (lambda: ContextShard.contiguous(LENS, 2, 2), ValueError, r"rank must be in \[0, size=2\)"),
        (lambda: ContextShard.zigzag(LENS, 0, 0), ValueError, "size"),
        (lambda: ContextShard(LENS, torch.zeros(2)), TypeError, "host"),
        (lambda: ContextShard.contiguous([], 0, 1), ValueError, "seq_lens"),
    ],
)
def test_shard_validation(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_plan_with_a_shard_checks_its_streams_and_seq_lens():
    shard = ContextShard.contiguous(LENS, 0, 2)  # 9 of 17 positions
    comp = {"pg": Component(PolicyGradient("gspo"), mask=torch.ones(9, dtype=torch.bool))}
    adv = torch.zeros(9)
    plan = Plan(LENS, comp, advantages=adv, shard=shard)
    assert plan.num_tokens == 9 and plan.num_seqs == 4 and plan.layout.sharded
    with pytest.raises(ValueError, match="whole bin's"):
        Plan((5, 1, 11), comp, advantages=adv, shard=shard)
    with pytest.raises(ValueError, match="the shard holds 9 tokens but"):
        Plan(LENS, {"pg": Component(PolicyGradient(), mask=torch.ones(17, dtype=torch.bool))}, shard=shard)
    with pytest.raises(TypeError, match="shard must be a ContextShard"):
        Plan(LENS, comp, advantages=adv, shard=(0, 1))
    with pytest.raises(ValueError, match="context-parallel shard"):
        plan.layout.to_padded(adv)


def test_shard_layout_names_the_bins_sequences_and_owners():
    shard = ContextShard.of_positions(LENS, [16, 2, 5, 6, 9])
    layout = shard.layout()
    assert layout.seq_ids.tolist() == [3, 0, 1, 2, 2]
    assert layout.num_seqs == 4 and layout.num_tokens == 5 and layout.seq_lens == LENS
    assert layout.segments.owned.tolist() == [False, True, True, False]  # first positions 0, 5, 6, 14


# ---------------------------------------------------------------------------------------------------
# On gloo: the bug classes, flat counts, no syncs
# ---------------------------------------------------------------------------------------------------

GSPO_SEQ_MEAN = Case("gspo/sequence_mean", (("pg", PolicyGradient(GSPO(0.02, 0.02)), "sequence_mean"),))


def _local_lens(b: Bin, shard: ContextShard) -> tuple[int, ...]:
    """The shard's positions read as a bin of their own: runs of one sequence (the wrong variant)."""
    ids = torch.repeat_interleave(torch.arange(len(b.seq_lens)), torch.tensor(b.seq_lens))[shard.positions]
    return tuple(torch.unique_consecutive(ids, return_counts=True)[1].tolist())


def _loss_and_grad(case: Case, parts, den) -> dict:
    model = make_model()
    results = [compute_loss(p, outputs_for(case, model, s), den) for p, s in parts]
    loss = sum(r.loss for r in results)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grad = model.weight.grad.clone()
    dist.all_reduce(grad)  # the step's gradient: the sum over ranks (what DDP's mean × world gives)
    return {"loss": total, "grad": grad, "results": results}


def _bug_worker(rank: int, world: int, dp: int) -> dict:
    cp = world // dp
    d, c = divmod(rank, cp)
    cp_group = [dist.new_group(list(range(i * cp, (i + 1) * cp))) for i in range(dp)][d]
    dp_group = [dist.new_group(list(range(j, world, cp))) for j in range(cp)][c]
    bins = make_bins(num_bins=4, seed=5)
    mine = bins[d::dp]
    shards = [ContextShard.contiguous(b.seq_lens, c, cp, cp_group) for b in mine]
    exact = [plan_for(GSPO_SEQ_MEAN, b, s.positions, s) for b, s in zip(mine, shards, strict=True)]
    out = {"exact": _loss_and_grad(GSPO_SEQ_MEAN, exact, count_denominators([p for p, _ in exact], all_reduce=True))}
    metrics = out["exact"]["results"][0]
    merged, counts = all_reduce_metrics(metrics.metrics, metrics.counts, group=cp_group)
    summed = {k: v.clone() for k, v in metrics.metrics.items()}
    for v in summed.values():
        dist.all_reduce(v, group=cp_group)  # SkyRL #1420: metrics summed over the CP ranks
    out["metrics"] = {"merged": merged, "summed": summed}
    # Megatron-LM #7513: each CP rank normalises by its own sequences and counts
    local = []
    for b, s in zip(mine, shards, strict=True):
        lens = _local_lens(b, s)
        streams = {k: v[s.positions] for k, v in b.streams.items()}
        local.append(plan_for(GSPO_SEQ_MEAN, Bin(lens, (0,) * len(lens), streams), None, None))
    out["cp_local"] = _loss_and_grad(GSPO_SEQ_MEAN, local, count_denominators([p for p, _ in local], all_reduce=True))
    # verl #5983: the step's counts all-reduced over the data-parallel group only
    den = count_denominators([p for p, _ in exact], all_reduce=True, group=dp_group)
    out["dp_only"] = _loss_and_grad(GSPO_SEQ_MEAN, exact, den)
    # axolotl #3608: the packed row taken as one sequence
    rows = []
    for b, s in zip(mine, shards, strict=True):
        whole = (b.num_tokens,)
        one = Bin(whole, (0,), b.streams)
        rows.append(plan_for(GSPO_SEQ_MEAN, one, s.positions, ContextShard(whole, s.positions, cp_group)))
    den = count_denominators([p for p, _ in rows], all_reduce=True)
    out["no_boundaries"] = _loss_and_grad(GSPO_SEQ_MEAN, rows, den)
    for key in ("exact", "cp_local", "dp_only", "no_boundaries"):
        out[key].pop("results")
    return out


@pytest.mark.parametrize("dp", [1, 2])
def test_each_bug_class_differs_and_packloss_equals_one_process(dp):
    world = 2 * dp
    ranks = run_gloo(_bug_worker, world_size=world, args=(dp,), timeout=300)
    single = single_process(GSPO_SEQ_MEAN, make_bins(num_bins=4, seed=5))
    for r in ranks:
        assert torch.allclose(r["exact"]["grad"], single["grad"], rtol=1e-12, atol=0)
        assert torch.allclose(r["exact"]["loss"], single["loss"], rtol=1e-12, atol=0)
        for wrong in ("cp_local", "no_boundaries") + (("dp_only",) if dp > 1 else ()):
            assert not torch.allclose(r[wrong]["grad"], single["grad"], rtol=1e-3), wrong
    if dp == 1:  # one bin per rank pair: the CP-merged metrics are the bin's, the CP-summed ones are not
        bin0 = single_process(GSPO_SEQ_MEAN, make_bins(num_bins=4, seed=5)[:1])
        for r in ranks:
            assert torch.allclose(r["metrics"]["merged"]["pg/loss"].double(), bin0["metrics"]["pg/loss"].double())
            assert not torch.allclose(r["metrics"]["summed"]["pg/loss"].double(), bin0["metrics"]["pg/loss"].double())


FLAT_CASES = (
    GSPO_SEQ_MEAN,
    Case("geo_mean/group_mean", (("pg", PolicyGradient("geo_mean"), "group_mean"),)),
    Case("tis/sequence_sum", (("pg", PolicyGradient(correction=RolloutCorrection("sequence")), "sequence_sum"),)),
)


def _flat_worker(rank: int, world: int) -> list:
    out = []
    for num_seqs in (2, 32):
        lens = [64 // num_seqs] * num_seqs
        b = make_bins(num_bins=1, seed=num_seqs)[0]
        streams = {k: v.new_zeros((64, *v.shape[1:])) + v[:1] for k, v in b.streams.items()}  # N = 64 tokens
        streams["mask"] = torch.arange(64) % 3 != 0
        b = Bin(tuple(lens), tuple(range(num_seqs)), streams)
        shard = ContextShard.zigzag(b.seq_lens, rank, world)
        for case in FLAT_CASES:
            plan, s = plan_for(case, b, shard.positions, shard)
            den = count_denominators([plan], all_reduce=True, num_groups=num_seqs)
            model = make_model()
            with CollectiveCount() as comm, OpCounter() as ops:
                compute_loss(plan, outputs_for(case, model, s), den).loss.backward()
            out.append((case.name, num_seqs, len(comm.calls), ops.total, ops.num_syncs))
    return out


def test_sync_free_and_flat_in_the_number_of_sequences():
    for rank in run_gloo(_flat_worker, world_size=2, timeout=240):
        by_case: dict[str, set] = {}
        for name, _, collectives, ops, syncs in rank:
            assert syncs == 0, name
            by_case.setdefault(name, set()).add((collectives, ops))
        for name, counts in by_case.items():
            assert len(counts) == 1, (name, counts)  # the same collectives and ops for S = 2 and 32
            ((collectives, _),) = counts
            assert 1 <= collectives <= 3, (name, collectives)


def _fsdp_worker(rank: int, world: int) -> list:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    flat = init_device_mesh("cpu", (world,))
    d, c = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
    model = fully_shard(make_model(), mesh=flat)
    bins = make_bins(num_bins=4, seed=7)[d::2]
    parts = []
    for b in bins:
        shard = ContextShard.zigzag(b.seq_lens, c, 2, mesh.get_group("cp"))
        parts.append(plan_for(GSPO_SEQ_MEAN, b, shard.positions, shard))
    den = count_denominators([p for p, _ in parts], all_reduce=True)
    loss = sum(compute_loss(p, outputs_for(GSPO_SEQ_MEAN, model, s), den).loss for p, s in parts)
    (loss * gradient_scale(flat)).backward()
    return [p.grad.full_tensor().clone() for p in model.parameters()]


def test_fsdp2_over_a_dp_cp_mesh_with_gradient_scale_matches_one_process():
    ranks = run_gloo(_fsdp_worker, world_size=4, timeout=300)
    single = single_process(GSPO_SEQ_MEAN, make_bins(num_bins=4, seed=7))
    for grads in ranks:
        torch.testing.assert_close(grads[0], single["grad"], rtol=1e-12, atol=0)


def _gradient_scale_worker(rank: int, world: int) -> tuple[float, float]:
    return gradient_scale(), gradient_scale(init_device_mesh("cpu", (world,)))


def test_gradient_scale_is_the_averaging_groups_size():
    assert run_gloo(_gradient_scale_worker, world_size=2) == [(2.0, 2.0), (2.0, 2.0)]


PER_SEQUENCE = Case(
    "per-sequence",
    (("pg", PolicyGradient(GSPO(0.02, 0.02), correction=RolloutCorrection("sequence", "mask", high=3.0, low=0.3)),
      "sequence_mean"), ("sft", SFT(), "token")),
)  # fmt: skip


def _per_sequence_worker(rank: int, world: int) -> list:
    out = []
    for style in ("contiguous", "zigzag", "random"):
        b = make_bins(num_bins=1, seed=11, max_len=12)[0]
        shard = shard_of(b, style, rank, world, seed=4)
        plan, s = plan_for(PER_SEQUENCE, b, shard.positions, shard)
        result = compute_loss(plan, outputs_for(PER_SEQUENCE, make_model(), s), per_sequence_metrics=True)
        out.append((result.metrics, result.counts))
    return out


def test_per_sequence_metrics_of_a_shard_are_the_whole_sequences():
    b = make_bins(num_bins=1, seed=11, max_len=12)[0]
    plan, s = plan_for(PER_SEQUENCE, b, None, None)
    whole = compute_loss(plan, outputs_for(PER_SEQUENCE, make_model(), s), per_sequence_metrics=True)
    assert plan.num_seqs > 2
    for rank in run_gloo(_per_sequence_worker, world_size=3, timeout=240):
        for metrics, counts in rank:
            assert set(metrics) == set(whole.metrics)
            for key, value in whole.metrics.items():
                torch.testing.assert_close(metrics[key].double(), value.double(), rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(counts[key].double(), whole.counts[key].double())
