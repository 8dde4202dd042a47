"""packloss.tools.bench.head: the materialised and fused variants compute the same log-probs and entropy,
one variant measured in this process on a tiny shape, and the suite's rows (no timing is asserted)."""

from __future__ import annotations

import importlib

import pytest
import torch

from packloss.tools.bench import head


def _inputs(n: int = 12, h: int = 8, v: int = 40):
    g = torch.Generator().manual_seed(3)
    hidden = (torch.randn(n, h, generator=g) * 0.5).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.5).requires_grad_()
    return hidden, weight, torch.randint(0, v, (n,), generator=g), torch.rand(n, generator=g) + 0.5


def test_fused_and_materialised_variants_compute_the_same_step():
    hidden, weight, labels, temperature = _inputs()
    outs = {}
    for variant in ("materialised_eager", "fused"):
        lp, ent = head._step_fn(variant, 5, 16)(hidden, weight, labels, temperature)
        outs[variant] = (lp.detach(), ent.detach(), *torch.autograd.grad(lp.sum(), [hidden, weight]))
    for got, want in zip(outs["fused"], outs["materialised_eager"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown variant 'triton'"):
        head._step_fn("triton", 5, 16)


def test_one_variant_in_process_reports_time_and_peak():
    row = head._measure_variant("fused", n=16, h=8, v=64, device="cpu", repeat=2, chunk_size=8,
                                vocab_chunk_size=16, threads=torch.get_num_threads())  # fmt: skip
    assert set(row) == {"time_ms", "peak_bytes"}
    assert row["time_ms"] > 0 and isinstance(row["peak_bytes"], int)


def _in_process(target: str, kwargs: dict) -> dict:
    """``run_fresh`` without the fresh process: the named function, called here."""
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)(**kwargs)


def test_suite_rows_carry_their_ratios_to_the_materialised_eager_row(monkeypatch):
    monkeypatch.setitem(head.SHAPES, ("cpu", True), [(16, 8, 64, 1, 8, 16)])
    monkeypatch.setattr(head, "VARIANTS", ("materialised_eager", "fused"))  # no compile in a unit test
    monkeypatch.setattr(head, "run_fresh", _in_process)
    result = head.run("cpu", quick=True)
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["materialised_eager", "fused"]
    eager, fused = rows["materialised_eager"], rows["fused"]
    assert all(r["shape"] == "N=16,H=8,V=64" and (r["chunk_size"], r["vocab_chunk_size"]) == (8, 16)
               for r in rows.values())  # fmt: skip
    assert fused["peak_vs_eager"] == fused["peak_bytes"] / max(eager["peak_bytes"], 1)
    assert fused["time_vs_eager"] == fused["time_ms"] / eager["time_ms"]
    assert result["device"] == "cpu" and result["threads"] == torch.get_num_threads()
