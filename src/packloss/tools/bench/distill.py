"""The ``distill`` suite: full-vocabulary reverse KL from logits, fused vs naive autograd, time and
peak memory. What it measures: ``docs/benchmarks.md``, "How the suites measure"."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from packloss.tools.bench._measure import peak_bytes, release_freed_memory, reset_peak, run_fresh, time_ms
from packloss.vocab.distill import reverse_kl

__all__ = ["run", "VARIANTS"]

VARIANTS = ("naive_eager", "naive_compiled", "packloss_eager", "packloss_compiled")


def _naive_reverse_kl(s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reference: ``Σ_{members} KL(q‖p) / #members`` with materialised log-probabilities."""
    log_q = F.log_softmax(s.float(), dim=-1)  # [N, V]
    log_p = F.log_softmax(t.float(), dim=-1)  # [N, V]
    kl = F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)  # [N], Σ q (log q − log p)
    return torch.where(mask, kl, 0.0).sum() / mask.sum().clamp(min=1)


def _token_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``Σ_{members} per_token / #members`` of ``per_token [N]`` over ``mask [N]``."""
    return torch.where(mask, per_token, 0.0).sum() / mask.sum().clamp(min=1)


def _loss_fn(variant: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    if variant == "naive_eager":
        return _naive_reverse_kl
    if variant == "naive_compiled":
        return torch.compile(_naive_reverse_kl)
    if variant in ("packloss_eager", "packloss_compiled"):
        impl = variant.removeprefix("packloss_")
        return lambda s, t, m: _token_mean(reverse_kl(s, t, m, impl=impl), m)
    raise ValueError(f"unknown variant {variant!r}")


def _measure_variant(
    variant: str,
    n: int,
    v: int,
    device: str,
    dtype: str,
    warmup: int,
    repeat: int,
    threads: int | None = None,
    seed: int = 0,
) -> dict:
    """Build the inputs, compile (compiled variants), then measure one forward+backward's peak
    memory and the median time of ``repeat`` more. Runs inside a fresh process, with ``threads``
    intra-op threads (the caller's setting, e.g. ``packloss bench --threads``)."""
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    student = (2 * torch.randn(n, v, device=device, dtype=torch.float32)).to(torch_dtype).requires_grad_()
    teacher = (2 * torch.randn(n, v, device=device, dtype=torch.float32)).to(torch_dtype)
    mask = torch.rand(n, device=device) > 0.1  # [N]
    loss_fn = _loss_fn(variant)

    def step() -> torch.Tensor:
        student.grad = None
        loss = loss_fn(student, teacher, mask)
        loss.backward()
        return loss

    if variant.endswith("compiled"):
        step()  # compile outside the measured region
        student.grad = None
    release_freed_memory(device)
    baseline = reset_peak(device)
    loss = step()
    peak = peak_bytes(device) - baseline
    loss_value = float(loss.detach())
    del loss
    wall = time_ms(step, device, warmup=warmup, repeat=repeat)
    logits_bytes = student.numel() * student.element_size()
    return {
        "shape": f"{n}x{v}",
        "variant": variant,
        "dtype": dtype,
        "device": device,
        "time_ms": wall,
        "peak_bytes": peak,
        "logits_bytes": logits_bytes,
        "peak_ratio_vs_inputs": (2 * logits_bytes + peak) / (3 * logits_bytes),
        "loss": loss_value,
        "repeat": repeat,
        "threads": torch.get_num_threads(),
    }


def _plan(device: str, quick: bool) -> tuple[list[tuple[int, int]], tuple[str, ...], str, int, int]:
    """(shapes, variants, dtype, warmup, repeat). Quick mode skips the compiled variants: their
    compilation alone takes tens of seconds on a small CPU."""
    if quick:
        return [(512, 8192)], ("naive_eager", "packloss_eager"), "float32", 1, 3
    if device.startswith("cuda"):
        return [(8192, 131072), (16384, 151936)], VARIANTS, "bfloat16", 3, 10
    return [(2048, 32000), (4096, 65536)], VARIANTS, "float32", 1, 3


def run(device: str, quick: bool, progress: Callable[[str], None] | None = None) -> dict:
    """Run the suite; ``{"rows": [...], "kind": "reverse_kl", ...}`` (see the module docstring)."""
    shapes, variants, dtype, warmup, repeat = _plan(device, quick)
    rows = []
    for n, v in shapes:
        shape_rows = []
        for variant in variants:
            if progress is not None:
                progress(f"distill {n}x{v} {variant}")
            kwargs = dict(
                variant=variant,
                n=n,
                v=v,
                device=device,
                dtype=dtype,
                warmup=warmup,
                repeat=repeat,
                threads=torch.get_num_threads(),
            )
            shape_rows.append(run_fresh("packloss.tools.bench.distill:_measure_variant", kwargs))
        naive = next(r for r in shape_rows if r["variant"] == "naive_eager")
        for row in shape_rows:
            row["peak_vs_naive_eager"] = naive["peak_bytes"] / max(row["peak_bytes"], 1)
            row["time_vs_naive_eager"] = row["time_ms"] / naive["time_ms"]
        rows.extend(shape_rows)
    return {"rows": rows, "kind": "reverse_kl", "dtype": dtype, "quick": quick}
