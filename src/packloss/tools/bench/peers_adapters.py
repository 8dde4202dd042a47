"""The adapter rows of ``packloss bench peers``: each trainer adapter's whole call, the peer's padded
``[B, T]`` streams in and the peer's return value and metrics out, beside the peer's own call on the same
micro-batch: ``PacklossGRPOTrainer._compute_loss`` against TRL's ``GRPOTrainer._compute_loss`` (both with
a stubbed forward), the verl plugin's ``packloss_vanilla`` against verl's ``compute_policy_loss_vanilla``,
packloss's OpenRLHF ``PolicyLoss`` (its default ``packing="members"`` and ``"rows"``) against OpenRLHF's
own (loaded by file path). Eager, and ``torch.compile``'d where the peer's call is a function or module
(verl, OpenRLHF; TRL's loss sits inside a trainer method that logs host floats). Every variant's loss,
gradient and the peer's metrics are checked against the peer's, in float64 then float32, before timing.
``docs/benchmarks.md``, "How the suites measure"."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from packloss.testing.openrlhf import load_openrlhf_loss
from packloss.testing.trl import bare_grpo_trainer, padded_inputs, stub_forward
from packloss.tools.bench._measure import ValuesDisagree, check, import_peer
from packloss.tools.bench.loss import _interleaved_ms
from packloss.tools.bench.peers_rl import (
    METRIC_ATOL,
    RL_EXACT_RTOL,
    RL_RTOL,
    RLBatch,
    _trl_config,
    _verl_config,
    rl_batch,
)

__all__ = ["COMPARISONS", "METRIC_RTOL_F64", "run_adapters"]

COMPARISONS = ("adapter/trl_trainer", "adapter/verl_plugin", "adapter/openrlhf_policy_loss")
_CLIP_LOW, _CLIP_HIGH = 0.2, 0.28  # every case's PPO clip (DAPO's clip-higher)
METRIC_RTOL_F64 = 1e-6  # the peers take their fractions in float32 even on float64 data (TRL's .float())

_Loss = tuple[Tensor, dict[str, Any]]  # (loss, the metrics the peer returns or logs)
_Call = Callable[[Tensor], _Loss]  # padded log-probs [B, T] → (loss, metrics)


@dataclass(frozen=True)
class _Case:
    """One comparison: the peer's call and packloss's adapter calls (``{variant suffix: call}``, e.g.
    ``""`` and ``"rows"``) on padded log-probs, and whether the calls are compiled too."""

    name: str
    peer: str
    peer_call: _Call
    ours: dict[str, _Call]
    compiles: bool


def _trl_call(trainer: Any, b: RLBatch, logp: Tensor) -> _Loss:
    """``trainer._compute_loss`` on the padded batch, its forward a stub returning ``logp``; the metrics
    it logged (TRL appends them on every call)."""
    stub_forward(trainer, logp, torch.zeros_like(logp))
    logged = trainer._metrics["train"]
    logged.clear()
    tool_mask = torch.where(b.valid, b.mask, True).long()  # TRL pads the tool mask with 1
    inputs = padded_inputs(b.valid.long(), tool_mask, b.adv, b.mask.sum(), old_per_token_logps=b.old)
    loss = trainer._compute_loss(None, inputs)
    return loss, {name: values[-1] for name, values in logged.items()}


def _trl_case(b: RLBatch, notes: list[str]) -> _Case | None:
    grpo_trainer, why = import_peer("trl", "GRPOTrainer")
    if grpo_trainer is None:
        notes.append(f"{COMPARISONS[0]}: {why}")
        return None
    from packloss.integrations.trl import PacklossGRPOTrainer

    cfg = _trl_config(b)
    ours = object.__new__(PacklossGRPOTrainer)  # the bare trainer the adapter's tests build
    ours.__dict__.update(bare_grpo_trainer(grpo_trainer, cfg).__dict__)
    ours._init_packloss("trl")
    peer = functools.partial(_trl_call, bare_grpo_trainer(grpo_trainer, cfg), b)
    return _Case(COMPARISONS[0], "trl", peer, {"": functools.partial(_trl_call, ours, b)}, compiles=False)


def _verl_call(loss_fn: Callable, cfg: Any, b: RLBatch, adv: Tensor, logp: Tensor) -> _Loss:
    return loss_fn(
        old_log_prob=b.old, log_prob=logp, advantages=adv, response_mask=b.mask, loss_agg_mode="token-mean",
        config=cfg, rollout_is_weights=None,
    )  # fmt: skip


def _verl_case(b: RLBatch, notes: list[str]) -> _Case | None:
    get_policy_loss_fn, why = import_peer("verl.trainer.ppo.core_algos", "get_policy_loss_fn")
    if get_policy_loss_fn is None:
        notes.append(f"{COMPARISONS[1]}: {why}")
        return None
    from packloss.integrations.verl.plugin import policy_loss

    cfg = _verl_config("vanilla")
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(b.mask.sum()), global_batch_size=len(b.seq_lens))
    adv = b.adv[:, None].expand_as(b.valid).contiguous()  # [B, T], as verl's batch holds them
    peer = functools.partial(_verl_call, get_policy_loss_fn("vanilla"), cfg, b, adv)
    ours = functools.partial(_verl_call, policy_loss("vanilla"), cfg, b, adv)
    return _Case(COMPARISONS[1], "verl", peer, {"": ours}, compiles=True)


def _openrlhf_call(module: torch.nn.Module, b: RLBatch, adv: Tensor, action_mask: Tensor, logp: Tensor) -> _Loss:
    loss, clip_ratio, ppo_kl, _, _ = module(logp, b.old, adv, action_mask)
    return loss, {"clip_ratio": clip_ratio, "ppo_kl": ppo_kl}


def _openrlhf_case(b: RLBatch, notes: list[str]) -> _Case | None:
    orl = load_openrlhf_loss()
    if orl is None:
        notes.append(f"{COMPARISONS[2]}: openrlhf not installed (pip install --no-deps openrlhf): skipped")
        return None
    from packloss.integrations.openrlhf import PolicyLoss

    adv = b.adv[:, None].expand_as(b.valid).contiguous()  # [B, T], as OpenRLHF's experiences hold them
    action_mask = b.mask.long()  # as OpenRLHF's samples generator builds it

    def call(module: torch.nn.Module) -> _Call:
        return functools.partial(_openrlhf_call, module, b, adv, action_mask)

    ours = {
        "": call(PolicyLoss(_CLIP_LOW, _CLIP_HIGH)),
        "rows": call(PolicyLoss(_CLIP_LOW, _CLIP_HIGH, packing="rows")),
    }
    peer = call(orl.PolicyLoss(_CLIP_LOW, _CLIP_HIGH))
    return _Case(COMPARISONS[2], "openrlhf", peer, ours, compiles=True)


def _cases(b: RLBatch, notes: list[str]) -> list[_Case]:
    cases = (make(b, notes) for make in (_trl_case, _verl_case, _openrlhf_case))
    return [case for case in cases if case is not None]


def _variants(case: _Case, compiled: bool) -> dict[str, _Call]:
    """``{variant: call}``: ``packloss[_rows]_eager``, the peer's, and with ``compiled`` (for a case
    whose calls compile) ``packloss[_rows]_compiled`` and ``{peer}_compiled``, compiled for this batch's
    shapes."""
    fns: dict[str, _Call] = {}
    for suffix, call in case.ours.items():
        fns["_".join(p for p in ("packloss", suffix, "eager") if p)] = call
    fns[case.peer] = case.peer_call
    if compiled and case.compiles:
        for suffix, call in case.ours.items():
            fns["_".join(p for p in ("packloss", suffix, "compiled") if p)] = torch.compile(call, dynamic=False)
        fns[f"{case.peer}_compiled"] = torch.compile(case.peer_call, dynamic=False)
    return fns


def _check_metrics(what: str, metrics: dict[str, Any], expected: dict[str, Any], atol: float, rtol: float) -> None:
    """Every metric the peer returns or logs, present in ``metrics`` and within ``atol + rtol·|peer|``
    (NaN = NaN)."""
    for name, value in expected.items():
        if name not in metrics:
            raise ValuesDisagree(f"{what}: metric {name!r} the peer returns is missing")
        got, want = float(metrics[name]), float(value)
        if not (abs(got - want) <= atol + rtol * abs(want) or (got != got and want != want)):
            raise ValuesDisagree(f"{what} metric {name}: {got!r} vs the peer's {want!r}")


def _check(case: _Case, fns: dict[str, _Call], logp: Tensor, exact: bool) -> dict[str, tuple[float, float]]:
    """Each variant against the peer's call: ``{variant: (loss, gradient) relative errors}``. ``exact``
    (float64): loss and gradient within :data:`RL_EXACT_RTOL`, the metrics within
    :data:`METRIC_RTOL_F64` (of the peer's float32 fractions) and :data:`RL_EXACT_RTOL`; otherwise (float32, the timed
    data) the gradient within :data:`RL_RTOL`, the metrics within :data:`METRIC_ATOL`, the loss's
    relative difference reported (a token mean of signed terms: its rounding is relative to ``Σ|ℓ|``)."""
    leaf = logp.clone().requires_grad_()
    expected, expected_metrics = fns[case.peer](leaf)
    (peer_grad,) = torch.autograd.grad(expected, leaf)
    rtol = RL_EXACT_RTOL if exact else RL_RTOL
    errors = {}
    for variant, fn in fns.items():
        if variant == case.peer:
            continue
        what = f"{case.name} {variant} ({logp.dtype})"
        loss, metrics = fn(leaf)
        (grad,) = torch.autograd.grad(loss, leaf)
        grad_err = check(f"{what} gradient", grad, peer_grad, rtol)
        if exact:
            loss_err = check(f"{what} loss", loss, expected, rtol)
        else:
            loss_err = float((loss.detach() - expected.detach()).abs() / expected.detach().abs().clamp_min(1e-30))
        if exact:
            _check_metrics(what, metrics, expected_metrics, RL_EXACT_RTOL, METRIC_RTOL_F64)
        else:
            _check_metrics(what, metrics, expected_metrics, METRIC_ATOL, 0.0)
        errors[variant] = (loss_err, grad_err)
    return errors


def _case_rows(case: _Case, b: RLBatch, compiled: bool, warmup: int, repeat: int) -> list[dict]:
    """The case's rows: checked (float32, every variant, compiling the compiled ones outside the timing),
    then timed round-robin; every packloss row carries its ratio to each peer row."""
    fns = _variants(case, compiled)
    errors = _check(case, fns, b.logp, exact=False)
    leaf = b.logp.clone().requires_grad_()
    returned = {v: len(fn(leaf)[1]) for v, fn in fns.items()}

    def timed(fn: _Call) -> Callable[[], None]:
        def step() -> None:
            leaf.grad = None
            fn(leaf)[0].backward()

        return step

    times = _interleaved_ms({v: timed(fn) for v, fn in fns.items()}, "cpu", warmup, repeat)
    shape = f"N={int(b.valid.sum())} B×T={b.valid.shape[0]}×{b.valid.shape[1]}"
    rows = []
    for variant, t in times.items():
        row = {"comparison": case.name, "shape": shape, "variant": variant, "time_ms": t, "peak_bytes": None,
               "metrics": returned[variant]}  # fmt: skip
        if variant.startswith("packloss"):
            row["loss_rel_diff"], row["grad_rel_err"] = errors[variant]
            row |= {f"vs_{other}": t / times[other] for other in times if not other.startswith("packloss")}
        rows.append(row)
    return rows


def run_adapters(
    shapes: list[tuple[int, int]], compiled: bool, warmup: int, repeat: int, progress, notes: list[str]
) -> list[dict]:
    """Every adapter comparison whose peer imports, at each ``(tokens, rows)`` shape (:func:`rl_batch`'s
    micro-batch: ragged rows with about 5% holes in their loss mask), on CPU."""
    rows = []
    for num_tokens, num_seqs in shapes:
        b = rl_batch(num_tokens, num_seqs)
        b64 = b.to(torch.float64)
        shape_notes: list[str] = []
        for case, case64 in zip(_cases(b, shape_notes), _cases(b64, []), strict=True):
            progress(f"peers {case.name} N={num_tokens} B={num_seqs}")
            _check(case64, _variants(case64, compiled=False), b64.logp, exact=True)
            torch._dynamo.reset()  # each case compiles from an empty cache
            rows.extend(_case_rows(case, b, compiled, warmup, repeat))
        notes.extend(n for n in shape_notes if n not in notes)
    return rows
