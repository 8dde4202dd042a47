"""A (data, context)-parallel invariance harness: one training step of a small model, run once in
one process over whole bins and once over ``dp × cp`` gloo ranks whose bins are split across CP
ranks, must give the same loss, parameter gradient (after DDP's real averaging) and metrics.
``docs/design.md``, "Context-parallel bins"; :func:`run_invariance` is what users run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from packloss.core.bin import Component, Normalize, Plan
from packloss.core.context_parallel import ContextShard
from packloss.core.corrections import GatedCorrection, OffPolicyMask, RolloutCorrection
from packloss.core.engine import compute_loss
from packloss.core.entropy import Entropy
from packloss.core.kl import KLPenalty, RatioWeightedKL
from packloss.core.metrics import all_reduce_metrics, merge_metrics
from packloss.core.outputs import Outputs
from packloss.core.pg import DPPO, REF_KL, PolicyGradient
from packloss.core.sft import SFT
from packloss.core.step import count_denominators
from packloss.core.trust_regions import GSPO, TRUST_REGIONS, StepSelector
from packloss.testing.dist import run_gloo
from packloss.vocab.component import VocabDistill

__all__ = ["Bin", "Case", "CollectiveCount", "STYLES", "LAYOUTS", "cases", "make_bins", "make_model", "shard_of",
           "plan_for", "outputs_for", "single_process", "run_invariance"]  # fmt: skip

STYLES = ("contiguous", "zigzag", "random")
"""How a bin is split over its CP ranks: ``torch.chunk`` of the row, zigzag, random positions."""
LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (4, 1))
"""The ``(dp, cp)`` layouts of the harness."""
H, V = 6, 11  # the model: logits = x @ W.T, W [V, H]


@dataclass(frozen=True)
class Bin:
    """One packed bin of the step: host ``seq_lens``, ``group_ids`` and its ``[N]`` streams."""

    seq_lens: tuple[int, ...]
    group_ids: tuple[int, ...]
    streams: dict[str, Tensor]

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)


@dataclass(frozen=True)
class Case:
    """A step's components: ``terms`` as ``(name, objective, normalize)``, over a bin's mask (and its
    weights when ``weighted``); ``select`` for a step-wide selection, ``logits`` / ``entropy`` when a
    component reads student logits (the plan then has teacher logits) or the entropy."""

    name: str
    terms: tuple[tuple[str, object, str], ...]
    weighted: bool = False
    select: bool = False
    logits: bool = False
    entropy: bool = False
    head: bool = False

    def components(self, streams: dict[str, Tensor]) -> dict[str, Component]:
        weights = streams["weights"] if self.weighted else None
        return {
            name: Component(objective, mask=streams["mask"], weights=weights, normalize=mode,
                            constant=7.0 if mode == "constant" else None)
            for name, objective, mode in self.terms
        }  # fmt: skip


_REGIONS = {"gspo": GSPO(clip_low=0.02, clip_high=0.02)}  # the default 3e-4 / 4e-4 clips every sequence here


def _region(name: str) -> object:
    return _REGIONS.get(name, name)


def _pg(name: str, objective: object, mode: str = "token", **flags: bool) -> Case:
    return Case(name, (("pg", objective, mode),), **flags)


SEQUENCE_COUPLED = ("ppo_clip", "gspo", "sequence_level", "sequence_ratio_clip", "geo_mean", "vespo", "topr")
"""The regions every mode is run with by default (PPO clip, and those that read per-sequence sums)."""


def cases(every_mode: bool = False) -> list[Case]:
    """Every registered trust region (weighted, token mean), every normalisation mode (for PPO clip and
    the sequence-coupled regions; for every region with ``every_mode``), every correction level and
    gate, the KL terms, SFT, entropy, sampled and full-vocabulary distillation (from logits and through
    the fused head), and a several-component step."""
    out = []
    for name, region in sorted(TRUST_REGIONS.items()):
        selects = issubclass(region, StepSelector)
        out.append(_pg(f"{name}/token-weighted", PolicyGradient(_region(name)), weighted=True, select=selects))
    modes = [m.value for m in Normalize]
    for region in sorted(TRUST_REGIONS) if every_mode else SEQUENCE_COUPLED:
        selects = issubclass(TRUST_REGIONS[region], StepSelector)
        out += [_pg(f"{region}/{m}", PolicyGradient(_region(region)), m, select=selects) for m in modes if m != "token"]
        if region in SEQUENCE_COUPLED:
            out.append(_pg(f"{region}/token", PolicyGradient(_region(region)), "token"))
    corrections = [
        RolloutCorrection("token", "truncate"), RolloutCorrection("token", "mask", high=1.5, low=0.5),
        RolloutCorrection("sequence", "truncate", high=3.0), RolloutCorrection("sequence", "mask", high=4.0, low=0.25),
        RolloutCorrection("sequence", "mask", high=1.5, low=0.6, sequence_agg="mean"),
        GatedCorrection(high=1.5, low=0.6), GatedCorrection(high=0.2, gating="binary_kl"),
        GatedCorrection(high=0.3, gating="tv"),
    ]  # fmt: skip
    for i, c in enumerate(corrections):
        out.append(_pg(f"correction{i}/{c.level}", PolicyGradient("ppo_clip", correction=c), "sequence_mean"))
    penalty = (KLPenalty(0.1, "k3", "ref"), KLPenalty(0.05, "k2", "old"))
    out += [
        _pg("kl_penalties", PolicyGradient(_region("gspo"), penalties=penalty), "group_mean"),
        _pg("dppo", DPPO, "sequence_mean"),
        _pg("off_policy_mask", PolicyGradient("ppo_clip", off_policy_mask=OffPolicyMask(0.0)), "sequence_mean"),
        _pg("ratio_cap", PolicyGradient("ipo", ratio="rollout", ratio_cap=1.05), "token"),
        _pg("ref_kl", REF_KL, "sequence_sum"),
        _pg("ratio_weighted_kl/sequence", RatioWeightedKL(0.1, level="sequence"), "sequence_mean"),
        Case("sft/sequence_mean", (("sft", SFT(), "sequence_mean"),), weighted=True),
        Case("entropy/position", (("entropy", Entropy(0.01), "position"),), entropy=True),
        Case("forward_kl/sequence_mean", (("kd", VocabDistill("forward_kl"), "sequence_mean"),), logits=True),
        Case("jsd/token", (("kd", VocabDistill("jsd"), "token"),), logits=True),
        Case("head_reverse_kl/sequence_mean", (("kd", VocabDistill("reverse_kl"), "sequence_mean"),), head=True),
        Case("head_jsd/group_mean", (("kd", VocabDistill("jsd", beta=0.3), "group_mean"),), head=True),
        Case(
            "pg+sft+entropy+kd",
            (("pg", PolicyGradient(_region("gspo")), "sequence_mean"), ("sft", SFT(), "token"),
             ("entropy", Entropy(0.01), "sequence_sum"), ("kd", VocabDistill("reverse_kl"), "group_mean")),
            entropy=True, logits=True,
        ),
    ]  # fmt: skip
    return out


def make_bins(num_bins: int = 4, seed: int = 0, max_len: int = 9) -> list[Bin]:
    """``num_bins`` bins of 1–6 sequences of 1–``max_len`` tokens (one of length 1; the third bin also
    one of ``3·max_len`` in second place, which spans every rank of a CP group of 4), prompts outside
    the mask, one sequence without members, per-sequence advantages, drifting log-prob streams."""
    g = torch.Generator().manual_seed(seed)
    model = make_model()
    bins, group = [], 0
    for b in range(num_bins):
        s = int(torch.randint(1, 7, (1,), generator=g))
        lens = [int(v) for v in torch.randint(1, max_len + 1, (s,), generator=g)]
        lens[0] = 1 if b % 2 else lens[0]
        if b == 2:
            lens.insert(1, 3 * max_len)
            s += 1
        n = sum(lens)
        seq_ids = torch.repeat_interleave(torch.arange(s), torch.tensor(lens))
        start = torch.tensor([0, *torch.tensor(lens).cumsum(0)[:-1].tolist()])[seq_ids]  # sync-ok: host-side test data
        prompt = torch.randint(0, 3, (s,), generator=g)[seq_ids]
        mask = (torch.arange(n) - start) >= prompt
        if s > 1:
            mask &= seq_ids != s - 1  # a sequence without members
        x = torch.randn(n, H, generator=g, dtype=torch.float64)
        labels = torch.randint(0, V, (n,), generator=g)
        with torch.no_grad():  # the streams drift around the model's own log-probs: regions bind on some tokens
            trn = torch.log_softmax(model(x), -1).gather(1, labels[:, None]).squeeze(1)  # [N]
        noise = torch.randn(3, n, generator=g, dtype=torch.float64) * torch.tensor([[0.15], [0.1], [0.3]])
        rollout, old, ref = (trn + noise).clamp(max=-1e-4)
        streams = {
            "mask": mask,
            "rollout": rollout,
            "old": old,
            "ref": ref,
            "advantages": torch.randn(s, generator=g, dtype=torch.float64)[seq_ids],
            "weights": torch.rand(n, generator=g, dtype=torch.float64) * 2,
            "x": x,
            "labels": labels,
            "teacher_logits": torch.randn(n, V, generator=g, dtype=torch.float64),
        }
        groups = tuple(group + i // 2 for i in range(s))
        group = groups[-1] + 1
        bins.append(Bin(tuple(lens), groups, streams))
    return bins


def shard_of(bin_: Bin, style: str, rank: int, size: int, seed: int, group: object = None) -> ContextShard:
    """The shard of ``bin_`` that CP rank ``rank`` of ``size`` holds in ``style`` (:data:`STYLES`)."""
    if style == "contiguous":
        return ContextShard.contiguous(bin_.seq_lens, rank, size, group)
    if style == "zigzag":
        return ContextShard.zigzag(bin_.seq_lens, rank, size, group)
    if style == "random":
        owner = torch.randint(0, size, (bin_.num_tokens,), generator=torch.Generator().manual_seed(seed))
        return ContextShard.of_positions(bin_.seq_lens, torch.arange(bin_.num_tokens)[owner == rank], group)
    raise ValueError(f"style must be one of {STYLES}, got {style!r}")


def make_model() -> nn.Module:
    """The harness's model: a float64 ``Linear(H, V)`` (per-token, so a shard's log-probs need no
    other rank), seeded."""
    torch.manual_seed(0)
    return nn.Linear(H, V, bias=False).to(torch.float64)


def plan_for(case: Case, bin_: Bin, positions: Tensor | None, shard: ContextShard | None) -> tuple[Plan, dict]:
    """The plan of ``bin_`` (its ``positions`` on ``shard``, or whole) and the streams it holds."""
    streams = bin_.streams if positions is None else {k: v[positions] for k, v in bin_.streams.items()}
    plan = Plan(
        bin_.seq_lens, case.components(streams), rollout_logprobs=streams["rollout"], ref_logprobs=streams["ref"],
        advantages=streams["advantages"], old_logprobs=streams["old"], group_ids=bin_.group_ids,
        teacher_logits=streams["teacher_logits"] if case.logits or case.head else None, shard=shard,
    )  # fmt: skip
    return plan, streams


def outputs_for(case: Case, model: nn.Module, streams: dict) -> Outputs:
    """The model's forward on ``streams``: log-probs of the labels, entropy and logits as ``case`` needs."""
    logits = model(streams["x"])  # [N, V]
    logp = torch.log_softmax(logits, -1)
    trn = logp.gather(1, streams["labels"][:, None]).squeeze(1)  # [N]
    entropy = -(logp.exp() * logp).sum(-1) if case.entropy else None
    if case.head:  # the model's own weight as the LM head over the features (DDP still ran its forward)
        weight = getattr(model, "module", model).weight  # [V, H]
        return Outputs(logprobs=trn, entropy=entropy, hidden=streams["x"], head_weight=weight)
    return Outputs(logprobs=trn, entropy=entropy, logits=logits if case.logits else None)


def _count(case: Case, plans: list[Plan], **kwargs) -> object:
    if not case.select:
        return count_denominators(plans, **kwargs)
    objectives = {k: c.loss for k, c in plans[0].components.items()} if plans else None
    return count_denominators(plans, objectives=objectives, max_rank_tokens=kwargs.pop("max_rank_tokens", None),
                              **kwargs)  # fmt: skip


def single_process(case: Case, bins: Sequence[Bin]) -> dict:
    """The step in one process over whole bins: ``loss``, ``grad`` and merged ``metrics``."""
    model = make_model()
    parts = [plan_for(case, b, None, None) for b in bins]
    den = _count(case, [p for p, _ in parts])
    results = [compute_loss(p, outputs_for(case, model, s), den) for p, s in parts]
    loss = sum(r.loss for r in results)
    loss.backward()
    metrics, counts = merge_metrics(results)
    return {"loss": loss.detach(), "grad": model.weight.grad.clone(), "metrics": metrics, "counts": counts}


class CollectiveCount:
    """Inside the ``with`` block, ``torch.distributed.all_reduce`` / ``all_gather_into_tensor`` /
    ``all_gather_single`` calls are counted in ``calls`` (op name and the first tensor's shape)."""

    def __enter__(self) -> CollectiveCount:
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        names = ("all_reduce", "all_gather_into_tensor", "all_gather_single")
        self._saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

        def recording(name):
            def call(tensor, *args, **kwargs):
                self.calls.append((name, tuple(tensor.shape)))
                return self._saved[name](tensor, *args, **kwargs)

            return call

        for n in self._saved:
            setattr(dist, n, recording(n))
        return self

    def __exit__(self, *exc) -> None:
        for n, fn in self._saved.items():
            setattr(dist, n, fn)


def _worker(rank: int, world: int, dp: int, cp: int, style: str, cases: Sequence[Case], bins: Sequence[Bin]) -> list:
    d, c = divmod(rank, cp)  # dp-major ranks: the cp ranks of one dp replica are consecutive
    cp_groups = [dist.new_group(list(range(i * cp, (i + 1) * cp))) for i in range(dp)]
    model = nn.parallel.DistributedDataParallel(make_model())  # averages gradients over all dp × cp ranks
    mine = list(bins)[d::dp]
    out = []
    for case in cases:
        model.zero_grad()
        parts = []
        for i, b in enumerate(mine):
            shard = shard_of(b, style, c, cp, seed=1000 * i + d, group=cp_groups[d])
            parts.append(plan_for(case, b, shard.positions, shard))
        max_tokens = sum(b.num_tokens for b in bins)
        groups = 1 + max(g for b in bins for g in b.group_ids)
        den = _count(case, [p for p, _ in parts], all_reduce=True, max_rank_tokens=max_tokens, num_groups=groups)
        with CollectiveCount() as comm:
            results = [compute_loss(p, outputs_for(case, model, s), den) for p, s in parts]
            loss = sum((r.loss for r in results), torch.zeros((), dtype=torch.float64))
            (loss * world).backward()  # DDP averages over dp·cp ranks: the step's gradient is their sum
        total = loss.detach().clone()
        dist.all_reduce(total)
        metrics, counts = merge_metrics(results) if results else ({}, {})
        metrics, counts = all_reduce_metrics(metrics, counts)
        out.append({"loss": total, "grad": model.module.weight.grad.clone(), "metrics": metrics, "counts": counts,
                    "collectives": comm.calls, "bins": len(parts)})  # fmt: skip
    return out


def run_invariance(cases: Sequence[Case], dp: int, cp: int, style: str, bins: Sequence[Bin] | None = None) -> list:
    """Run ``cases`` on ``dp × cp`` gloo ranks (``style`` shards) and in one process; returns, per
    case, ``(single, ranks)``: the single-process result and every rank's (loss summed over ranks,
    gradient after DDP, metrics all-reduced, the collectives ``compute_loss`` and backward ran)."""
    bins = make_bins() if bins is None else list(bins)
    ranks = run_gloo(_worker, world_size=dp * cp, args=(dp, cp, style, tuple(cases), tuple(bins)), timeout=600)
    return [(single_process(case, bins), [r[i] for r in ranks]) for i, case in enumerate(cases)]
