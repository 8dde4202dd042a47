"""The RL rows of ``packloss bench peers``: the policy-gradient losses of TRL and verl (their own code,
and their formulas written plainly, eager and compiled) beside packloss's engine on the same micro-batch,
padded and packed, at several shapes, checked equal before timing; every variant returns the loss and
its metrics. ``docs/benchmarks.md``, "How the suites measure"."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from packloss.core.bin import Plan
from packloss.core.step import count_denominators
from packloss.testing.trl import bare_grpo_trainer, padded_inputs, stub_forward, trl_config
from packloss.tools.bench import naive_rl
from packloss.tools.bench._measure import ValuesDisagree, check, import_peer
from packloss.tools.bench.loss import _interleaved_ms, native_step

__all__ = ["RL_RTOL", "RL_EXACT_RTOL", "METRIC_ATOL", "RLBatch", "rl_batch", "run_rl"]

RL_RTOL = 1e-6
RL_EXACT_RTOL = 1e-10
METRIC_ATOL = 1e-5  # float32 metrics (fractions, a mean log-ratio): absolute, a fraction may be exactly 0

_Loss = tuple[Tensor, dict[str, Any]]  # (loss, metrics): what every variant returns


@dataclass(frozen=True)
class RLBatch:
    """One micro-batch, padded ``[B, T]`` (the peers' layout) and packed ``[N]`` (packloss's).
    ``valid``: the completion tokens; ``mask`` ⊆ ``valid``: the loss members (about 5% holes)."""

    seq_lens: list[int]
    valid: Tensor  # [B, T] bool
    mask: Tensor  # [B, T] bool
    logp: Tensor  # [B, T] trainer log-probs (padding: 0)
    old: Tensor  # [B, T]
    adv: Tensor  # [B] one advantage per sequence

    def packed(self, x: Tensor) -> Tensor:
        return x[self.valid]  # untimed: building the packed streams

    def to(self, dtype: torch.dtype) -> RLBatch:
        """The same batch with its float streams in ``dtype`` (the float64 check)."""
        return dataclasses.replace(self, logp=self.logp.to(dtype), old=self.old.to(dtype), adv=self.adv.to(dtype))


def rl_batch(num_tokens: int, num_seqs: int, seed: int = 0) -> RLBatch:
    """Lengths proportional to draws uniform in ``[0.1, 1.9]``, summing to ``num_tokens`` (padded width
    ≈ 1.9 × the mean); ``log π_old`` in ``log [0.05, 0.95]``, ``log π_θ`` 0.3-normal around it, unit-normal
    advantages."""
    if not 1 <= num_seqs <= num_tokens:
        raise ValueError(f"rl_batch: need 1 <= num_seqs <= num_tokens, got {num_seqs} and {num_tokens}")
    g = torch.Generator().manual_seed(seed)
    draws = 0.1 + 1.8 * torch.rand(num_seqs, generator=g)
    lens = (draws / draws.sum() * num_tokens).floor().long().clamp(min=1)
    while int(lens.sum()) != num_tokens:  # sync-ok: host-side bench data; < num_seqs rounds
        i = int(lens.argmin() if int(lens.sum()) < num_tokens else lens.argmax())
        lens[i] += 1 if int(lens.sum()) < num_tokens else -1
    width = int(lens.max())
    valid = torch.arange(width) < lens[:, None]  # [B, T]
    mask = valid & (torch.rand(num_seqs, width, generator=g) > 0.05)
    mask[:, 0] = True
    old = (torch.rand(num_seqs, width, generator=g) * 0.9 + 0.05).log()
    logp = (old + 0.3 * torch.randn(num_seqs, width, generator=g)).clamp(max=-1e-3)
    zero = torch.zeros(())
    return RLBatch(
        seq_lens=lens.tolist(),  # sync-ok: bench data setup, outside the timed step
        valid=valid,
        mask=mask,
        logp=torch.where(valid, logp, zero),
        old=torch.where(valid, old, zero),
        adv=torch.randn(num_seqs, generator=g),
    )


def _packloss_plan(recipe: Any, b: RLBatch) -> Plan:
    adv = b.adv[:, None].expand_as(b.valid)
    return Plan(b.seq_lens, recipe.for_bin(b.packed(b.mask)), old_logprobs=b.packed(b.old), advantages=b.packed(adv))


def _trl_config(b: RLBatch) -> SimpleNamespace:
    fields = {"loss_type": "dapo", "epsilon_high": 0.28, "max_completion_length": b.valid.shape[1]}
    fields |= {"per_device_train_batch_size": len(b.seq_lens), "steps_per_generation": 1}
    return trl_config(**fields)


def _trl_loss(trainer: Any, b: RLBatch, logp: Tensor) -> _Loss:
    """TRL's ``_compute_loss`` on the padded batch, its forward a stub returning ``logp``; the metrics it logged."""
    stub_forward(trainer, logp, torch.zeros_like(b.logp))
    logged = trainer._metrics["train"]
    logged.clear()  # TRL appends its metrics on every call
    tool_mask = torch.where(b.valid, b.mask, True).long()  # TRL pads the tool mask with 1
    inputs = padded_inputs(b.valid.long(), tool_mask, b.adv, b.mask.sum(), old_per_token_logps=b.old)
    loss = trainer._compute_loss(None, inputs)
    return loss, {name: values[-1] for name, values in logged.items()}


def _verl_config(loss_mode: str) -> Any:
    from verl.trainer.config import RolloutCorrectionConfig
    from verl.workers.config import ActorConfig, PolicyLossConfig

    policy = PolicyLossConfig(loss_mode=loss_mode, rollout_correction=RolloutCorrectionConfig(rollout_is=None))
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode="token-mean",
        policy_loss=policy,
        use_kl_loss=False,
        entropy_coeff=0.0,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
    )


def _verl_loss(loss_fn: Callable, cfg: Any, b: RLBatch, adv: Tensor, logp: Tensor) -> _Loss:
    """verl's policy loss on the padded batch, as ``ppo_loss`` calls it on one rank and micro-batch
    (advantages ``[B, T]``, as verl's batch holds them, built once outside the step)."""
    return loss_fn(
        old_log_prob=b.old, log_prob=logp, advantages=adv, response_mask=b.mask, loss_agg_mode="token-mean",
        config=cfg, rollout_is_weights=None,
    )  # fmt: skip


@dataclass(frozen=True)
class _RLCase:
    """One comparison: the peer's loss of padded log-probs, whether its own code is compiled too (verl's
    loss is a function; TRL's math sits inside ``_compute_loss`` with the model call and the metric
    gathers, which ``torch.compile`` runs mostly eager), the packloss recipe of the peer's config, and
    the peer's formula written plainly (:mod:`naive_rl`) with the advantages as the peer receives them."""

    name: str
    peer: str
    peer_loss: Callable[[Tensor], _Loss]
    peer_compiles: bool
    recipe: Any
    naive: Callable[..., _Loss]
    naive_adv: Tensor  # [B, 1] or [B, T]


def _rl_cases(b: RLBatch, notes: list[str]) -> list[_RLCase]:
    cases = []
    grpo_trainer, why = import_peer("trl", "GRPOTrainer")
    if grpo_trainer is None:
        notes.append(f"rl/dapo·trl: {why}")
    else:
        from packloss.integrations.trl import from_trl

        cfg = _trl_config(b)
        trainer = bare_grpo_trainer(grpo_trainer, cfg)
        naive = functools.partial(naive_rl.ppo_clip, eps_low=trainer.epsilon_low, eps_high=trainer.epsilon_high)
        peer_loss = functools.partial(_trl_loss, trainer, b)
        cases.append(_RLCase("rl/dapo·trl", "trl", peer_loss, False, from_trl(cfg), naive, b.adv[:, None]))
    get_policy_loss_fn, why = import_peer("verl.trainer.ppo.core_algos", "get_policy_loss_fn")
    if get_policy_loss_fn is None:
        notes.append(f"rl/ppo_clip·verl, rl/dppo_tv·verl: {why}")
        return cases
    from packloss.integrations.verl import from_verl

    adv = b.adv[:, None].expand_as(b.valid).contiguous()  # [B, T]
    for mode, label, formula in (("vanilla", "ppo_clip", naive_rl.dual_clip), ("dppo_tv", "dppo_tv", naive_rl.dppo_tv)):
        cfg = _verl_config(mode)
        cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(b.mask.sum()), global_batch_size=len(b.seq_lens))
        peer_loss = functools.partial(_verl_loss, get_policy_loss_fn(mode), cfg, b, adv)
        naive = functools.partial(formula, eps_low=cfg.clip_ratio_low, eps_high=cfg.clip_ratio_high, c=cfg.clip_ratio_c)
        recipe = from_verl(cfg, response_length=b.valid.shape[1])
        cases.append(_RLCase(f"rl/{label}·verl", "verl", peer_loss, True, recipe, naive, adv))
    return cases


def _on_padded(variant: str) -> bool:
    return not variant.startswith("packloss")


_Variants = tuple[dict[str, Callable[[], _Loss]], Tensor, Tensor]


def _rl_variants(case: _RLCase, b: RLBatch, compiled: bool) -> _Variants:
    """``({variant: (loss, metrics)()}, packed leaf [N], padded leaf [B, T])``; plan, denominators and
    the naive rows' inputs built here, once. Compiled variants are compiled for this batch's shapes."""
    plan = _packloss_plan(case.recipe, b)
    den = count_denominators([plan])
    packed = b.packed(b.logp).clone().requires_grad_()  # [N]
    padded = b.logp.clone().requires_grad_()  # [B, T]
    n = b.mask.sum().to(b.logp.dtype)  # the peers' token-mean denominator (one rank, one micro-batch)
    naive_args = (b.old, case.naive_adv, b.mask, n)
    fns: dict[str, Callable[[], _Loss]] = {
        "packloss_eager": lambda: native_step(plan, packed, den),
        case.peer: lambda: case.peer_loss(padded),
        "naive_eager": lambda: case.naive(padded, *naive_args),
    }
    if compiled:
        step_fn, naive_fn = torch.compile(native_step, dynamic=False), torch.compile(case.naive, dynamic=False)
        fns["packloss_compiled"] = lambda: step_fn(plan, packed, den)
        fns["naive_compiled"] = lambda: naive_fn(padded, *naive_args)
        if case.peer_compiles:
            peer_fn = torch.compile(case.peer_loss, dynamic=False)
            fns[f"{case.peer}_compiled"] = lambda: peer_fn(padded)
    return fns, packed, padded


def _check_metrics(what: str, metrics: dict[str, Tensor], expected: dict[str, float], atol: float) -> None:
    """The naive formula's metrics against the peer's logged ones, each within ``atol``."""
    for name, value in expected.items():
        if name not in metrics:
            continue  # a metric the peer logs and the formula does not return (TRL's entropy, per-sequence extremes)
        err = abs(float(metrics[name]) - value)
        if not err <= atol:
            raise ValuesDisagree(f"{what} metric {name}: {float(metrics[name])!r} vs the peer's {value!r}")


def _rl_check(case: _RLCase, b: RLBatch, variants: _Variants, exact: bool) -> dict[str, tuple[float, float]]:
    """Each variant against the peer: ``{variant: (loss, gradient) relative errors}``; the naive rows'
    metrics against the peer's too. ``exact`` (float64): loss and gradient within :data:`RL_EXACT_RTOL`;
    otherwise (float32, the timed data) the gradient within :data:`RL_RTOL` and the loss's relative
    difference only reported (a token-mean of signed terms: its float32 rounding is relative to
    ``Σ|terms|``, not to the small total)."""
    fns, packed, padded = variants
    expected, expected_metrics = fns[case.peer]()
    (peer_grad,) = torch.autograd.grad(expected, padded)
    rtol = RL_EXACT_RTOL if exact else RL_RTOL
    errors = {}
    for variant, fn in fns.items():
        if variant == case.peer:
            continue
        what = f"{case.name} {variant} ({b.logp.dtype})"
        loss, metrics = fn()
        (grad,) = torch.autograd.grad(loss, padded if _on_padded(variant) else packed)
        grad = grad[b.valid] if _on_padded(variant) else grad
        grad_err = check(f"{what} gradient", grad, peer_grad[b.valid], rtol)
        if exact:
            loss_err = check(f"{what} loss", loss, expected, rtol)
        else:
            loss_err = float((loss.detach() - expected.detach()).abs() / expected.detach().abs().clamp_min(1e-30))
        if variant.startswith("naive"):
            _check_metrics(what, metrics, expected_metrics, rtol if exact else METRIC_ATOL)
        errors[variant] = (loss_err, grad_err)
    return errors


def _rl_case_rows(case: _RLCase, case64: _RLCase, b: RLBatch, compiled: bool, warmup: int, repeat: int) -> list[dict]:
    """Checked in float64 (eager) and float32 (every variant), then timed round-robin in float32; every
    packloss row carries its ratio to each other row."""
    b64 = b.to(torch.float64)
    _rl_check(case64, b64, _rl_variants(case64, b64, compiled=False), exact=True)
    torch._dynamo.reset()  # each case compiles from an empty cache: no recompile limit shared across cases
    variants = _rl_variants(case, b, compiled)
    errors = _rl_check(case, b, variants, exact=False)  # compiles the compiled variants, outside the timing
    fns, packed, padded = variants
    returned = {v: len(fn()[1]) for v, fn in fns.items()}

    def timed(fn: Callable[[], _Loss], leaf: Tensor) -> Callable[[], None]:
        def step() -> None:
            leaf.grad = None
            fn()[0].backward()

        return step

    steps = {v: timed(fn, padded if _on_padded(v) else packed) for v, fn in fns.items()}
    times = _interleaved_ms(steps, "cpu", warmup, repeat)
    shape = f"N={packed.numel()} B×T={b.valid.shape[0]}×{b.valid.shape[1]}"
    rows = []
    for variant, t in times.items():
        row = {"comparison": case.name, "shape": shape, "variant": variant, "time_ms": t, "peak_bytes": None,
               "metrics": returned[variant]}  # fmt: skip
        if variant != case.peer:
            row["loss_rel_diff"], row["grad_rel_err"] = errors[variant]
        if not _on_padded(variant):
            row |= {f"vs_{other}": t / times[other] for other in times if _on_padded(other)}
        rows.append(row)
    return rows


def run_rl(shapes: list[tuple[int, int]], compiled: bool, warmup: int, repeat: int, progress, notes) -> list[dict]:
    """Every RL comparison whose peer imports, at each ``(tokens, sequences)`` shape (CPU; the peers'
    losses run where their inputs live)."""
    rows = []
    for num_tokens, num_seqs in shapes:
        b = rl_batch(num_tokens, num_seqs)
        shape_notes: list[str] = []
        for case, case64 in zip(_rl_cases(b, shape_notes), _rl_cases(b.to(torch.float64), []), strict=True):
            progress(f"peers {case.name} N={num_tokens} S={num_seqs}")
            rows.extend(_rl_case_rows(case, case64, b, compiled, warmup, repeat))
        notes.extend(n for n in shape_notes if n not in notes)
    return rows
