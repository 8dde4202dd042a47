"""Timing, peak memory and the values check shared by the benchmark suites.

Peak memory is measured in a fresh process per variant (:func:`run_fresh`) so one variant's
allocations never hide another's: on CPU the peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` after the inputs exist), on CUDA ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["time_ms", "reset_peak", "peak_bytes", "run_fresh", "release_freed_memory", "ValuesDisagree", "check",
           "import_peer"]  # fmt: skip


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device: str, warmup: int = 2, repeat: int = 10) -> float:
    """Median wall time of ``fn()`` in milliseconds (CUDA events on a GPU, synchronised only around
    the timed region)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def release_freed_memory(device: str) -> None:
    """Return freed heap pages to the OS so the next peak baseline holds only live tensors."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_peak(device: str) -> int:
    """Reset the peak-memory counter; return the bytes in use now (the baseline)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux)
    return _vm_kib("VmRSS") * 1024


def peak_bytes(device: str) -> int:
    """Peak bytes in use since :func:`reset_peak`."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _vm_kib("VmHWM") * 1024


def run_fresh(target: str, kwargs: dict, timeout: float = 900) -> dict:
    """Run ``module:function(**kwargs)`` in a fresh Python process and return the dict it returns.

    The function must return a JSON-serialisable dict; it typically builds its inputs, calls
    :func:`reset_peak`, runs forward+backward, and reports :func:`peak_bytes` minus the baseline.
    """
    module, _, function = target.partition(":")
    code = (
        "import json, sys, importlib\n"
        f"fn = getattr(importlib.import_module({module!r}), {function!r})\n"
        "out = fn(**json.loads(sys.argv[1]))\n"
        "print('@@RESULT@@' + json.dumps(out))\n"
    )
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(kwargs)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{target} failed in a fresh process:\n{proc.stderr[-4000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith("@@RESULT@@"):
            return json.loads(line[len("@@RESULT@@") :])
    raise RuntimeError(f"{target} printed no result:\n{proc.stdout[-2000:]}")


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


def import_peer(module: str, attr: str | None = None) -> tuple[Any, str | None]:
    """``(module or its attr, None)``, or ``(None, why not)``: a peer that cannot be imported is skipped."""
    try:
        mod = importlib.import_module(module)
        return (getattr(mod, attr) if attr else mod), None
    except Exception as exc:  # ImportError, or a peer's own import-time failure (e.g. a missing Triton)
        return None, f"{module} not importable ({type(exc).__name__}: {exc}): skipped"
