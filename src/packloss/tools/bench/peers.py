"""The ``peers`` suite: the same data through packloss and through the peers' own code, where installed
(TRL's and verl's loss math, the trainer adapters' whole calls against TRL's, verl's and OpenRLHF's,
cut-cross-entropy's, TRL's and Liger's fused kernels), every variant checked
to compute the same value and gradient before it is timed; ratios are packloss ÷ peer, measured in the
same run. What each row measures: ``docs/benchmarks.md``, "How the suites measure"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

import torch

from packloss.tools.bench.peers_adapters import METRIC_RTOL_F64, run_adapters
from packloss.tools.bench.peers_gae import run_gae
from packloss.tools.bench.peers_rl import METRIC_ATOL, RL_RTOL, run_rl
from packloss.tools.bench.peers_vocab import HEAD_RTOL, JSD_BETA, run_fused, run_head_floors

__all__ = ["Sizes", "sizes", "run"]


@dataclass(frozen=True)
class Sizes:
    """RL ``(tokens, sequences)`` shapes / compiled variants or not / warm-up / repeats; head and distill
    ``(N, H, V)`` shapes timed and the one checked, timed calls per process, fresh processes per variant;
    the adapter rows' ``(tokens, rows)`` shapes (None: the RL shapes), with the RL warm-up and repeats."""

    rl_shapes: tuple[tuple[int, int], ...]
    compiled: bool
    rl_warmup: int
    rl_repeat: int
    fused_shapes: tuple[tuple[int, int, int], ...]
    fused_check: tuple[int, int, int]
    fused_repeat: int
    fused_rounds: int
    adapter_shapes: tuple[tuple[int, int], ...] | None = None


def sizes(quick: bool) -> Sizes:
    """Default: RL at 32,768 packed tokens in 32 sequences (≈ 62k padded elements) and 131,072 in 256;
    heads at ``2048 × 512 × 32768`` and ``512 × 1024 × 65536`` (the same flops, twice the hidden size),
    3 timed calls in each of 2 processes per variant; adapters at 32,768 tokens in 256 rows (≈ 65k padded
    positions) and 4,096 in 32. Quick: 2,048 tokens in 8 sequences, eager only; heads ``256 × 64 × 2048``,
    one process each."""
    if quick:
        return Sizes(((2048, 8),), False, 2, 10, ((256, 64, 2048),), (256, 64, 2048), 3, 1)
    heads = ((2048, 512, 32768), (512, 1024, 65536))
    adapters = ((32768, 256), (4096, 32))
    return Sizes(((32768, 32), (131072, 256)), True, 3, 50, heads, (512, 128, 8192), 3, 2, adapters)


def run(device: str, quick: bool, progress: Callable[[str], None] | None = None, *, size: Sizes | None = None) -> dict:
    """Run the suite on CPU: ``{"rows": [...], "notes": [...], "sizes": {...}}`` (see the module doc).
    ``--device cuda`` is refused: cut-cross-entropy's and Liger's GPU paths are Triton kernels, another
    comparison than the CPU one this suite makes."""
    if device != "cpu":
        raise ValueError(f"packloss bench peers runs on CPU only, got --device {device}")
    s = size or sizes(quick)
    report = progress or (lambda _description: None)
    notes: list[str] = []
    rows = run_rl(list(s.rl_shapes), s.compiled, s.rl_warmup, s.rl_repeat, report, notes)
    adapter_shapes = list(s.rl_shapes if s.adapter_shapes is None else s.adapter_shapes)
    rows.extend(run_adapters(adapter_shapes, s.compiled, s.rl_warmup, s.rl_repeat, report, notes))
    rows.extend(run_gae(list(s.rl_shapes), s.rl_warmup, s.rl_repeat, report, notes))
    for kind in ("head", "distill", "rl head"):
        shapes = list(s.fused_shapes)
        repeats = (s.fused_repeat, s.fused_rounds)
        fused = run_fused(kind, shapes, s.fused_check, *repeats, device, report, notes, s.compiled)
        rows.extend(fused)
        if kind == "head":
            rows.extend(run_head_floors(shapes, *repeats, device, report, fused))
    tolerances = {"rl_rtol": RL_RTOL, "metric_atol": METRIC_ATOL, "metric_rtol_f64": METRIC_RTOL_F64}
    return {
        "rows": rows,
        "notes": notes,
        "sizes": vars(s) | tolerances | {"fused_rtol": HEAD_RTOL},
        "jsd_beta": JSD_BETA,
        "threads": torch.get_num_threads(),
        "versions": _versions(),
    }


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"torch": torch.__version__}
    for name in ("trl", "verl", "cut_cross_entropy", "liger_kernel"):
        try:
            out[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
