"""The RL rows of ``packloss bench peers``: the policy-gradient loss math of TRL and verl beside
packloss's engine on the same micro-batch, padded and packed, checked equal before timing.
``docs/benchmarks.md``, "How the suites measure"."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from packloss.core.bin import Plan
from packloss.core.step import count_denominators
from packloss.testing.trl import bare_grpo_trainer, padded_inputs, stub_forward, trl_config
from packloss.tools.bench._measure import check, import_peer
from packloss.tools.bench.loss import _interleaved_ms, native_step

__all__ = ["RL_RTOL", "RL_EXACT_RTOL", "RLBatch", "rl_batch", "run_rl"]

RL_RTOL = 1e-6
RL_EXACT_RTOL = 1e-10


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


def _trl_loss(trainer: Any, b: RLBatch, logp: Tensor) -> Tensor:
    """TRL's ``_compute_loss`` on the padded batch, its forward a stub returning ``logp``."""
    stub_forward(trainer, logp, torch.zeros_like(b.logp))
    trainer._metrics["train"].clear()  # TRL appends its metrics on every call
    tool_mask = torch.where(b.valid, b.mask, True).long()  # TRL pads the tool mask with 1
    inputs = padded_inputs(b.valid.long(), tool_mask, b.adv, b.mask.sum(), old_per_token_logps=b.old)
    return trainer._compute_loss(None, inputs)


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


def _verl_loss(loss_fn: Callable, cfg: Any, b: RLBatch, logp: Tensor) -> Tensor:
    """verl's policy loss on the padded batch, as ``ppo_loss`` calls it on one rank and micro-batch."""
    adv = b.adv[:, None].expand_as(b.valid).contiguous()
    loss, _ = loss_fn(
        old_log_prob=b.old, log_prob=logp, advantages=adv, response_mask=b.mask, loss_agg_mode="token-mean",
        config=cfg, rollout_is_weights=None,
    )  # fmt: skip
    return loss


@dataclass(frozen=True)
class _RLCase:
    """One comparison: the peer's loss of padded log-probs and the packloss recipe of the peer's config."""

    name: str
    peer: str
    peer_loss: Callable[[Tensor], Tensor]
    recipe: Any


def _rl_cases(b: RLBatch, notes: list[str]) -> list[_RLCase]:
    cases = []
    grpo_trainer, why = import_peer("trl", "GRPOTrainer")
    if grpo_trainer is None:
        notes.append(f"rl/dapo·trl: {why}")
    else:
        from packloss.integrations.trl import from_trl

        cfg = _trl_config(b)
        trainer = bare_grpo_trainer(grpo_trainer, cfg)
        cases.append(_RLCase("rl/dapo·trl", "trl", lambda lp: _trl_loss(trainer, b, lp), from_trl(cfg)))
    get_policy_loss_fn, why = import_peer("verl.trainer.ppo.core_algos", "get_policy_loss_fn")
    if get_policy_loss_fn is None:
        notes.append(f"rl/ppo_clip·verl, rl/dppo_tv·verl: {why}")
        return cases
    from packloss.integrations.verl import from_verl

    for mode, label in (("vanilla", "ppo_clip"), ("dppo_tv", "dppo_tv")):
        cfg = _verl_config(mode)
        cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(b.mask.sum()), global_batch_size=len(b.seq_lens))
        fn = get_policy_loss_fn(mode)
        peer_loss = (lambda f, c: lambda lp: _verl_loss(f, c, b, lp))(fn, cfg)
        cases.append(_RLCase(f"rl/{label}·verl", "verl", peer_loss, from_verl(cfg, response_length=b.valid.shape[1])))
    return cases


def _rl_variants(case: _RLCase, b: RLBatch, compiled: bool) -> tuple[dict[str, Callable[[], Tensor]], Tensor, Tensor]:
    """``({variant: loss()}, packed leaf [N], padded leaf [B, T])``; plan and denominators built here, once."""
    plan = _packloss_plan(case.recipe, b)
    den = count_denominators([plan])
    packed = b.packed(b.logp).clone().requires_grad_()  # [N]
    padded = b.logp.clone().requires_grad_()  # [B, T]
    fns: dict[str, Callable[[], Tensor]] = {"packloss_eager": lambda: native_step(plan, packed, den)}
    if compiled:
        step_fn = torch.compile(native_step)
        fns["packloss_compiled"] = lambda: step_fn(plan, packed, den)
        peer_fn = torch.compile(case.peer_loss)  # the peer's own loss math under torch.compile too
        fns[f"{case.peer}_compiled"] = lambda: peer_fn(padded)
    fns[case.peer] = lambda: case.peer_loss(padded)
    return fns, packed, padded


def _rl_check(case: _RLCase, b: RLBatch, compiled: bool, exact: bool) -> dict[str, tuple[float, float]]:
    """Each packloss variant against the peer: ``{variant: (loss, gradient) relative errors}``. ``exact``
    (float64): loss and gradient within :data:`RL_EXACT_RTOL`; otherwise (float32, the timed data) the
    gradient within :data:`RL_RTOL` and the loss's relative difference only reported (a token-mean of
    signed terms: its float32 rounding is relative to ``Σ|terms|``, not to the small total)."""
    fns, packed, padded = _rl_variants(case, b, compiled)
    (peer_grad,) = torch.autograd.grad(expected := fns.pop(case.peer)(), padded)
    rtol = RL_EXACT_RTOL if exact else RL_RTOL
    errors = {}
    for variant, fn in fns.items():
        what = f"{case.name} {variant} ({b.logp.dtype})"
        padded_leaf = variant.startswith(case.peer)  # the peer's compiled loss, on the padded layout
        (grad,) = torch.autograd.grad(loss := fn(), padded if padded_leaf else packed)
        grad = grad[b.valid] if padded_leaf else grad
        grad_err = check(f"{what} gradient", grad, peer_grad[b.valid], rtol)
        if exact:
            loss_err = check(f"{what} loss", loss, expected, rtol)
        else:
            loss_err = float((loss.detach() - expected.detach()).abs() / expected.detach().abs().clamp_min(1e-30))
        errors[variant] = (loss_err, grad_err)
    return errors


def _rl_case_rows(case: _RLCase, case64: _RLCase, b: RLBatch, compiled: bool, warmup: int, repeat: int) -> list[dict]:
    """Checked in float64 (eager) and float32 (every variant), then timed round-robin in float32."""
    _rl_check(case64, b.to(torch.float64), compiled=False, exact=True)
    errors = _rl_check(case, b, compiled, exact=False)
    fns, packed, padded = _rl_variants(case, b, compiled)

    def timed(fn: Callable[[], Tensor], leaf: Tensor) -> Callable[[], None]:
        def step() -> None:
            leaf.grad = None
            fn().backward()

        return step

    steps = {v: timed(fn, padded if v.startswith(case.peer) else packed) for v, fn in fns.items()}
    times = _interleaved_ms(steps, "cpu", warmup, repeat)
    shape = f"N={packed.numel()} B×T={b.valid.shape[0]}×{b.valid.shape[1]}"
    rows = []
    for variant, t in times.items():
        row = {"comparison": case.name, "shape": shape, "variant": variant, "time_ms": t, "peak_bytes": None}
        if variant != case.peer:
            row[f"vs_{case.peer}"] = t / times[case.peer]
            row["loss_rel_diff"], row["grad_rel_err"] = errors[variant]
        if variant == "packloss_compiled":
            row["vs_peer_compiled"] = t / times[f"{case.peer}_compiled"]
        rows.append(row)
    return rows


def run_rl(num_tokens: int, num_seqs: int, compiled: bool, warmup: int, repeat: int, progress, notes) -> list[dict]:
    """Every RL comparison whose peer imports (CPU; the peers' losses run where their inputs live)."""
    b = rl_batch(num_tokens, num_seqs)
    rows = []
    for case, case64 in zip(_rl_cases(b, notes), _rl_cases(b.to(torch.float64), []), strict=True):
        progress(f"peers {case.name}")
        rows.extend(_rl_case_rows(case, case64, b, compiled, warmup, repeat))
    return rows
