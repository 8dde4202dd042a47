"""``packloss demo``: distil and RL-train a tiny Llama end to end on a verifiable task, packed.

The task: reverse a string of 3–8 digits. A prompt is ``^ d_1 … d_n :`` and the answer is
``d_n … d_1 $``; the reward is the fraction of the ``n + 1`` answer positions that are right (the
``$`` included), exact match is reported too. Held-out evaluation prompts never appear in training.

Phases (every loss is :func:`packloss.compute_loss` over packed bins with global denominators):

a. **teacher SFT** — the ``ce`` component on the answer tokens;
b. **student on-policy distillation** — the student samples, the teacher scores the sampled tokens,
   the ``ref_kl`` component (advantage ``ref − trn``, centred by the step's mean sampled KL: see
   :func:`train_step`) trains the student; or, with
   ``--distill full``, the exact full-vocabulary reverse KL on the same samples through the fused
   head (:func:`packloss.head.linear_distill`);
c. **student RL** — ``G`` samples per prompt, reward, group-normalised advantages
   (:func:`packloss.advantages.group_advantages`), the ``rl`` component with DPPO and the
   sampling pass's log-probs as inference log-probs.

Sequences are packed into bins of a token budget (``DemoConfig.bin_tokens``, :func:`packloss.packing.pack_ffd`);
positions restart at 0 for every sequence, which the Hugging Face Llama turns into a
block-diagonal causal mask (no token attends across sequences). With ``--nproc N`` the step's bins
are dealt to ``N`` DDP ranks (gloo on CPU, NCCL on CUDA) and padded with empty bins so every rank runs
backward the same number of times; denominators come from one all-reduce
(:func:`packloss.normalize.count_denominators`). Sampling is replicated on every rank (same seed,
same weights) — it plays the inference engine, which is outside packloss — so an ``N``-process run
trains on exactly the data of a one-process run. ``--emulate-ranks K`` makes one process accumulate
as ``K`` ranks would (same deal of bins, per-rank gradients and sums, combined as the all-reduces
do): for ``K ≤ 2`` its parameters are bit-identical to a ``--nproc K`` run's.

Needs the ``hf`` extra (``transformers``); ``rich`` or ``tqdm`` (progress bars) and ``matplotlib``
(the plot) are used when installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from packloss.advantages import group_advantages
from packloss.batch import PackedBatch
from packloss.compute import LossResult, compute_loss
from packloss.head import linear_distill
from packloss.hf import patch_causal_lm
from packloss.metrics import all_reduce_metrics, merge_metrics
from packloss.normalize import count_denominators
from packloss.packing import pack_ffd, position_ids, shard_bins
from packloss.pg import DPPO

__all__ = [
    "DemoConfig",
    "ModelSize",
    "Rollout",
    "add_arguments",
    "build_model",
    "encode_prompt",
    "encode_target",
    "generate",
    "main",
    "make_bin",
    "packed_logprobs",
    "run",
    "score",
]

# ---------------------------------------------------------------------------------------------------
# Task and tokenizer
# ---------------------------------------------------------------------------------------------------

PAD, BOS, SEP, EOS = 0, 1, 2, 3
DIGIT0 = 4  # token of digit d is DIGIT0 + d
VOCAB_SIZE = DIGIT0 + 10
_SYMBOLS = {PAD: "_", BOS: "^", SEP: ":", EOS: "$"}


def encode_prompt(digits: str) -> list[int]:
    """``^ d_1 … d_n :`` as token ids."""
    return [BOS, *(DIGIT0 + int(c) for c in digits), SEP]


def encode_target(digits: str) -> list[int]:
    """The answer ``d_n … d_1 $`` as token ids."""
    return [*(DIGIT0 + int(c) for c in reversed(digits)), EOS]


def decode(tokens: Sequence[int]) -> str:
    """Token ids back to text (``^`` BOS, ``:`` SEP, ``$`` EOS, ``_`` PAD)."""
    return "".join(_SYMBOLS.get(t, str(t - DIGIT0)) for t in tokens)


def score(digits: str, completion: Sequence[int]) -> tuple[float, bool]:
    """``(reward, exact)``: the fraction of the ``n + 1`` answer positions that are right, and whether
    the completion is exactly the answer."""
    target = encode_target(digits)
    right = sum(1 for i, t in enumerate(target) if i < len(completion) and completion[i] == t)
    return right / len(target), list(completion) == target


@dataclass(frozen=True)
class Task:
    """Digit strings of ``min_digits..max_digits`` and a fixed held-out evaluation set."""

    min_digits: int
    max_digits: int
    eval_prompts: tuple[str, ...]

    @classmethod
    def make(cls, min_digits: int, max_digits: int, num_eval: int, seed: int) -> Task:
        rng = random.Random(f"eval-{seed}")
        prompts: dict[str, None] = {}
        while len(prompts) < num_eval:
            prompts[_digits(rng, min_digits, max_digits)] = None
        return cls(min_digits, max_digits, tuple(prompts))

    def sample(self, rng: random.Random, n: int) -> list[str]:
        """``n`` training prompts, none of them in the evaluation set."""
        held_out = set(self.eval_prompts)
        out: list[str] = []
        while len(out) < n:
            digits = _digits(rng, self.min_digits, self.max_digits)
            if digits not in held_out:
                out.append(digits)
        return out

    @property
    def max_new_tokens(self) -> int:
        """Generation budget: the longest answer plus one token (to see a missing ``$``)."""
        return self.max_digits + 2


def _digits(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(str(rng.randrange(10)) for _ in range(rng.randint(lo, hi)))


# ---------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    intermediate: int


def build_model(size: ModelSize, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """A randomly initialised ``LlamaForCausalLM`` of ``size`` on the demo vocabulary, patched with
    :func:`packloss.hf.patch_causal_lm` (``model(ids, labels=...)`` returns fused-head log-probs)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.heads,
        max_position_embeddings=32,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
        use_cache=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
    return patch_causal_lm(model.to(device))


# ---------------------------------------------------------------------------------------------------
# Sampling (plays the inference engine: a padded batch through the model's own logits path)
# ---------------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """One prompt and its completion; ``logprobs`` ``[len(completion)]`` are the sampling pass's
    log-probs of the completion tokens (the inference log-probs), ``kl`` the per-token exact
    ``KL(student‖teacher)`` when a teacher was given."""

    digits: str
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    reward: float
    exact: bool
    kl: list[float] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.completion


def _last_logprobs(model: nn.Module, ids: Tensor, attention: Tensor) -> Tensor:
    """``[B, V]`` float32 log-probs of the next token of left-padded ``ids [B, T]``."""
    positions = (attention.cumsum(1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, -1]
    return torch.log_softmax(logits.float(), dim=-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[str],
    max_new_tokens: int,
    *,
    generator: torch.Generator | None = None,
    teacher: nn.Module | None = None,
    batch_size: int = 512,
) -> list[Rollout]:
    """Complete ``prompts``: sampled at temperature 1 with ``generator``, greedy without one.

    A completion stops at its first ``$`` or after ``len(answer) + 1`` tokens. With ``teacher``,
    each rollout also carries the exact per-token ``KL(model‖teacher)`` over the vocabulary.
    """
    out: list[Rollout] = []
    device = next(model.parameters()).device
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        encoded = [encode_prompt(p) for p in chunk]
        width = max(len(e) for e in encoded)
        ids = torch.full((len(chunk), width), PAD, dtype=torch.long)
        attention = torch.zeros(len(chunk), width, dtype=torch.long)
        for b, e in enumerate(encoded):
            ids[b, width - len(e) :] = torch.tensor(e)
            attention[b, width - len(e) :] = 1
        ids, attention = ids.to(device), attention.to(device)
        tokens, logprobs, kls = [], [], []
        for _ in range(max_new_tokens):
            logp = _last_logprobs(model, ids, attention)  # [B, V]
            if generator is None:
                nxt = logp.argmax(-1)
            else:
                nxt = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
            if teacher is not None:
                ref = _last_logprobs(teacher, ids, attention)
                kls.append((logp.exp() * (logp - ref)).sum(-1))
            tokens.append(nxt)
            logprobs.append(logp.gather(1, nxt[:, None]).squeeze(1))
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            attention = torch.cat([attention, torch.ones_like(nxt[:, None])], dim=1)
        tok = torch.stack(tokens, 1).tolist()  # sync-ok: the sampler hands tokens to the host once per batch
        lps = torch.stack(logprobs, 1).tolist()  # sync-ok: sampler output
        kl_rows = torch.stack(kls, 1).tolist() if kls else None  # sync-ok: sampler output
        for b, digits in enumerate(chunk):
            row = tok[b][: len(digits) + 2]
            length = row.index(EOS) + 1 if EOS in row else len(row)
            reward, exact = score(digits, row[:length])
            out.append(
                Rollout(
                    digits=digits,
                    prompt=encoded[b],
                    completion=row[:length],
                    logprobs=lps[b][:length],
                    reward=reward,
                    exact=exact,
                    kl=kl_rows[b][:length] if kl_rows else [],
                )
            )
    return out


def target_rollout(digits: str) -> Rollout:
    """The reference answer as a rollout (SFT data)."""
    completion = encode_target(digits)
    return Rollout(digits, encode_prompt(digits), completion, [0.0] * len(completion), 1.0, True)


# ---------------------------------------------------------------------------------------------------
# Packed bins
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bin:
    """One packed bin of ``N`` positions. ``input_ids``, ``positions``, ``labels``: ``[1, N]``
    (labels are next tokens within a sequence, ``-100`` at each sequence's last position);
    ``answer``: ``[N]`` bool, positions whose label is a completion token; ``inference_logprobs``,
    ``advantages``: ``[N]`` float, on the answer positions (0 elsewhere); ``num_real``: real tokens."""

    input_ids: Tensor
    positions: Tensor
    labels: Tensor
    seq_lens: tuple[int, ...]
    answer: Tensor
    inference_logprobs: Tensor
    advantages: Tensor
    num_real: int


def make_bin(rollouts: Sequence[Rollout], advantages: Sequence[float], device: torch.device | str) -> Bin:
    """Pack ``rollouts`` (with one advantage each) into a :class:`Bin`, sequence after sequence."""
    ids: list[int] = []
    labels: list[int] = []
    answer: list[bool] = []
    inference: list[float] = []
    adv: list[float] = []
    for r, a in zip(rollouts, advantages, strict=True):
        tokens, p = r.tokens, len(r.prompt)
        ids += tokens
        labels += tokens[1:] + [-100]
        # Position t scores token t + 1: the answer is scored at positions p − 1 … len − 2.
        answer += [p - 1 <= t < len(tokens) - 1 for t in range(len(tokens))]
        inference += [0.0] * (p - 1) + list(r.logprobs) + [0.0]
        adv += [float(a)] * len(tokens)
    lens = tuple(len(r.tokens) for r in rollouts)
    return Bin(
        input_ids=torch.tensor([ids], device=device),
        positions=position_ids(lens, device)[None],
        labels=torch.tensor([labels], device=device),
        seq_lens=lens,
        answer=torch.tensor(answer, device=device),
        inference_logprobs=torch.tensor(inference, device=device),
        advantages=torch.tensor(adv, device=device),
        num_real=sum(lens),
    )


def empty_bin(device: torch.device | str) -> Bin:
    """A one-token bin without members: a rank with fewer micro-batches runs it so that every rank
    runs forward and backward the same number of times."""
    one = torch.full((1, 1), PAD, dtype=torch.long, device=device)
    zero = torch.zeros(1, device=device)
    return Bin(one, one * 0, one * 0 - 100, (1,), zero.bool(), zero, zero, 0)


def packed_logprobs(model: nn.Module, b: Bin) -> Tensor:
    """``[N]`` log-probs of the bin's labels through the patched model (fused head, packed layout)."""
    out = model(b.input_ids, labels=b.labels, position_ids=b.positions, return_entropy=False)
    return out.logprobs[0]


class Policy(nn.Module):
    """The trained model's training forward, one module so that DDP wraps every path.

    ``forward(bin)`` returns the ``[N]`` log-probs of the bin's labels; ``forward(bin, teacher_hidden,
    teacher_weight, denominator)`` returns the full-vocabulary reverse KL of the answer positions
    through :func:`packloss.head.linear_distill` (a scalar, already divided by ``denominator``).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        b: Bin,
        teacher_hidden: Tensor | None = None,
        teacher_weight: Tensor | None = None,
        denominator: Tensor | None = None,
    ) -> Tensor:
        if teacher_hidden is None:
            return packed_logprobs(self.model, b)
        hidden = self.model.model(input_ids=b.input_ids, position_ids=b.positions).last_hidden_state[0]
        return linear_distill(
            hidden,
            self.model.lm_head.weight,
            teacher_hidden=teacher_hidden,
            teacher_weight=teacher_weight,
            loss_mask=b.answer,
            kind="reverse_kl",
            denominator=denominator,
        )


def _packed_batch(kind: str, b: Bin, trn: Tensor, ref: Tensor | None) -> PackedBatch:
    """The :class:`PackedBatch` of phase ``kind`` (``ce``, ``ref_kl``, ``full`` or ``rl``)."""
    none = torch.zeros_like(b.answer)
    weights = b.answer.to(trn.dtype)
    # The rl component always runs (it keeps the loss on the graph); with no members it still needs
    # the advantages stream that DPPO reads, so the other phases ship zeros.
    zeros = torch.zeros_like(trn)
    if kind == "ce":
        return PackedBatch(trn, trn.detach(), none, b.seq_lens, advantages=zeros, ce_weights=weights)
    if kind in ("ref_kl", "full"):
        ref = zeros if ref is None else ref
        return PackedBatch(
            trn, b.inference_logprobs, none, b.seq_lens, advantages=zeros, ref_logprobs=ref, ref_kl_weights=weights
        )
    return PackedBatch(trn, b.inference_logprobs, b.answer, b.seq_lens, advantages=b.advantages)


# ---------------------------------------------------------------------------------------------------
# Training step (packed, data-parallel)
# ---------------------------------------------------------------------------------------------------


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
    """One optimizer step over ``rollouts``: pack, deal bins to ranks, count the global denominators
    with one all-reduce, forward/backward every micro-batch (DDP syncs on the last), clip, step.

    ``kind``: ``ce`` (SFT), ``ref_kl`` (sampled-token distillation), ``full`` (full-vocabulary reverse
    KL) or ``rl``. With ``baseline`` the ``ref_kl`` advantage ``ref − trn`` is centred by the step's
    mean ``ref − inf`` over every rank (added to the reference stream: a constant shift, so the
    policy gradient keeps its expectation and loses most of its variance).

    ``emulate_ranks`` ``K`` (one process only): accumulate as ``K`` data-parallel ranks would — the
    same :func:`~packloss.packing.shard_bins` deal, each shard's gradients and sums accumulated
    apart, then combined across shards as the all-reduces do. With ``K ≤ 2`` the step is bit-identical
    to a ``K``-process step (a sum of two floats does not depend on the all-reduce's order); with more
    it is the same computation up to the all-reduce's summation order.
    """
    if emulate_ranks != 1 and ctx.world != 1:
        raise ValueError(f"emulate_ranks={emulate_ranks} needs a one-process run, not world size {ctx.world}")
    bins = pack_ffd([len(r.tokens) for r in rollouts], bin_tokens)
    world = ctx.world * emulate_ranks  # the data-parallel size, real or emulated
    shards = shard_bins(len(bins), world)
    groups = [
        [
            empty_bin(ctx.device)
            if k is None
            else make_bin([rollouts[i] for i in bins[k]], [advantages[i] for i in bins[k]], ctx.device)
            for k in shard
        ]
        for shard in (shards if ctx.world == 1 else [shards[ctx.rank]])
    ]  # this process's bins, one list per (emulated) rank
    mine = [b for group in groups for b in group]
    # The denominators depend on the masks only: count them before any forward (integer counts:
    # exact in float32, so the same whichever rank counts which bin).
    layouts = [_packed_batch(kind, b, torch.zeros(b.answer.shape, device=ctx.device), None) for b in mine]
    scales = count_denominators(layouts, all_reduce=ctx.world > 1, device=ctx.device).scales("token")
    refs = [_teacher_streams(kind, group, teacher) for group in groups]
    kl = torch.zeros((), device=ctx.device)
    if kind == "ref_kl":
        kl = _mean_sampled_kl(ctx, groups, refs)
        if baseline:
            refs = [[ref + kl for ref in group] for group in refs]
    ddp = isinstance(policy, nn.parallel.DistributedDataParallel)
    params = [p for p in policy.parameters() if p.requires_grad]
    shard_grads: list[list[Tensor | None]] = []
    results: list[LossResult] = []
    loss_sum = torch.zeros((), device=ctx.device)
    for group, group_refs in zip(groups, refs, strict=True):
        optimizer.zero_grad(set_to_none=True)
        for i, (b, ref) in enumerate(zip(group, group_refs, strict=True)):
            sync = i == len(group) - 1 or not ddp
            with contextlib.nullcontext() if sync else policy.no_sync():
                if kind == "full":
                    assert teacher is not None
                    loss = policy(b, ref, teacher.lm_head.weight, scales["ref_kl_scale"])
                else:
                    result = compute_loss(_packed_batch(kind, b, policy(b), ref), DPPO, **scales)
                    results.append(result)
                    loss = result.loss
                # DDP averages gradients over ranks; the global denominators already make it a sum.
                (loss * world).backward()
            loss_sum = loss_sum + loss.detach()
        shard_grads.append([p.grad for p in params])
    if emulate_ranks > 1:
        # What DDP's all-reduce computes from the ranks' gradients: the sum of grad / world.
        for p, grads in zip(params, zip(*shard_grads, strict=True), strict=True):
            reduced = [g * (1 / world) for g in grads if g is not None]
            p.grad = sum(reduced[1:], reduced[0]) if reduced else None
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    metrics, counts = merge_metrics(results) if results else ({}, {})
    if ctx.world > 1:
        if metrics:
            metrics, counts = all_reduce_metrics(metrics, counts)
        dist.all_reduce(loss_sum)
    if kind == "full":
        kl = loss_sum
    values = torch.stack([loss_sum, kl, *metrics.values()]).tolist()  # sync-ok: one read per step, for logging
    empty = [r for r, shard in enumerate(shards) if None in shard]
    tokens = sum(len(r.tokens) for r in rollouts)
    return StepStats(values[0], values[1], dict(zip(metrics, values[2:], strict=True)), tokens, len(bins), empty)


def _teacher_streams(kind: str, bins: Sequence[Bin], teacher: nn.Module | None) -> list[Tensor | None]:
    """Per bin, what the teacher contributes: ``ref_kl`` its ``[N]`` log-probs of the bin's tokens,
    ``full`` its ``[N, H]`` last hidden states (for the fused full-vocabulary KL), else None."""
    if kind not in ("ref_kl", "full"):
        return [None] * len(bins)
    assert teacher is not None
    with torch.no_grad():
        if kind == "ref_kl":
            return [packed_logprobs(teacher, b) for b in bins]
        return [teacher.model(input_ids=b.input_ids, position_ids=b.positions).last_hidden_state[0] for b in bins]


def _mean_sampled_kl(ctx: Dist, groups: Sequence[Sequence[Bin]], refs: Sequence[Sequence[Tensor]]) -> Tensor:
    """The step's mean of ``inf − ref`` over the answer tokens of every bin and rank (a sampled
    estimate of ``KL(student‖teacher)`` per token). One all-reduce of two numbers; ``groups`` are
    this process's bins per (emulated) rank, summed apart and then across, as the all-reduce does."""
    totals = []
    for bins, group_refs in zip(groups, refs, strict=True):
        total = torch.zeros(2, device=ctx.device)
        for b, ref in zip(bins, group_refs, strict=True):
            diff = torch.where(b.answer, b.inference_logprobs - ref, 0.0)
            total = total + torch.stack([diff.sum(), b.answer.sum(dtype=torch.float32)])
        totals.append(total)
    total = sum(totals[1:], totals[0])
    if ctx.world > 1:
        dist.all_reduce(total)
    return total[0] / total[1].clamp_min(1)


# ---------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoConfig:
    teacher: ModelSize = ModelSize(hidden=64, layers=2, heads=4, intermediate=256)
    student: ModelSize = ModelSize(hidden=64, layers=2, heads=4, intermediate=128)
    min_digits: int = 3
    max_digits: int = 8
    eval_prompts: int = 200
    eval_every: int = 100
    bin_tokens: int = 512
    sft_steps: int = 300
    sft_batch: int = 64
    sft_lr: float = 3e-3
    distill_steps: int = 800
    distill_batch: int = 64
    distill_lr: float = 3e-3
    rl_steps: int = 60
    rl_prompts: int = 16
    rl_group: int = 8
    rl_lr: float = 2e-3


DEFAULT = DemoConfig()
QUICK = replace(
    DEFAULT,
    bin_tokens=384,  # ~3 bins a step: with --nproc 2 one rank runs an empty bin every step
    eval_prompts=128,
    eval_every=40,
    sft_steps=100,
    distill_steps=60,
    rl_steps=15,
)


# ---------------------------------------------------------------------------------------------------
# Progress and output
# ---------------------------------------------------------------------------------------------------


class Progress:
    """A progress bar per phase with live fields: rich or tqdm on a terminal, plain lines otherwise."""

    def __init__(self, kind: str, phase: str, total: int) -> None:
        self.kind, self.phase, self.total, self.step = kind, phase, total, 0
        self._bar = None
        if kind == "rich":
            from rich import progress as rp

            columns = (rp.BarColumn(), rp.MofNCompleteColumn(), rp.TimeElapsedColumn(), "{task.fields[live]}")
            self._bar = rp.Progress("[bold]{task.description}", *columns)
            self._bar.start()
            self._task = self._bar.add_task(phase, total=total, live="")
        elif kind == "tqdm":
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=phase)

    def update(self, live: dict[str, float]) -> None:
        self.step += 1
        text = " ".join(f"{k}={v:.3g}" for k, v in live.items())
        if self.kind == "rich":
            self._bar.update(self._task, advance=1, live=text)
        elif self.kind == "tqdm":
            self._bar.set_postfix_str(text)
            self._bar.update(1)
        elif self.kind == "plain" and (self.step % max(1, self.total // 5) == 0 or self.step == self.total):
            print(f"  {self.phase} {self.step}/{self.total} {text}", flush=True)

    def close(self) -> None:
        if self.kind == "rich":
            self._bar.stop()
        elif self.kind == "tqdm":
            self._bar.close()


def _progress_kind(choice: str) -> str:
    if choice != "auto":
        return choice
    if not sys.stdout.isatty():
        return "plain"
    for name in ("rich", "tqdm"):
        with contextlib.suppress(ImportError):
            __import__(name)
            return name
    return "plain"


def format_table(summary: dict) -> str:
    """The final tables (checkpoints, then phases) as aligned plain text."""
    rows = [("checkpoint", "reward", "exact", "KL to teacher")]
    for name, e in summary["evals"].items():
        kl = "" if e.get("kl") is None else f"{e['kl']:.4f}"
        rows.append((name, f"{e['reward']:.3f}", f"{e['exact']:.3f}", kl))
    rows2 = [("phase", "steps", "tokens", "tokens/s", "wall s", "empty bins")]
    for name, p in summary["phases"].items():
        rows2.append((name, str(p["steps"]), str(p["tokens"]), f"{p['tokens_per_s']:.0f}", f"{p['wall_s']:.1f}",
                      str(sum(p["empty_bins"].values()))))  # fmt: skip
    return _align(rows) + "\n\n" + _align(rows2)


def _cell(text: str, width: int, left: bool) -> str:
    return text.ljust(width) if left else text.rjust(width)


def _align(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    cells = [[_cell(c, w, i == 0) for i, (c, w) in enumerate(zip(r, widths, strict=True))] for r in rows]
    lines = ["  ".join(r).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_curves(records: list[dict], path: Path) -> bool:
    """Reward, KL to teacher and loss against the step of each phase, to ``path`` (PNG). Returns
    False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    phases = list(dict.fromkeys(r["phase"] for r in records))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    offset, colors = 0, dict(zip(phases, ("tab:blue", "tab:orange", "tab:green"), strict=False))
    for phase in phases:
        train = [r for r in records if r["phase"] == phase and r["kind"] == "train"]
        evals = [r for r in records if r["phase"] == phase and r["kind"] == "eval"]
        c = colors[phase]
        xs = [offset + r["step"] for r in train]
        if any("reward" in r for r in train):
            axes[0].plot(xs, [r["reward"] for r in train], color=c, alpha=0.35, lw=1)
        axes[0].plot([offset + r["step"] for r in evals], [r["reward"] for r in evals], "o-", color=c, label=phase)
        if any("kl" in r for r in train):
            axes[1].plot(xs, [r["kl"] for r in train], color=c, alpha=0.35, lw=1)
        if any(r.get("kl") is not None for r in evals):
            axes[1].plot([offset + r["step"] for r in evals], [r["kl"] for r in evals], "o-", color=c, label=phase)
        axes[2].plot(xs, [r["loss"] for r in train], color=c, lw=1, label=phase)
        offset += max([r["step"] for r in train], default=0)
        for ax in axes:
            ax.axvline(offset, color="grey", lw=0.5, ls=":")
    axes[0].set(title="held-out reward (dots) / train reward (line)", xlabel="step", ylim=(0, 1.02))
    axes[1].set(title="KL(student‖teacher): held-out (dots) / sampled (line)", xlabel="step", yscale="log")
    axes[2].set(title="loss (sampled distillation's is centred: ≈ 0)", xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------


def evaluate(model: nn.Module, task: Task, teacher: nn.Module | None = None) -> dict[str, float | None]:
    """Greedy completions of the held-out prompts: mean reward, exact-match rate and (with ``teacher``)
    the mean per-token ``KL(model‖teacher)`` over the completion tokens."""
    model.eval()
    rollouts = generate(model, task.eval_prompts, task.max_new_tokens, teacher=teacher)
    model.train()
    kls = [k for r in rollouts for k in r.kl]
    return {
        "reward": sum(r.reward for r in rollouts) / len(rollouts),
        "exact": sum(r.exact for r in rollouts) / len(rollouts),
        "kl": sum(kls) / len(kls) if teacher is not None else None,
    }


class Recorder:
    """Rank 0's log: ``metrics.jsonl`` lines, the records for the plot, progress bars."""

    def __init__(self, out: Path | None, progress: str, active: bool) -> None:
        self.active, self.progress, self.records = active, progress, []
        self._file = open(out / "metrics.jsonl", "w") if out is not None and active else None  # noqa: SIM115

    def log(self, record: dict) -> None:
        if not self.active:
            return
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def bar(self, phase: str, total: int) -> Progress:
        return Progress(self.progress if self.active else "none", phase, total)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _phases(
    ctx: Dist, cfg: DemoConfig, args: argparse.Namespace, rec: Recorder
) -> tuple[dict, dict, nn.Module, nn.Module]:
    task = Task.make(cfg.min_digits, cfg.max_digits, cfg.eval_prompts, args.seed)
    teacher = build_model(cfg.teacher, args.seed * 1000 + 1, ctx.device)
    student = build_model(cfg.student, args.seed * 1000 + 2, ctx.device)
    lead = ctx.rank == 0
    evals: dict[str, dict] = {}
    phases: dict[str, dict] = {}

    def wrap(model: nn.Module) -> nn.Module:
        policy = Policy(model)
        if ctx.world == 1:
            return policy
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(policy, device_ids=ids)

    def checkpoint(name: str, phase: str, step: int, model: nn.Module, ref: nn.Module | None) -> dict | None:
        if not lead:
            return None
        result = evaluate(model, task, ref)
        rec.log({"kind": "eval", "phase": phase, "step": step, **result})
        if name:
            evals[name] = result
        return result

    def phase(name: str, kind: str, model: nn.Module, steps: int, lr: float, batch_fn, ref: nn.Module | None) -> None:
        policy = wrap(model)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
        rng = random.Random(f"{name}-{args.seed}")
        gen = torch.Generator(device=ctx.device).manual_seed(args.seed * 1000 + len(phases))
        bar = rec.bar(name, steps)
        ranks = ctx.world * args.emulate_ranks  # data-parallel ranks, real or emulated
        tokens, empty, eval_s, t0 = 0, {r: 0 for r in range(ranks)}, 0.0, time.perf_counter()
        eval_ref = ref if kind != "ce" else None
        for step in range(1, steps + 1):
            rollouts, advantages = batch_fn(model, rng, gen)
            stats = train_step(ctx, policy, optimizer, kind, rollouts, advantages, cfg.bin_tokens, ref,
                               args.baseline, args.emulate_ranks)  # fmt: skip
            tokens += stats.tokens
            for r in stats.empty_bins:
                empty[r] += 1
                if empty[r] == 1 and (r == ctx.rank or ctx.world == 1):  # the process that runs rank r says so
                    note = f"empty bin ({stats.bins} bins for {ranks} ranks)"
                    print(f"[rank {r}] {name} step {step}: {note}", flush=True)
            live = {"loss": stats.loss}
            if kind != "ce":  # SFT trains on the answers themselves: their reward is 1
                live["reward"] = sum(r.reward for r in rollouts) / len(rollouts)
            if kind in ("ref_kl", "full"):
                live["kl"] = stats.kl
            rec.log({"kind": "train", "phase": name, "step": step, **live, "tokens": stats.tokens,
                     "bins": stats.bins, "empty_bin_ranks": stats.empty_bins, "metrics": stats.metrics})  # fmt: skip
            if step % cfg.eval_every == 0 and step != steps:
                t_eval = time.perf_counter()
                result = checkpoint("", name, step, model, eval_ref)
                eval_s += time.perf_counter() - t_eval
                if result is not None:
                    live.update({f"eval_{k}": v for k, v in result.items() if v is not None})
            bar.update(live)
        wall = time.perf_counter() - t0 - eval_s
        bar.close()
        phases[name] = {"steps": steps, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                        "lr": lr, "kind": kind, "empty_bins": empty}  # fmt: skip

    def sft_batch(model, rng, gen):
        return [target_rollout(d) for d in task.sample(rng, cfg.sft_batch)], [0.0] * cfg.sft_batch

    def distill_batch(model, rng, gen):
        model.eval()
        rollouts = generate(model, task.sample(rng, cfg.distill_batch), task.max_new_tokens, generator=gen)
        model.train()
        return rollouts, [0.0] * len(rollouts)

    def rl_batch(model, rng, gen):
        prompts = [d for d in task.sample(rng, cfg.rl_prompts) for _ in range(cfg.rl_group)]
        model.eval()
        rollouts = generate(model, prompts, task.max_new_tokens, generator=gen)
        model.train()
        rewards = torch.tensor([r.reward for r in rollouts])
        groups = torch.arange(cfg.rl_prompts).repeat_interleave(cfg.rl_group)
        return rollouts, group_advantages(rewards, groups, cfg.rl_prompts).tolist()  # sync-ok: rollout side

    checkpoint("teacher_init", "sft", 0, teacher, None)
    phase("sft", "ce", teacher, cfg.sft_steps, cfg.sft_lr, sft_batch, None)
    checkpoint("teacher_sft", "sft", cfg.sft_steps, teacher, None)
    teacher.eval().requires_grad_(False)
    distill = "distill_full" if args.distill == "full" else "distill"
    checkpoint("student_init", distill, 0, student, teacher)
    phase(distill, "full" if args.distill == "full" else "ref_kl", student, cfg.distill_steps, cfg.distill_lr,
          distill_batch, teacher)  # fmt: skip
    checkpoint("student_distill", distill, cfg.distill_steps, student, teacher)
    rec.log({"kind": "eval", "phase": "rl", "step": 0, **evals.get("student_distill", {})})
    phase("rl", "rl", student, cfg.rl_steps, cfg.rl_lr, rl_batch, teacher)
    checkpoint("student_rl", "rl", cfg.rl_steps, student, teacher)
    return evals, phases, teacher, student


def acceptance(evals: dict[str, dict]) -> dict[str, float | bool]:
    """The issue's acceptance figures from the checkpoints."""
    teacher, init = evals["teacher_sft"], evals["student_init"]
    after, rl = evals["student_distill"], evals["student_rl"]
    return {
        "distill_reward_fraction_of_teacher": after["reward"] / max(teacher["reward"], 1e-9),
        "student_reward_gain": rl["reward"] - init["reward"],
        "rl_reward_change": rl["reward"] - after["reward"],
        "kl_reduction_factor": init["kl"] / max(after["kl"], 1e-12),
        "distill_reaches_90pct_of_teacher": after["reward"] >= 0.9 * teacher["reward"],
        "rl_does_not_lower_reward": rl["reward"] >= after["reward"] - 0.01,
        "kl_falls_5x": init["kl"] >= 5 * after["kl"],
    }


def _worker(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _train(Dist(rank, world, device), args)
    finally:
        if world > 1:
            dist.destroy_process_group()


def _train(ctx: Dist, args: argparse.Namespace) -> None:
    cfg = QUICK if args.quick else DEFAULT
    cfg = replace(cfg, **{k: v for k, v in (("sft_steps", args.sft_steps), ("distill_steps", args.distill_steps),
                                             ("rl_steps", args.rl_steps)) if v is not None})  # fmt: skip
    out = Path(args.out) if args.out else None
    lead = ctx.rank == 0
    if out is not None and lead:
        out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(out, args.progress, lead)
    t0 = time.perf_counter()
    evals, phases, teacher, student = _phases(ctx, cfg, args, rec)
    rec.close()
    if not lead:
        return
    summary = {
        "config": asdict(cfg),
        "seed": args.seed,
        "quick": args.quick,
        "distill": args.distill,
        "nproc": ctx.world,
        "emulate_ranks": args.emulate_ranks,
        "device": str(ctx.device),
        "threads": args.threads,
        "torch": torch.__version__,
        "wall_s": time.perf_counter() - t0,
        "evals": evals,
        "phases": phases,
        "acceptance": acceptance(evals),
    }
    print()
    print(format_table(summary))
    print(f"\nwall time {summary['wall_s']:.1f} s, {ctx.world} process(es), {ctx.device}")
    if out is not None:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        params = {"teacher": teacher.state_dict(), "student": student.state_dict()}
        torch.save({k: {n: t.cpu() for n, t in v.items()} for k, v in params.items()}, out / "params.pt")  # sync-ok
        if plot_curves(rec.records, out / "curves.png"):
            print(f"wrote {out / 'metrics.jsonl'}, {out / 'summary.json'}, {out / 'curves.png'}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``packloss demo`` options."""
    parser.add_argument("--quick", action="store_true", help="a short run (about a minute on 2 CPU cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write metrics.jsonl, summary.json, curves.png, params.pt here")
    parser.add_argument("--nproc", type=int, default=1, help="data-parallel processes (gloo on CPU, NCCL on CUDA)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--distill", choices=("sampled", "full"), default="sampled",
                        help="sampled-token ref_kl (on-policy distillation) or full-vocabulary reverse KL")  # fmt: skip
    parser.add_argument("--no-baseline", dest="baseline", action="store_false",
                        help="sampled distillation without the mean baseline (raw advantage ref − trn)")  # fmt: skip
    parser.add_argument("--emulate-ranks", type=int, default=1, metavar="K",
                        help="one process only: accumulate as K data-parallel ranks would, for bit-exact "
                        "comparison with --nproc K (exact for K <= 2)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--progress", choices=("auto", "rich", "tqdm", "plain", "none"), default="auto")
    parser.add_argument("--sft-steps", type=int, default=None)
    parser.add_argument("--distill-steps", type=int, default=None)
    parser.add_argument("--rl-steps", type=int, default=None)


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit code."""
    args.progress = _progress_kind(args.progress)
    if args.nproc < 1 or args.threads < 1 or args.emulate_ranks < 1:
        print("--nproc, --threads and --emulate-ranks must be at least 1", file=sys.stderr)
        return 2
    if args.nproc > 1 and args.emulate_ranks > 1:
        print("--emulate-ranks is for one process (it emulates --nproc K)", file=sys.stderr)
        return 2
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        print(f"--device cuda needs {args.nproc} GPU(s), found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    if args.nproc == 1:
        threads = torch.get_num_threads()
        try:
            _worker(0, 1, args, 0)
        finally:
            torch.set_num_threads(threads)  # the caller's setting, when called in-process
        return 0
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    mp.start_processes(_worker, args=(args.nproc, args, _free_port()), nprocs=args.nproc, start_method="spawn")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="packloss demo", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
