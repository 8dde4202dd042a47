"""The demo's training: one packed, data-parallel optimizer step (:func:`train_step`) and the three
phases of a run (:func:`run_phases`).

A step packs its rollouts into bins (:func:`~packloss.core.packing.pack_ffd`), deals them to the
ranks (:func:`~packloss.core.packing.shard_bins`, padded with empty bins), builds every bin's
:class:`~packloss.Plan` once, counts the step denominators from the plans before any forward
(:func:`~packloss.count_denominators`, one all-reduce), then runs
``compute_loss(plan, policy(bin), denominators)`` and backward per bin, and steps once.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from packloss.core.advantages import group_advantages
from packloss.core.bin import Normalize, Plan
from packloss.core.engine import LossResult, compute_loss
from packloss.core.metrics import all_reduce_metrics, merge_metrics
from packloss.core.packing import pack_ffd, shard_bins
from packloss.core.step import StepDenominators, count_denominators
from packloss.tools.demo.bins import COMPONENT, Bin, empty_bin, make_bin, make_plan, teacher_streams
from packloss.tools.demo.config import DemoConfig
from packloss.tools.demo.model import Policy, Rollout, build_model, evaluate, generate, target_rollout
from packloss.tools.demo.report import Recorder
from packloss.tools.demo.task import Task

__all__ = ["Dist", "StepStats", "train_step", "run_phases"]


@dataclass
class Dist:
    """This process's place: ``rank`` of ``world`` and the device."""

    rank: int
    world: int
    device: torch.device


@dataclass
class StepStats:
    loss: float
    kl: float  # sampled (ref_kl) or exact (full) per-token KL(student‖teacher) of the step; 0 otherwise
    metrics: dict[str, float]
    tokens: int
    bins: int
    empty_bins: list[int]  # ranks that ran an empty bin this step


# ---------------------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------------------


def train_step(
    ctx: Dist,
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    kind: str,
    rollouts: Sequence[Rollout],
    advantages: Sequence[float],
    bin_tokens: int,
    teacher: nn.Module | None = None,
    baseline: bool = True,
    emulate_ranks: int = 1,
) -> StepStats:
    """One optimizer step over ``rollouts``: pack, deal bins to ranks, build the plans, count the
    global denominators with one all-reduce, forward/backward every micro-batch (DDP syncs on the
    last), clip, step.

    ``kind``: ``ce`` (SFT), ``ref_kl`` (sampled-token distillation), ``full`` (full-vocabulary reverse
    KL) or ``rl`` (see :mod:`packloss.tools.demo.bins`). With ``baseline`` the ``ref_kl`` advantage
    ``ref − trn`` is centred by the step's mean ``ref − inf`` over every rank (added to the reference
    stream: a constant shift, so the policy gradient keeps its expectation and loses most of its
    variance).

    ``emulate_ranks`` ``K`` (one process only): accumulate as ``K`` data-parallel ranks would — the
    same :func:`~packloss.core.packing.shard_bins` deal, each shard's gradients and sums accumulated
    apart, then combined across shards as the all-reduces do. With ``K ≤ 2`` the step is bit-identical
    to a ``K``-process step (a sum of two floats does not depend on the all-reduce's order); with more
    it is the same computation up to the all-reduce's summation order.
    """
    if emulate_ranks != 1 and ctx.world != 1:
        raise ValueError(f"emulate_ranks={emulate_ranks} needs a one-process run, not world size {ctx.world}")
    bins = pack_ffd([len(r.tokens) for r in rollouts], bin_tokens)
    world = ctx.world * emulate_ranks  # the data-parallel size, real or emulated
    shards = shard_bins(len(bins), world)
    groups = _rank_bins(ctx, shards, bins, rollouts, advantages)
    plans, kl = _plans(ctx, kind, groups, teacher, baseline)
    denominators = _denominators(ctx, kind, plans)
    results, loss_sum = _accumulate(ctx, policy, optimizer, kind, groups, plans, denominators, world)
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    metrics, counts = merge_metrics(results)  # "{component}/{metric}", token-weighted over the bins
    if ctx.world > 1:
        metrics, counts = all_reduce_metrics(metrics, counts)
        dist.all_reduce(loss_sum)
    if kind == "full":
        kl = loss_sum  # the token-normalised reverse KL is the loss itself
    values = torch.stack([loss_sum, kl, *metrics.values()]).tolist()  # sync-ok: one read per step, for logging
    empty = [r for r, shard in enumerate(shards) if None in shard]
    tokens = sum(len(r.tokens) for r in rollouts)
    return StepStats(values[0], values[1], dict(zip(metrics, values[2:], strict=True)), tokens, len(bins), empty)


def _rank_bins(
    ctx: Dist,
    shards: list[list[int | None]],
    bins: list[list[int]],
    rollouts: Sequence[Rollout],
    advantages: Sequence[float],
) -> list[list[Bin]]:
    """This process's bins, one list per (emulated) rank; a ``None`` slot is an :func:`empty_bin`."""

    def build(k: int | None) -> Bin:
        if k is None:
            return empty_bin(ctx.device)
        return make_bin([rollouts[i] for i in bins[k]], [advantages[i] for i in bins[k]], ctx.device)

    own = shards if ctx.world == 1 else [shards[ctx.rank]]
    return [[build(k) for k in shard] for shard in own]


def _plans(
    ctx: Dist, kind: str, groups: list[list[Bin]], teacher: nn.Module | None, baseline: bool
) -> tuple[list[list[Plan]], Tensor]:
    """Every bin's plan (built once) and, for ``ref_kl``, the step's mean sampled KL (0 otherwise)."""
    refs = [teacher_streams(kind, group, teacher) for group in groups]
    kl = torch.zeros((), device=ctx.device)
    if kind == "ref_kl":
        kl = _mean_sampled_kl(ctx, groups, refs)
        if baseline:
            refs = [[ref + kl for ref in group] for group in refs]  # [N] each
    plans = [
        [make_plan(kind, b, ref, teacher) for b, ref in zip(group, group_refs, strict=True)]
        for group, group_refs in zip(groups, refs, strict=True)
    ]
    return plans, kl


def _denominators(ctx: Dist, kind: str, plans: list[list[Plan]]) -> StepDenominators:
    """The step's denominators from this process's plans (every emulated rank's) and, with several
    processes, every rank's: one all-reduce. Integer counts, exact whichever rank counts which bin."""
    flat = [p for group in plans for p in group]
    modes = None if flat else {COMPONENT[kind]: Normalize.TOKEN}  # a rank without plans still joins
    return count_denominators(flat, all_reduce=ctx.world > 1, modes=modes, device=ctx.device)


def _accumulate(
    ctx: Dist,
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    kind: str,
    groups: list[list[Bin]],
    plans: list[list[Plan]],
    denominators: StepDenominators,
    world: int,
) -> tuple[list[LossResult], Tensor]:
    """Forward/backward of every bin, each (emulated) rank into a gradient of its own; with several
    emulated ranks the gradient stepped on is their sum divided by ``world``, as DDP's all-reduce
    computes it. Returns the results and the sum of the bins' losses (0-d)."""
    ddp = isinstance(policy, nn.parallel.DistributedDataParallel)
    params = [p for p in policy.parameters() if p.requires_grad]
    shard_grads: list[list[Tensor | None]] = []
    results: list[LossResult] = []
    loss_sum = torch.zeros((), device=ctx.device)
    for group, group_plans in zip(groups, plans, strict=True):
        optimizer.zero_grad(set_to_none=True)
        for i, (b, plan) in enumerate(zip(group, group_plans, strict=True)):
            sync = i == len(group) - 1 or not ddp
            with contextlib.nullcontext() if sync else policy.no_sync():
                result = compute_loss(plan, policy(b, hidden=kind == "full"), denominators)
                # DDP averages gradients over ranks; the global denominators already make it a sum.
                (result.loss * world).backward()
            results.append(result)
            loss_sum = loss_sum + result.loss.detach()
        shard_grads.append([p.grad for p in params])
    if len(shard_grads) > 1:
        for p, grads in zip(params, zip(*shard_grads, strict=True), strict=True):
            reduced = [g * (1 / world) for g in grads if g is not None]
            p.grad = sum(reduced[1:], reduced[0]) if reduced else None
    return results, loss_sum


def _mean_sampled_kl(ctx: Dist, groups: Sequence[Sequence[Bin]], refs: Sequence[Sequence[Tensor]]) -> Tensor:
    """The step's mean of ``inf − ref`` over the answer tokens of every bin and rank (a sampled
    estimate of ``KL(student‖teacher)`` per token). One all-reduce of two numbers; ``groups`` are
    this process's bins per (emulated) rank, summed apart and then across, as the all-reduce does."""
    totals = []
    for bins, group_refs in zip(groups, refs, strict=True):
        total = torch.zeros(2, device=ctx.device)  # [Σ (inf − ref), answer tokens]
        for b, ref in zip(bins, group_refs, strict=True):
            diff = torch.where(b.answer, b.rollout_logprobs - ref, 0.0)  # [N]
            total = total + torch.stack([diff.sum(), b.answer.sum(dtype=torch.float32)])
        totals.append(total)
    total = sum(totals[1:], totals[0])
    if ctx.world > 1:
        dist.all_reduce(total)
    return total[0] / total[1].clamp_min(1)


# ---------------------------------------------------------------------------------------------------
# The phases of a run
# ---------------------------------------------------------------------------------------------------

Batch = tuple[list[Rollout], list[float]]
BatchFn = Callable[[nn.Module, random.Random, torch.Generator], Batch]


class _Run:
    """One run's phases on this process: the held-out task, the checkpoints and the phase log."""

    def __init__(self, ctx: Dist, cfg: DemoConfig, args: argparse.Namespace, rec: Recorder) -> None:
        self.ctx, self.cfg, self.args, self.rec = ctx, cfg, args, rec
        self.task = Task.make(cfg.min_digits, cfg.max_digits, cfg.eval_prompts, args.seed)
        self.evals: dict[str, dict] = {}
        self.phases: dict[str, dict] = {}

    def wrap(self, model: nn.Module) -> nn.Module:
        """The training forward of ``model``, in DDP with several processes."""
        policy = Policy(model)
        if self.ctx.world == 1:
            return policy
        ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(policy, device_ids=ids)

    def checkpoint(self, name: str, phase: str, step: int, model: nn.Module, ref: nn.Module | None) -> dict | None:
        """Rank 0 evaluates ``model`` on the held-out prompts and logs it (as checkpoint ``name`` if given)."""
        if self.ctx.rank != 0:
            return None
        result = evaluate(model, self.task, ref)
        self.rec.log({"kind": "eval", "phase": phase, "step": step, **result})
        if name:
            self.evals[name] = result
        return result

    def phase(
        self, name: str, kind: str, model: nn.Module, steps: int, lr: float, batch_fn: BatchFn, ref: nn.Module | None
    ) -> None:
        """``steps`` optimizer steps of phase ``kind`` on ``model``, each on ``batch_fn``'s rollouts."""
        ctx, args = self.ctx, self.args
        policy = self.wrap(model)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
        rng = random.Random(f"{name}-{args.seed}")
        gen = torch.Generator(device=ctx.device).manual_seed(args.seed * 1000 + len(self.phases))
        bar = self.rec.bar(name, steps)
        ranks = ctx.world * args.emulate_ranks  # data-parallel ranks, real or emulated
        tokens, empty, eval_s, t0 = 0, {r: 0 for r in range(ranks)}, 0.0, time.perf_counter()
        for step in range(1, steps + 1):
            rollouts, advantages = batch_fn(model, rng, gen)
            stats = train_step(ctx, policy, optimizer, kind, rollouts, advantages, self.cfg.bin_tokens, ref,
                               args.baseline, args.emulate_ranks)  # fmt: skip
            tokens += stats.tokens
            self._note_empty_bins(name, step, stats, empty, ranks)
            live = _live(kind, stats, rollouts)
            self.rec.log({"kind": "train", "phase": name, "step": step, **live, "tokens": stats.tokens,
                          "bins": stats.bins, "empty_bin_ranks": stats.empty_bins,
                          "metrics": stats.metrics})  # fmt: skip
            if step % self.cfg.eval_every == 0 and step != steps:
                t_eval = time.perf_counter()
                result = self.checkpoint("", name, step, model, ref if kind != "ce" else None)
                eval_s += time.perf_counter() - t_eval
                if result is not None:
                    live.update({f"eval_{k}": v for k, v in result.items() if v is not None})
            bar.update(live)
        wall = time.perf_counter() - t0 - eval_s
        bar.close()
        self.phases[name] = {"steps": steps, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                             "lr": lr, "kind": kind, "empty_bins": empty}  # fmt: skip

    def _note_empty_bins(self, name: str, step: int, stats: StepStats, empty: dict[int, int], ranks: int) -> None:
        """Count the ranks that ran an empty bin; the process that runs rank ``r`` says so the first time."""
        for r in stats.empty_bins:
            empty[r] += 1
            if empty[r] == 1 and (r == self.ctx.rank or self.ctx.world == 1):
                print(f"[rank {r}] {name} step {step}: empty bin ({stats.bins} bins for {ranks} ranks)", flush=True)

    def sft_batch(self, model: nn.Module, rng: random.Random, gen: torch.Generator) -> Batch:
        """The reference answers of fresh prompts (advantages unused)."""
        digits = self.task.sample(rng, self.cfg.sft_batch)
        return [target_rollout(d) for d in digits], [0.0] * self.cfg.sft_batch

    def distill_batch(self, model: nn.Module, rng: random.Random, gen: torch.Generator) -> Batch:
        """The student's samples of fresh prompts (advantages unused)."""
        rollouts = self._sample(model, self.task.sample(rng, self.cfg.distill_batch), gen)
        return rollouts, [0.0] * len(rollouts)

    def rl_batch(self, model: nn.Module, rng: random.Random, gen: torch.Generator) -> Batch:
        """``rl_group`` samples of each of ``rl_prompts`` fresh prompts and their group-normalised advantages."""
        cfg = self.cfg
        prompts = [d for d in self.task.sample(rng, cfg.rl_prompts) for _ in range(cfg.rl_group)]
        rollouts = self._sample(model, prompts, gen)
        rewards = torch.tensor([r.reward for r in rollouts])  # [P·G]
        groups = torch.arange(cfg.rl_prompts).repeat_interleave(cfg.rl_group)  # [P·G]
        return rollouts, group_advantages(rewards, groups, cfg.rl_prompts).tolist()  # sync-ok: rollout side

    def _sample(self, model: nn.Module, prompts: list[str], gen: torch.Generator) -> list[Rollout]:
        model.eval()
        rollouts = generate(model, prompts, self.task.max_new_tokens, generator=gen)
        model.train()
        return rollouts


def _live(kind: str, stats: StepStats, rollouts: Sequence[Rollout]) -> dict[str, float]:
    """The step's figures for the log and the progress bar."""
    live = {"loss": stats.loss}
    if kind != "ce":  # SFT trains on the answers themselves: their reward is 1
        live["reward"] = sum(r.reward for r in rollouts) / len(rollouts)
    if kind in ("ref_kl", "full"):
        live["kl"] = stats.kl
    return live


def run_phases(
    ctx: Dist, cfg: DemoConfig, args: argparse.Namespace, rec: Recorder
) -> tuple[dict, dict, nn.Module, nn.Module]:
    """Teacher SFT, student distillation (sampled or full), student RL, with held-out checkpoints.
    Returns ``(evals, phases, teacher, student)``."""
    run = _Run(ctx, cfg, args, rec)
    teacher = build_model(cfg.teacher, args.seed * 1000 + 1, ctx.device)
    student = build_model(cfg.student, args.seed * 1000 + 2, ctx.device)
    run.checkpoint("teacher_init", "sft", 0, teacher, None)
    run.phase("sft", "ce", teacher, cfg.sft_steps, cfg.sft_lr, run.sft_batch, None)
    run.checkpoint("teacher_sft", "sft", cfg.sft_steps, teacher, None)
    teacher.eval().requires_grad_(False)
    full = args.distill == "full"
    distill = "distill_full" if full else "distill"
    run.checkpoint("student_init", distill, 0, student, teacher)
    run.phase(distill, "full" if full else "ref_kl", student, cfg.distill_steps, cfg.distill_lr,
              run.distill_batch, teacher)  # fmt: skip
    run.checkpoint("student_distill", distill, cfg.distill_steps, student, teacher)
    rec.log({"kind": "eval", "phase": "rl", "step": 0, **run.evals.get("student_distill", {})})
    run.phase("rl", "rl", student, cfg.rl_steps, cfg.rl_lr, run.rl_batch, teacher)
    run.checkpoint("student_rl", "rl", cfg.rl_steps, student, teacher)
    return run.evals, run.phases, teacher, student
