"""The ``head`` suite: per-token log-probs (+ entropy) from hidden states, materialised vs fused.

Variants, each forward+backward of ``Σ logprobs`` (entropy computed, not differentiated) w.r.t.
``hidden [N, H]`` and ``weight [V, H]`` with per-token temperatures, each in a fresh process:

* ``materialised_eager``: ``logits = h Wᵀ`` ``[N, V]``, ``log_softmax``, gather, autograd;
* ``materialised_compiled``: the same function under ``torch.compile``;
* ``fused``: :func:`packloss.vocab.head.linear_logprobs` (chunked, never ``N × V``).

Peak memory is measured on the first run (after compiling, for the compiled variant), ``peak_bytes``
minus the baseline with the inputs allocated: CPU peak RSS, CUDA ``max_memory_allocated``. Fused rows carry
``peak_vs_eager`` and ``time_vs_eager`` (fused ÷ materialised eager, same shape).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from packloss.tools.bench._measure import peak_bytes, release_freed_memory, reset_peak, run_fresh, time_ms
from packloss.vocab.head import linear_logprobs

__all__ = ["run"]

VARIANTS = ("materialised_eager", "materialised_compiled", "fused")

# (N, H, V, timed repeats, token chunk, vocab chunk) per device and mode.
SHAPES = {
    ("cpu", True): [(512, 128, 4096, 3, 128, 1024)],
    ("cpu", False): [(8192, 1024, 65536, 1, 1024, 8192)],  # one fwd+bwd is ~1 min on a 2-core CPU
    ("cuda", True): [(4096, 2048, 32768, 5, 4096, 16384)],
    ("cuda", False): [(16384, 4096, 152064, 5, 4096, 16384)],
}


def _materialised(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(h Wᵀ / T)[label]`` and the (detached) entropy, through ``[N, V]`` logits."""
    logp = torch.log_softmax((hidden @ weight.T).float() / temperature[:, None], dim=-1)  # [N, V]
    entropy = -(logp.exp() * logp).sum(-1).detach()  # [N]
    return logp.gather(1, labels[:, None]).squeeze(1), entropy


def _step_fn(variant: str, chunk_size: int, vocab_chunk_size: int) -> Callable:
    if variant == "fused":
        return lambda h, w, y, t: linear_logprobs(
            h, w, y, temperature=t, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size
        )
    if variant == "materialised_compiled":
        return torch.compile(_materialised)
    if variant == "materialised_eager":
        return _materialised
    raise ValueError(f"unknown variant {variant!r}")


def _measure_variant(
    variant: str,
    n: int,
    h: int,
    v: int,
    device: str,
    repeat: int,
    chunk_size: int,
    vocab_chunk_size: int,
    threads: int,
) -> dict:
    """One variant in this (fresh) process, on ``threads`` intra-op threads: ``{"time_ms", "peak_bytes"}``."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(device).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.05).to(device).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    temperature = (torch.rand(n, generator=g) + 0.5).to(device)
    fn = _step_fn(variant, chunk_size, vocab_chunk_size)

    def step() -> None:
        logprobs, _ = fn(hidden, weight, labels, temperature)
        torch.autograd.grad(logprobs.sum(), [hidden, weight])

    if variant == "materialised_compiled":
        step()  # compilation, outside the measured peak
        release_freed_memory(device)
    base = reset_peak(device)
    step()
    peak = peak_bytes(device) - base
    return {"time_ms": time_ms(step, device, warmup=0, repeat=repeat), "peak_bytes": peak}  # peak run = warm-up


def run(device: str, quick: bool, progress: Callable[[str], None] | None = None) -> dict:
    """Every variant at every shape of ``SHAPES[(device type, quick)]``, each in a fresh process with
    this process's number of torch threads."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    rows = []
    for n, h, v, repeat, chunk_size, vocab_chunk_size in SHAPES[(kind, quick)]:
        shape = f"N={n},H={h},V={v}"
        by_variant = {}
        for variant in VARIANTS:
            if progress is not None:
                progress(f"head {shape} {variant}")
            kwargs = dict(
                variant=variant, n=n, h=h, v=v, device=device, repeat=repeat,
                chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size, threads=torch.get_num_threads(),
            )  # fmt: skip
            by_variant[variant] = {"shape": shape, "variant": variant, **run_fresh(
                "packloss.tools.bench.head:_measure_variant", kwargs)}  # fmt: skip
        eager, fused = by_variant["materialised_eager"], by_variant["fused"]
        fused["peak_vs_eager"] = fused["peak_bytes"] / max(eager["peak_bytes"], 1)
        fused["time_vs_eager"] = fused["time_ms"] / eager["time_ms"]
        for row in by_variant.values():
            row.update(chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)
        rows.extend(by_variant.values())
    return {"rows": rows, "device": device, "torch": torch.__version__, "threads": torch.get_num_threads()}
