"""The ``peers`` suite: the same data through packloss and through the peers' own code, where installed
(TRL's and verl's loss math, cut-cross-entropy's, TRL's and Liger's fused kernels), every variant checked
to compute the same value and gradient before it is timed; ratios are packloss ÷ peer, measured in the
same run. What each row measures: ``docs/benchmarks.md``, "How the suites measure"."""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from packloss.core.bin import Plan
from packloss.core.step import count_denominators
from packloss.testing.trl import bare_grpo_trainer, padded_inputs, stub_forward, trl_config
from packloss.tools.bench._measure import peak_bytes, release_freed_memory, reset_peak, run_fresh, time_ms
from packloss.tools.bench.loss import _interleaved_ms, native_step
from packloss.vocab.core import HEAD_BLOCK, chunk_ranges, chunk_rows, mm_into
from packloss.vocab.head import DEFAULT_VOCAB_CHUNK_SIZE

__all__ = ["run", "ValuesDisagree", "check", "RL_RTOL", "RL_EXACT_RTOL", "HEAD_RTOL"]

RL_RTOL = 1e-6
RL_EXACT_RTOL = 1e-10
HEAD_RTOL = 1e-5
JSD_BETA = 0.5


class ValuesDisagree(RuntimeError):
    """A variant's value or gradient differs from the reference's: its timing would compare different work."""


def check(what: str, actual: Tensor, expected: Tensor, rtol: float) -> float:
    """``max|actual − expected| ≤ rtol · max|expected|`` or :class:`ValuesDisagree`; the relative error."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        raise ValuesDisagree(f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}")
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    err = float((actual - expected).abs().max()) if expected.numel() else 0.0
    if not scale > 0 or not err <= rtol * scale:  # a zero reference proves nothing; NaN fails too
        raise ValuesDisagree(f"{what}: max error {err:.3e} vs scale {scale:.3e} (rtol {rtol:g})")
    return err / scale


def _import(module: str, attr: str | None = None) -> tuple[Any, str | None]:
    """``(module or its attr, None)``, or ``(None, why not)``: a peer that cannot be imported is skipped."""
    try:
        mod = importlib.import_module(module)
        return (getattr(mod, attr) if attr else mod), None
    except Exception as exc:  # ImportError, or a peer's own import-time failure (e.g. a missing Triton)
        return None, f"{module} not importable ({type(exc).__name__}: {exc}): skipped"


# ---------------------------------------------------------------------------------------------------
# RL loss math
# ---------------------------------------------------------------------------------------------------


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
    grpo_trainer, why = _import("trl", "GRPOTrainer")
    if grpo_trainer is None:
        notes.append(f"rl/dapo·trl: {why}")
    else:
        from packloss.integrations.trl import from_trl

        cfg = _trl_config(b)
        trainer = bare_grpo_trainer(grpo_trainer, cfg)
        cases.append(_RLCase("rl/dapo·trl", "trl", lambda lp: _trl_loss(trainer, b, lp), from_trl(cfg)))
    get_policy_loss_fn, why = _import("verl.trainer.ppo.core_algos", "get_policy_loss_fn")
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


# ---------------------------------------------------------------------------------------------------
# Fused head and distillation from hidden states (each variant timed in a fresh process)
# ---------------------------------------------------------------------------------------------------

HEAD_VARIANTS = {
    "naive_eager": None,
    "packloss_fused": None,
    "cce_torch_compile": "cut_cross_entropy",
    "trl_chunked": "trl.kernels",
}
DISTILL_VARIANTS = {
    "naive_eager": None,
    "packloss_fused": None,
    "packloss_fused_compiled": None,
    "liger_compiled": "liger_kernel.chunked_loss",
}
_COMPILED_VARIANTS = {"packloss_fused_compiled"}  # left out when the suite runs without compiled columns


def _head_inputs(n: int, h: int, v: int, device: str, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(device).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.05).to(device).requires_grad_()
    return hidden, weight, torch.randint(0, v, (n,), generator=g).to(device)


def head_fn(variant: str) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``(hidden, weight, labels) -> log p(label) [N]`` of one head variant."""
    if variant == "naive_eager":
        return lambda hd, w, y: torch.log_softmax((hd @ w.T).float(), -1).gather(1, y[:, None]).squeeze(1)
    if variant == "packloss_fused":
        from packloss.vocab import linear_logprobs

        return lambda hd, w, y: linear_logprobs(hd, w, y, return_entropy=False)[0]
    if variant == "cce_torch_compile":
        from cut_cross_entropy import linear_cross_entropy

        return lambda hd, w, y: -linear_cross_entropy(hd, w, y, impl="torch_compile", reduction="none")
    if variant == "trl_chunked":  # TRL's fused LM head (its torch tiles off Triton), at TRL's own tile width
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        def trl_chunked(hd: Tensor, w: Tensor, y: Tensor) -> Tensor:
            return ChunkedLogProbFunction.apply(hd, w, None, y, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ())[0]

        return trl_chunked
    raise ValueError(f"head_fn: unknown variant {variant!r}")


def _distill_inputs(n: int, h: int, v: int, device: str, seed: int) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(device).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.05).to(device).requires_grad_()
    t_hidden = (torch.randn(n, h, generator=g) * 0.5).to(device)
    t_weight = (torch.randn(v, h, generator=g) * 0.05).to(device)
    labels = torch.randint(0, v, (n,), generator=g)
    labels = torch.where(torch.rand(n, generator=g) < 0.1, -100, labels).to(device)  # ~10% not members
    return hidden, weight, t_hidden, t_weight, labels


def _naive_jsd(hd: Tensor, w: Tensor, th: Tensor, tw: Tensor, y: Tensor) -> Tensor:
    """``Σ_members JSD_β / #members`` with ``M = β P + (1 − β) Q`` (P teacher, Q student), materialised."""
    log_q = torch.log_softmax((hd @ w.T).float(), -1)  # [N, V]
    log_p = torch.log_softmax((th @ tw.T).float(), -1)  # [N, V]
    log_m = torch.logaddexp(log_p + math.log(JSD_BETA), log_q + math.log(1 - JSD_BETA))
    per_token = JSD_BETA * (log_p.exp() * (log_p - log_m)).sum(-1) + (1 - JSD_BETA) * (
        log_q.exp() * (log_q - log_m)
    ).sum(-1)  # [N]
    members = y != -100
    return torch.where(members, per_token, 0.0).sum() / members.sum().clamp(min=1)


def distill_fn(variant: str) -> Callable[..., Tensor]:
    """``(hidden, weight, teacher_hidden, teacher_weight, labels) -> loss`` (0-d) of one distill variant."""
    if variant == "naive_eager":
        return _naive_jsd
    if variant in ("packloss_fused", "packloss_fused_compiled"):
        from packloss.vocab import linear_distill

        impl = "compiled" if variant == "packloss_fused_compiled" else None  # None: the CPU default, eager

        def fused(hd: Tensor, w: Tensor, th: Tensor, tw: Tensor, y: Tensor) -> Tensor:
            members = y != -100
            coef = members.float() / members.sum().clamp(min=1)
            return linear_distill(
                hd, w, teacher_hidden=th, teacher_weight=tw, kind="jsd", beta=JSD_BETA, loss_mask=members,
                coefficients=coef, impl=impl,
            )[0]  # fmt: skip

        return fused
    if variant == "liger_compiled":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        liger = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=JSD_BETA, compiled=True)
        return lambda hd, w, th, tw, y: liger(hd, w, th, tw, y)
    raise ValueError(f"distill_fn: unknown variant {variant!r}")


def _values(kind: str, variant: str, n: int, h: int, v: int, device: str, seed: int) -> dict[str, Tensor]:
    """One variant's output and gradients w.r.t. the student's hidden and weight."""
    if kind == "head":
        hd, w, y = _head_inputs(n, h, v, device, seed)
        out = head_fn(variant)(hd, w, y)
    else:
        hd, w, th, tw, y = _distill_inputs(n, h, v, device, seed)
        out = distill_fn(variant)(hd, w, th, tw, y)
    g_h, g_w = torch.autograd.grad(out.sum(), [hd, w])
    return {"value": out.detach(), "d hidden": g_h, "d weight": g_w}


def check_fused(kind: str, variants: list[str], n: int, h: int, v: int, device: str, seed: int = 0) -> dict[str, float]:
    """Every variant's values against ``naive_eager``'s (:class:`ValuesDisagree`); the max relative errors."""
    expected = _values(kind, "naive_eager", n, h, v, device, seed)
    errors = {}
    for variant in variants:
        if variant == "naive_eager":
            continue
        actual = _values(kind, variant, n, h, v, device, seed)
        errors[variant] = max(check(f"{kind} {variant} {k}", actual[k], expected[k], HEAD_RTOL) for k in expected)
    return errors


def _peak_and_time(step: Callable[[], None], device: str, repeat: int, warm: bool) -> dict:
    """Peak memory of one ``step()`` (after a warm-up call when ``warm``: compilation stays outside the
    measured peak) and the median time of ``repeat`` more."""
    if warm:
        step()
        release_freed_memory(device)
    base = reset_peak(device)
    step()
    peak = peak_bytes(device) - base
    return {"time_ms": time_ms(step, device, warmup=0, repeat=repeat), "peak_bytes": peak}


def measure_fused(kind: str, variant: str, n: int, h: int, v: int, device: str, repeat: int, threads: int) -> dict:
    """In a fresh process: peak memory of one forward+backward (after a warm-up that compiles) and the
    median time of ``repeat`` more; ``value``: the summed output."""
    torch.set_num_threads(threads)
    inputs = _head_inputs(n, h, v, device, 0) if kind == "head" else _distill_inputs(n, h, v, device, 0)
    fn = head_fn(variant) if kind == "head" else distill_fn(variant)
    hidden, weight = inputs[0], inputs[1]
    value: list[float] = []

    def step() -> None:
        out = fn(*inputs).sum()
        torch.autograd.grad(out, [hidden, weight])
        value[:] = [float(out.detach())]

    return _peak_and_time(step, device, repeat, warm=variant != "naive_eager") | {"value": value[0]}


def run_fused(kind: str, shape: tuple[int, int, int], check_shape: tuple[int, int, int], repeat: int, device: str,
              progress, notes: list[str], compiled: bool = True) -> list[dict]:  # fmt: skip
    """``head`` or ``distill``: the variants whose modules import (packloss's compiled ones only with
    ``compiled``), checked, then each in a fresh process; every packloss row gets its ratios to each peer."""
    table = HEAD_VARIANTS if kind == "head" else DISTILL_VARIANTS
    variants = []
    for variant, module in table.items():
        if variant in _COMPILED_VARIANTS and not compiled:
            continue
        why = None if module is None else _import(module)[1]
        if why is None:
            variants.append(variant)
        else:
            notes.append(f"{kind}/{variant}: {why}")
    progress(f"peers {kind} check")
    errors = check_fused(kind, variants, *check_shape, device)
    n, h, v = shape
    rows = []
    for variant in variants:
        progress(f"peers {kind} {variant}")
        kwargs = dict(kind=kind, variant=variant, n=n, h=h, v=v, device=device, repeat=repeat,
                      threads=torch.get_num_threads())  # fmt: skip
        out = run_fresh("packloss.tools.bench.peers:measure_fused", kwargs)
        rows.append({"comparison": kind, "shape": f"N={n},H={h},V={v}", "variant": variant, **out})
    naive = rows[0]  # naive_eager: always available
    for row in rows[1:]:
        row["time_vs_naive"] = row["time_ms"] / naive["time_ms"]
        row["peak_vs_naive"] = row["peak_bytes"] / max(naive["peak_bytes"], 1)
        row["max_rel_err"] = errors[row["variant"]]
    for ours in (r for r in rows if r["variant"].startswith("packloss_")):
        for peer in (r for r in rows if table[r["variant"]] is not None):
            ours[f"time_vs_{peer['variant']}"] = ours["time_ms"] / peer["time_ms"]
            ours[f"peak_vs_{peer['variant']}"] = ours["peak_bytes"] / max(peer["peak_bytes"], 1)
    return rows


# ---------------------------------------------------------------------------------------------------
# The head's matmuls alone: the time no head doing that many N × H × V matmuls can go below
# ---------------------------------------------------------------------------------------------------

HEAD_FLOORS = ("matmuls_packloss_4", "matmuls_materialised_3")


def _blocked_matmuls(hidden: Tensor, weight: Tensor) -> None:
    """linear_logprobs's four matmuls on its default blocks, nothing else: forward ``x = h Wᵀ`` per
    block; backward ``x`` again, ``d_hidden += x W_block``, ``d_weight[block] += xᵀ h`` (``x`` stands in
    for the block's gradient, which has its shape)."""
    n, v = hidden.shape[0], weight.shape[0]
    cols = min(DEFAULT_VOCAB_CHUNK_SIZE["cpu" if hidden.device.type == "cpu" else "accelerator"], v)
    rows = chunk_rows(cols, hidden.device, budget=HEAD_BLOCK)
    buf = torch.empty(min(rows, n) * cols, dtype=hidden.dtype, device=hidden.device)
    d_h, d_w = torch.empty_like(hidden), torch.empty_like(weight)
    for backward in (False, True):
        for t0, t1 in chunk_ranges(n, rows):
            for v0, v1 in chunk_ranges(v, cols):
                x = torch.mm(hidden[t0:t1], weight[v0:v1].T, out=buf[: (t1 - t0) * (v1 - v0)].view(t1 - t0, v1 - v0))
                if backward:
                    mm_into(d_h[t0:t1], x, weight[v0:v1], first=v0 == 0)
                    mm_into(d_w[v0:v1], x.T, hidden[t0:t1], first=t0 == 0)


def _materialised_matmuls(hidden: Tensor, weight: Tensor) -> None:
    """The three full-size matmuls of a head that keeps its ``[N, V]`` logits: ``x = h Wᵀ``, ``x W``,
    ``xᵀ h`` (``x`` standing in for the logits' gradient)."""
    x = torch.mm(hidden, weight.T)  # [N, V]
    torch.mm(x, weight)  # d_hidden [N, H]
    torch.mm(x.T, hidden)  # d_weight [V, H]


def head_matmuls(variant: str) -> Callable[[Tensor, Tensor], None]:
    """``(hidden, weight) -> None``, no gradient tracked: ``matmuls_packloss_4`` (:func:`_blocked_matmuls`)
    or ``matmuls_materialised_3`` (:func:`_materialised_matmuls`: cut-cross-entropy's ``torch_compile``
    path and the naive head do these three)."""
    fns = {"matmuls_packloss_4": _blocked_matmuls, "matmuls_materialised_3": _materialised_matmuls}
    if variant not in fns:
        raise ValueError(f"head_matmuls: unknown variant {variant!r}; choose from {HEAD_FLOORS}")
    return fns[variant]


def measure_floor(variant: str, n: int, h: int, v: int, device: str, repeat: int, threads: int) -> dict:
    """In a fresh process: :func:`head_matmuls` ``variant``'s peak memory and median time."""
    torch.set_num_threads(threads)
    hidden, weight, _ = _head_inputs(n, h, v, device, 0)
    fn = head_matmuls(variant)

    def step() -> None:
        with torch.no_grad():
            fn(hidden, weight)

    return _peak_and_time(step, device, repeat, warm=True)


def run_head_floors(
    shape: tuple[int, int, int], repeat: int, device: str, progress, head_rows: list[dict]
) -> list[dict]:
    """The ``head floor`` rows at the head's timed shape, each divided by every ``head`` row's time."""
    n, h, v = shape
    rows = []
    for variant in HEAD_FLOORS:
        progress(f"peers head floor {variant}")
        kwargs = dict(variant=variant, n=n, h=h, v=v, device=device, repeat=repeat, threads=torch.get_num_threads())
        out = run_fresh("packloss.tools.bench.peers:measure_floor", kwargs)
        row = {"comparison": "head floor", "shape": f"N={n},H={h},V={v}", "variant": variant, **out}
        row |= {f"time_vs_{r['variant']}": out["time_ms"] / r["time_ms"] for r in head_rows}
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """RL tokens / sequences / compiled columns and variants / warm-up / repeats; head and distill
    ``(N, H, V)`` timed and checked, and their repeats."""

    rl_tokens: int
    rl_seqs: int
    compiled: bool
    rl_warmup: int
    rl_repeat: int
    fused: tuple[int, int, int]
    fused_check: tuple[int, int, int]
    fused_repeat: int


def sizes(quick: bool) -> Sizes:
    """Default: 32,768 packed tokens in 32 sequences (≈ 62k padded elements), heads ``2048 × 512 × 32768``.
    Quick: 2,048 tokens in 8 sequences, eager only; heads ``256 × 64 × 2048``."""
    if quick:
        return Sizes(2048, 8, False, 2, 10, (256, 64, 2048), (256, 64, 2048), 3)
    return Sizes(32768, 32, True, 3, 50, (2048, 512, 32768), (512, 128, 8192), 3)


def run(device: str, quick: bool, progress: Callable[[str], None] | None = None, *, size: Sizes | None = None) -> dict:
    """Run the suite on CPU: ``{"rows": [...], "notes": [...], "sizes": {...}}`` (see the module doc).
    ``--device cuda`` is refused: cut-cross-entropy's and Liger's GPU paths are Triton kernels, another
    comparison than the CPU one this suite makes."""
    if device != "cpu":
        raise ValueError(f"packloss bench peers runs on CPU only, got --device {device}")
    s = size or sizes(quick)
    report = progress or (lambda _description: None)
    notes: list[str] = []
    rows = run_rl(s.rl_tokens, s.rl_seqs, s.compiled, s.rl_warmup, s.rl_repeat, report, notes)
    for kind in ("head", "distill"):
        fused = run_fused(kind, s.fused, s.fused_check, s.fused_repeat, device, report, notes, s.compiled)
        rows.extend(fused)
        if kind == "head":
            rows.extend(run_head_floors(s.fused, s.fused_repeat, device, report, fused))
    return {
        "rows": rows,
        "notes": notes,
        "sizes": vars(s) | {"rl_rtol": RL_RTOL, "fused_rtol": HEAD_RTOL, "jsd_beta": JSD_BETA},
        "threads": torch.get_num_threads(),
        "versions": _versions(),
    }


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"torch": torch.__version__}
    for name in ("trl", "verl", "cut_cross_entropy", "liger_kernel"):
        from importlib import metadata

        try:
            out[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
