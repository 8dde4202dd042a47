"""The ``loss`` suite: forward+backward of :func:`packloss.compute_loss` on one packed bin of each
archetype at 1 to 256 sequences, beside the per-sequence reference, prime-rl's list API (``compat``) and
its floor, eager and compiled. What each row measures: ``docs/benchmarks.md``, "How the suites measure"."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from packloss.compat import prime_rl
from packloss.compat.prime_rl import DefaultLossConfig
from packloss.core.bin import Plan
from packloss.core.engine import compute_loss
from packloss.core.outputs import Outputs
from packloss.core.pg import DPPO
from packloss.core.step import StepDenominators, count_denominators
from packloss.integrations.prime_rl.loss import packed_loss
from packloss.testing import OpCounter, Streams, make_archetype, random_seq_lens, reference
from packloss.tools.bench._measure import time_ms

__all__ = ["ARCHETYPES", "VARIANTS", "Schedule", "schedule", "bin_for", "NativeBin", "native_bin", "native_step", "run"]

ARCHETYPES = ("hot", "opd", "echo", "sdft")
VARIANTS = ("reference", "compat", "compat_floor", "eager", "compiled")


@dataclass(frozen=True)
class Schedule:
    """What one run measures: tokens per bin, sequences per bin, repeats, which archetypes compile."""

    num_tokens: int
    seq_counts: tuple[int, ...]
    warmup: int
    repeat: int
    reference_repeat: int
    compiled_archetypes: tuple[str, ...]


def schedule(quick: bool, use_compile: bool = True) -> Schedule:
    """The full schedule (32,768 tokens × 1/16/64/256 sequences) or the quick one (4,096 tokens ×
    1/16/64, only the hot path compiled). ``use_compile=False`` drops the compiled column."""
    if quick:
        return Schedule(4096, (1, 16, 64), 2, 10, 2, ("hot",) if use_compile else ())
    return Schedule(32768, (1, 16, 64, 256), 3, 100, 5, ARCHETYPES if use_compile else ())


def bin_for(archetype: str, num_tokens: int, num_seqs: int, device: str) -> Streams:
    """The benchmark's bin: a deterministic packing (seeded by the sequence count) of one archetype."""
    g = torch.Generator().manual_seed(10_000 + num_seqs)
    return make_archetype(archetype, random_seq_lens(num_tokens, num_seqs, g), seed=num_seqs, device=device)


@dataclass(frozen=True)
class NativeBin:
    """What the native columns run on, built once per bin before any timing: the plan (``rl`` DPPO,
    ``ce`` SFT, ``ref_kl`` REF_KL, token-normalised), its step denominators, the trainer log-probs."""

    plan: Plan
    denominators: StepDenominators
    trainer_logprobs: Tensor


def native_bin(streams: Streams) -> NativeBin:
    """The bin's :class:`~packloss.Plan` and its :func:`~packloss.count_denominators` (once each)."""
    plan = streams.plan(rl=DPPO, normalize="token")
    return NativeBin(plan, count_denominators([plan]), streams.trainer_logprobs)


def native_step(
    plan: Plan, trainer_logprobs: Tensor, denominators: StepDenominators
) -> tuple[Tensor, dict[str, Tensor]]:
    """The native loss of the bin and its metrics, the function the eager and compiled columns run (and
    compile): returning the metrics keeps them in the compiled graph, as a trainer that logs them needs."""
    result = compute_loss(plan, Outputs(logprobs=trainer_logprobs), denominators)
    return result.loss, result.metrics


def _reference_step(streams: Streams) -> Callable[[], None]:
    """Forward+backward of the per-sequence reference; the trainer log-probs are split inside the
    step (their views belong to each call's graph), the other streams once, outside."""
    seq_lens = list(streams.seq_lens)
    lists = {k: v for k, v in streams.lists().items() if k != "trainer_logprobs"}
    scales = streams.integer_scales()
    rl_loss_fn = reference.setup_rl_loss_fn(DefaultLossConfig())
    trn = streams.trainer_logprobs

    def step() -> None:
        trn.grad = None
        loss, _ = reference.compute_loss(list(torch.split(trn, seq_lens)), **lists, rl_loss_fn=rl_loss_fn, **scales)
        loss.backward()

    return step


def _compat_step(streams: Streams) -> Callable[[], None]:
    """Forward+backward of ``packloss.compat.prime_rl.compute_loss`` over per-sequence views of the
    streams, all split once outside the step: the trainer's ``torch.split`` is the trainer's cost, and
    compat reads the trainer log-probs' split input, never their per-view graph (the split of 256
    sequences, timed alone, is in docs/benchmarks.md)."""
    lists = streams.lists()
    scales = streams.integer_scales()
    rl_loss_fn = prime_rl.setup_rl_loss_fn(DefaultLossConfig())
    trn = streams.trainer_logprobs

    def step() -> None:
        trn.grad = None
        loss, _ = prime_rl.compute_loss(**lists, rl_loss_fn=rl_loss_fn, **scales)
        loss.backward()

    return step


def _compat_floor_step(streams: Streams) -> Callable[[], None]:
    """Forward+backward of compat's plan and engine with the lists read unchecked: ``torch.cat`` of
    each list without grad, the trainer log-probs' packed row and ``seq_lens`` as given (what a list
    API cannot do with less)."""
    lists = {k: v for k, v in streams.lists().items() if k != "trainer_logprobs"}
    scales = streams.integer_scales()
    rl_loss_fn = prime_rl.setup_rl_loss_fn(DefaultLossConfig())
    trn, seq_lens = streams.trainer_logprobs, streams.seq_lens

    def step() -> None:
        trn.grad = None
        packed = {k: None if v is None else torch.cat(v) for k, v in lists.items()}
        loss, _ = packed_loss({"trainer_logprobs": trn, **packed}, seq_lens, rl_loss_fn, **scales)
        loss.backward()

    return step


_NativeStep = Callable[[Plan, Tensor, StepDenominators], tuple[Tensor, dict[str, Tensor]]]


def _native_step(fn: _NativeStep, b: NativeBin) -> Callable[[], None]:
    def step() -> None:
        b.trainer_logprobs.grad = None
        fn(b.plan, b.trainer_logprobs, b.denominators)[0].backward()

    return step


def _count_ops(step: Callable[[], None]) -> tuple[int, int]:
    """(aten ops, syncs) of one call."""
    with OpCounter() as counter:
        step()
    return counter.total, counter.num_syncs


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _row(archetype: str, streams: Streams, variant: str, median_ms: float, **extra) -> dict:
    return {
        "suite": "loss",
        "shape": f"{archetype} {streams.num_tokens}/{streams.num_seqs}",
        "archetype": archetype,
        "num_tokens": streams.num_tokens,
        "num_seqs": streams.num_seqs,
        "variant": variant,
        "time_ms": median_ms,
        "peak_bytes": None,
        "aten_ops": None,
        "syncs": None,
        "first_call_s": None,
        "graphs": None,
        **extra,
    }


@dataclass(frozen=True)
class _Compiled:
    """An archetype's compiled step and dynamo's graph count before its first call."""

    fn: _NativeStep
    graphs_before: int


def _interleaved_ms(steps: dict[Any, Callable[[], None]], device: str, warmup: int, repeat: int) -> dict[Any, float]:
    """Median ms of each step, timed round-robin (one call of each per round) so that a burst of
    load from other processes hits every packing alike instead of one packing's whole measurement."""
    if warmup > 0:
        for step in steps.values():
            time_ms(step, device, warmup=warmup - 1, repeat=1)
    times: dict[Any, list[float]] = {k: [] for k in steps}
    for _ in range(repeat):
        for k, step in steps.items():
            times[k].append(time_ms(step, device, warmup=0, repeat=1))
    return {k: statistics.median(v) for k, v in times.items()}


def _first_call_s(step: Callable[[], None], device: str) -> float:
    """Wall seconds of one call (a compilation or recompilation included)."""
    t0 = time.perf_counter()
    step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _measure_archetype(
    archetype: str, device: str, p: Schedule, compiled: _Compiled | None, progress: Callable[[str], None]
) -> list[dict]:
    """Reference, compat, eager and (optionally) compiled rows of one archetype at every packing of the schedule."""
    bins = {s: bin_for(archetype, p.num_tokens, s, device) for s in p.seq_counts}
    rows: dict[tuple[str, int], dict] = {}

    for s, streams in bins.items():
        progress(f"loss {archetype} S={s} reference")
        step = _reference_step(streams)
        ops, syncs = _count_ops(step)
        t = time_ms(step, device, warmup=1, repeat=p.reference_repeat)
        rows["reference", s] = _row(archetype, streams, "reference", t, aten_ops=ops, syncs=syncs)

    progress(f"loss {archetype} eager")
    native = {s: native_bin(streams) for s, streams in bins.items()}  # plans and denominators: once, untimed
    eager = {s: _native_step(native_step, b) for s, b in native.items()}
    counts = {s: _count_ops(step) for s, step in eager.items()}
    for s, t in _interleaved_ms(eager, device, p.warmup, p.repeat).items():
        ops, syncs = counts[s]
        rows["eager", s] = _row(archetype, bins[s], "eager", t, aten_ops=ops, syncs=syncs)

    progress(f"loss {archetype} compat")
    makers = {"compat": _compat_step, "compat_floor": _compat_floor_step}
    lists = {(v, s): make(streams) for v, make in makers.items() for s, streams in bins.items()}
    list_counts = {key: _count_ops(step) for key, step in lists.items()}
    for (v, s), t in _interleaved_ms(lists, device, p.warmup, p.repeat).items():
        ops, syncs = list_counts[v, s]
        rows[v, s] = _row(archetype, bins[s], v, t, aten_ops=ops, syncs=syncs)

    if compiled is not None:
        steps = {s: _native_step(compiled.fn, b) for s, b in native.items()}
        first: dict[int, tuple[float, int]] = {}
        for s, step in steps.items():
            progress(f"loss {archetype} S={s} compiling")
            first[s] = (_first_call_s(step, device), _graphs_compiled() - compiled.graphs_before)
        progress(f"loss {archetype} compiled")
        for s, t in _interleaved_ms(steps, device, p.warmup, p.repeat).items():
            rows["compiled", s] = _row(archetype, bins[s], "compiled", t, first_call_s=first[s][0], graphs=first[s][1])

    for (_, s), row in rows.items():
        row["speedup_vs_reference"] = rows["reference", s]["time_ms"] / row["time_ms"]
    return sorted(rows.values(), key=lambda r: (r["num_seqs"], VARIANTS.index(r["variant"])))


def summarise(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per archetype and native variant: ``speedup_at_max`` (reference ÷ variant at the densest
    packing) and ``flatness`` (variant time at the densest packing ÷ at one sequence per bin)."""
    out: dict[str, dict[str, float]] = {}
    for archetype in dict.fromkeys(r["archetype"] for r in rows):
        mine = [r for r in rows if r["archetype"] == archetype]
        s_min, s_max = min(r["num_seqs"] for r in mine), max(r["num_seqs"] for r in mine)
        times = {(r["variant"], r["num_seqs"]): r["time_ms"] for r in mine}
        for variant in ("compat", "compat_floor", "eager", "compiled"):
            if (variant, s_max) in times and (variant, s_min) in times:
                out.setdefault(archetype, {})[f"{variant}_speedup_at_{s_max}"] = (
                    times[("reference", s_max)] / times[(variant, s_max)]
                )
                out[archetype][f"{variant}_flatness_{s_max}_vs_{s_min}"] = (
                    times[(variant, s_max)] / times[(variant, s_min)]
                )
    return out


def run(device: str, quick: bool, progress: Callable[[str], None] | None = None, *, use_compile: bool = True) -> dict:
    """Run the suite: ``{"rows": [...], "summary": {...}, "plan": {...}}`` (see the module docstring)."""
    p = schedule(quick, use_compile)
    report = progress or (lambda _description: None)
    rows: list[dict] = []
    for archetype in ARCHETYPES:
        compiled = None
        if archetype in p.compiled_archetypes:
            torch._dynamo.reset()  # each archetype's compile time starts from an empty dynamo cache
            compiled = _Compiled(torch.compile(native_step), _graphs_compiled())
        rows.extend(_measure_archetype(archetype, device, p, compiled, report))
    return {
        "rows": rows,
        "summary": summarise(rows),
        "plan": {
            "num_tokens": p.num_tokens,
            "seq_counts": list(p.seq_counts),
            "warmup": p.warmup,
            "repeat": p.repeat,
            "reference_repeat": p.reference_repeat,
            "compiled_archetypes": list(p.compiled_archetypes),
            "rl_loss": "DPPO (prime-rl DefaultLossConfig; packloss.DPPO)",
            "denominators": "count_denominators([plan]): each component's member count, float64 0-d tensors",
            "threads": torch.get_num_threads(),
        },
    }
