"""``packloss check``: is a custom rl loss function additive over the sequences of a packed bin?

Before prime-rl PR #2951 a custom loss was called once per packed sequence; packloss (and prime-rl
after the PR) calls it once over the whole bin. A loss that is additive over sequences gives the
same total either way; one that normalises by "whatever it was called on" (a per-sequence mean,
a sequence-level ratio) silently changes meaning. This module calls the function both ways —
:func:`packloss.testing.reference.compute_loss` (per sequence) and
:func:`packloss.compat.prime_rl.compute_loss` (vectorised) — over several random packed bins
(:func:`packloss.testing.make_archetype`) and compares the losses and the gradients with respect to
the trainer log-probs.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from packloss.compat import prime_rl
from packloss.testing import Streams, make_archetype, random_seq_lens, reference

__all__ = [
    "CheckError",
    "Comparison",
    "load_function",
    "parse_kwargs",
    "compare_on_bin",
    "check_function",
    "report",
    "run",
]

RTOL = 1e-5
"""Relative tolerance on the loss and on the gradient (relative to the largest gradient entry)."""
ATOL = 1e-7
"""Absolute floor of the loss tolerance, for losses that sum to about zero."""
BINS = (("hot", 257, 9, 0), ("hot", 600, 23, 1), ("weighted_grpo", 257, 9, 2), ("weighted_grpo", 411, 31, 3))
"""(archetype, tokens, sequences, seed) of the packed bins the check runs on."""

ADVICE = """\
The function is not additive over sequences: called once per sequence (as before prime-rl PR #2951)
and once over the whole packed bin (packloss, prime-rl after the PR) it gives different results.
A per-sequence quantity (a mean over a sequence's tokens, a sequence-level ratio, a per-sequence
normaliser) must use the packing layout that LossInputs carries:
  inputs.seq_ids     [N] long, the sequence index of every token
  inputs.cu_seqlens  [S+1] int32, the sequence offsets
  inputs.num_seqs    S, a host int
with the sync-free segment reductions of packloss.core.segments (segment_sum, segment_count,
segment_mean, segment_max, segment_min, broadcast), never a Python loop or x[mask]. For example a
per-sequence token mean:
  count = broadcast(segment_count(m, inputs.seq_ids, inputs.num_seqs), inputs.seq_ids)
  loss = (per_token / count.clamp_min(1)).sum()"""


class CheckError(Exception):
    """The target cannot be checked at all (bad import path, not callable, bad kwargs)."""


@dataclass(frozen=True)
class Comparison:
    """One bin's per-sequence vs. vectorised results; the error of each call that raised."""

    bin: str
    loss_per_sequence: float | None
    loss_vectorised: float | None
    loss_abs_diff: float | None
    grad_max_abs_diff: float | None
    grad_rel_diff: float | None
    per_sequence_error: str | None = None
    vectorised_error: str | None = None

    @property
    def error(self) -> str | None:
        """Which calls raised and what, or None when both returned."""
        calls = (("per-sequence", self.per_sequence_error), ("vectorised", self.vectorised_error))
        raised = [f"{name} call raised {err}" for name, err in calls if err is not None]
        return "; ".join(raised) or None

    @property
    def uncheckable(self) -> bool:
        """Both calling conventions raised: nothing to compare on this bin."""
        return self.per_sequence_error is not None and self.vectorised_error is not None

    @property
    def passed(self) -> bool:
        if self.error is not None:
            return False
        loss_ok = self.loss_abs_diff <= RTOL * abs(self.loss_per_sequence) + ATOL
        return loss_ok and self.grad_rel_diff <= RTOL


def _one_line(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def load_function(target: str) -> Callable:
    """``"module:function"`` (or ``"module.function"``) → the function; the current directory is on
    ``sys.path`` so a local ``my_losses.py`` imports."""
    module_name, sep, attr = target.partition(":")
    if not sep:
        module_name, _, attr = target.rpartition(".")
    if not module_name or not attr:
        raise CheckError(f"expected MODULE:FUNCTION, got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # any failure while importing the user's module is reported, not raised
        raise CheckError(f"cannot import module {module_name!r}: {_one_line(exc)}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise CheckError(f"module {module_name!r} has no callable {attr!r}")
    return fn


def parse_kwargs(text: str | None) -> dict:
    """The ``--kwargs`` JSON object (``{}`` when absent)."""
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckError(f"--kwargs is not valid JSON: {exc}") from exc
    if not isinstance(kwargs, dict):
        raise CheckError(f"--kwargs must be a JSON object, got {type(kwargs).__name__}")
    return kwargs


def _bin(archetype: str, num_tokens: int, num_seqs: int, seed: int) -> Streams:
    g = torch.Generator().manual_seed(seed)
    return make_archetype(archetype, random_seq_lens(num_tokens, num_seqs, g), seed=seed)


def _loss_and_grad(compute: Callable, streams: Streams, rl_loss_fn: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """``compute``'s loss over the bin's per-sequence lists and its gradient w.r.t. the trainer
    log-probs ``[N]`` (both float64); the scales are the components' member counts."""
    loss, _ = compute(**streams.lists(), rl_loss_fn=rl_loss_fn, **streams.integer_scales())
    trn = streams.trainer_logprobs
    (grad,) = torch.autograd.grad(loss, trn, allow_unused=True)
    grad = torch.zeros_like(trn) if grad is None else grad
    return loss.detach().double(), grad.detach().double()


def _attempt(compute: Callable, streams: Streams, rl_loss_fn: Callable) -> tuple[tuple | None, str | None]:
    """:func:`_loss_and_grad`, or the error it raised; a ``sys.exit`` from the function is a
    :class:`CheckError` (it cannot be checked), never the exit code of ``packloss check``."""
    try:
        return _loss_and_grad(compute, streams, rl_loss_fn), None
    except SystemExit as exc:
        raise CheckError(f"the function called sys.exit({exc.code!r}) instead of returning") from None
    except Exception as exc:  # a custom loss may fail in one calling convention only: report it
        return None, _one_line(exc)


def compare_on_bin(fn: Callable, kwargs: dict, streams: Streams, label: str) -> Comparison:
    """Call ``fn`` per sequence and over the bin; the loss difference and the gradient difference
    (max abs, and max abs relative to the largest per-sequence gradient entry), or the errors."""
    rl_loss_fn = lambda inputs: fn(inputs, **kwargs)
    ref, ref_error = _attempt(reference.compute_loss, streams, rl_loss_fn)
    vec, vec_error = _attempt(prime_rl.compute_loss, streams, rl_loss_fn)
    if ref is None or vec is None:
        return Comparison(label, None, None, None, None, None, ref_error, vec_error)
    (loss_ref, grad_ref), (loss_vec, grad_vec) = ref, vec
    grad_diff = float((grad_vec - grad_ref).abs().max())
    grad_scale = max(float(grad_ref.abs().max()), 1e-30)
    return Comparison(
        bin=label,
        loss_per_sequence=float(loss_ref),
        loss_vectorised=float(loss_vec),
        loss_abs_diff=float((loss_vec - loss_ref).abs()),
        grad_max_abs_diff=grad_diff,
        grad_rel_diff=grad_diff / grad_scale,
    )


def check_function(fn: Callable, kwargs: dict) -> list[Comparison]:
    """:func:`compare_on_bin` over the :data:`BINS`."""
    return [
        compare_on_bin(fn, kwargs, _bin(archetype, n, s, seed), f"{archetype} N={n} S={s} seed={seed}")
        for archetype, n, s, seed in BINS
    ]


def _describe(c: Comparison) -> str:
    if c.error is not None:
        return f"  FAIL  {c.bin}: {c.error}"
    rel = c.loss_abs_diff / max(abs(c.loss_per_sequence), 1e-30)
    return (
        f"  {'ok  ' if c.passed else 'FAIL'}  {c.bin}: loss per-sequence {c.loss_per_sequence:.6g} vs "
        f"vectorised {c.loss_vectorised:.6g} (abs diff {c.loss_abs_diff:.3g}, rel {rel:.3g}); "
        f"grad max abs diff {c.grad_max_abs_diff:.3g} (rel {c.grad_rel_diff:.3g})"
    )


def report(target: str, comparisons: list[Comparison]) -> str:
    """The verdict and one line per bin, plus the layout advice on a failure."""
    passed = all(c.passed for c in comparisons)
    lines = [f"packloss check {target}: {'PASS' if passed else 'FAIL'}"]
    lines += [_describe(c) for c in comparisons]
    if passed:
        lines.append(f"Additive over sequences: per-sequence and per-bin calls agree (rel {RTOL:g}).")
    else:
        lines.append(ADVICE)
    return "\n".join(lines)


def _require_checkable(comparisons: list[Comparison]) -> None:
    """A :class:`CheckError` when both calling conventions raised on every bin (a wrong signature,
    bad ``--kwargs``): nothing was compared, so there is no verdict."""
    if all(c.uncheckable for c in comparisons):
        raise CheckError(
            f"the function raised on every bin, per sequence and per bin: {comparisons[0].vectorised_error}"
        )


def run(target: str, kwargs_json: str | None = None) -> int:
    """Check ``target`` and print the report; exit code 0 (PASS), 1 (FAIL) or 2 (cannot check)."""
    try:
        fn = load_function(target)
        kwargs = parse_kwargs(kwargs_json)
        comparisons = check_function(fn, kwargs)
        _require_checkable(comparisons)
    except CheckError as exc:
        print(f"packloss check: error: cannot check {target}: {exc}", file=sys.stderr)
        return 2
    print(report(target, comparisons))
    return 0 if all(c.passed for c in comparisons) else 1
