"""packloss.tools.bench.distill: packloss's reverse KL and the naive one compute the same loss and
gradient, one variant measured in this process on a tiny shape, and the suite's rows (no timing is
asserted)."""

from __future__ import annotations

import importlib

import pytest
import torch

from packloss.tools.bench import distill


def test_packloss_and_naive_variants_compute_the_same_token_mean():
    g = torch.Generator().manual_seed(0)
    student = (2 * torch.randn(10, 33, generator=g)).requires_grad_()
    teacher = 2 * torch.randn(10, 33, generator=g)
    mask = torch.rand(10, generator=g) > 0.3
    results = {}
    for variant in ("naive_eager", "packloss_eager"):
        loss = distill._loss_fn(variant)(student, teacher, mask)
        results[variant] = (loss.detach(), *torch.autograd.grad(loss, student))
    for got, want in zip(results["packloss_eager"], results["naive_eager"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert results["naive_eager"][0] > 0
    with pytest.raises(ValueError, match="unknown variant 'packloss_triton'"):
        distill._loss_fn("packloss_triton")


def test_one_variant_in_process_reports_its_figures():
    row = distill._measure_variant("packloss_eager", n=8, v=32, device="cpu", dtype="float32", warmup=0, repeat=2)
    assert (row["shape"], row["variant"], row["dtype"], row["repeat"]) == ("8x32", "packloss_eager", "float32", 2)
    assert row["logits_bytes"] == 8 * 32 * 4 and row["time_ms"] > 0 and row["loss"] > 0
    assert row["peak_ratio_vs_inputs"] == (2 * row["logits_bytes"] + row["peak_bytes"]) / (3 * row["logits_bytes"])


def _in_process(target: str, kwargs: dict) -> dict:
    """``run_fresh`` without the fresh process: the named function, called here."""
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)(**kwargs)


def test_suite_rows_compare_with_the_naive_eager_row_on_the_same_data(monkeypatch):
    assert distill._plan("cpu", True)[1] == ("naive_eager", "packloss_eager")  # quick runs nothing compiled
    monkeypatch.setattr(distill, "_plan", lambda device, quick: ([(8, 32)], ("naive_eager", "packloss_eager"),
                                                                  "float32", 0, 1))  # fmt: skip
    monkeypatch.setattr(distill, "run_fresh", _in_process)
    result = distill.run("cpu", quick=True)
    assert (result["kind"], result["dtype"], result["quick"]) == ("reverse_kl", "float32", True)
    naive, fused = result["rows"]
    assert (naive["variant"], fused["variant"]) == ("naive_eager", "packloss_eager")
    assert fused["loss"] == pytest.approx(naive["loss"], rel=1e-5)  # the same seed: the same data
    for row in (naive, fused):
        assert row["peak_vs_naive_eager"] == naive["peak_bytes"] / max(row["peak_bytes"], 1)
        assert row["time_vs_naive_eager"] == row["time_ms"] / naive["time_ms"]
